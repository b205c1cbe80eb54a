"""Load a workflow from a DSL module or a GraphSpec JSON file."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from engine.flow.dsl import Workflow
from engine.flow.validate import parse_spec
from engine.spec.graph import GraphSpec


class WorkflowLoadError(ValueError):
    """The path does not hold a loadable workflow."""


def _module_name(path: Path) -> tuple[str, Path]:
    """Dotted module name of `path` and the directory to import it from: packages
    (folders with `__init__.py`) are walked up so `workflows/diamond.py` imports as
    `workflows.diamond` and its functions keep importable `module:function` names."""
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").exists():
        parts.append(folder.name)
        folder = folder.parent
    return ".".join(reversed(parts)), folder


def import_workflow_module(path: Path) -> ModuleType:
    name, root = _module_name(path.resolve())
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    existing = sys.modules.get(name)
    if existing is not None and Path(getattr(existing, "__file__", "") or "").resolve() == path.resolve():
        return existing
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise WorkflowLoadError(f"{path}: cannot import {name!r}: {exc}") from exc


def workflow_from_module(module: ModuleType, where: str) -> GraphSpec:
    found: Any = getattr(module, "workflow", None)
    if found is None:
        candidates = [v for v in vars(module).values() if isinstance(v, Workflow | GraphSpec)]
        if len(candidates) != 1:
            raise WorkflowLoadError(
                f"{where}: expected one Workflow (name it `workflow`), found {len(candidates)}"
            )
        found = candidates[0]
    if isinstance(found, Workflow):
        return found.to_spec()
    if isinstance(found, GraphSpec):
        return found
    raise WorkflowLoadError(f"{where}: `workflow` is a {type(found).__name__}, not a Workflow")


def load_workflow(path: str | Path) -> GraphSpec:
    """The GraphSpec of a `.py` DSL module or a `.json` GraphSpec file.

    Raises WorkflowLoadError for unreadable files and GraphValidationError (with every
    schema problem) for malformed JSON documents.
    """
    p = Path(path)
    if not p.is_file():
        raise WorkflowLoadError(f"{p}: no such file")
    if p.suffix == ".json":
        return parse_spec(p.read_bytes())
    if p.suffix == ".py":
        return workflow_from_module(import_workflow_module(p), str(p))
    raise WorkflowLoadError(f"{p}: expected a .py DSL module or a .json GraphSpec")


def load_source(source: str, name: str = "<workflow source>") -> GraphSpec:
    """The GraphSpec built by DSL source text (as written by `to_python`)."""
    module = ModuleType("omniflow_source")
    exec(compile(source, name, "exec"), module.__dict__)
    return workflow_from_module(module, name)
