"""Paths a workflow names, confined to the roots the server configures.

A spec saved in the studio is data: where it names a place on disk it names it relative to a
root, never as a server path. Three kinds of names:

* **user files**: the llm role param `disk_path` (the disk KV tier) and the sglang_llm role's
  `hicache.disk_path` (its HiCache disk tier), a node's `out_dir`, and
  every param its op declares an output folder (`@op(output_dirs=...)`, read from the op
  registry: `media.save_outputs`'s `out_dir`) are relative to the owner's own folder,
  `<OMNIFLOW_DATA_DIR>/users/<user id>/` (made 0700 on first use). A declared output folder the
  node does not give is `outputs/` there (the op's own default is relative to the server's
  working directory). The rules are the engine's (`engine.spec.userfiles`): a node's names stay
  names in the spec its run executes, and the process that writes (a role worker on its node, or
  the run worker's in-process unit) resolves them under its own users root and the run's owner
  (`NodeCall.owner`), so every node writes under its own data dir;
* **model checkpoints**: a role `model` of a kind that loads checkpoints (`llm`, `sglang_llm`,
  `diffusion`) is a built-in model name or a checkpoint folder (one holding a `config.json`)
  relative to one of `OMNIFLOW_MODEL_DIRS` (the first that holds it). `find_checkpoint` is
  what validation asks, `list_checkpoints` what the models endpoint shows: names relative to
  a root, never the server path.

Absolute names, `..`, and symbolic links (any component, under the root) are refused with an
issue on the role or node naming the param. `spec_path_issues` checks the names (no file
system: the editor and REST validation report them); `resolve_role_paths` turns the roles' into
server paths just before a run or deployment starts, on the process that starts its role units
(the run worker, or the node agent that launches a deployment's share: its own data dir), and
refuses links and missing checkpoints; `resolve_spec_paths` resolves the nodes' names too, here,
only to check them when a run or deployment is asked for; `server_path_name` is how run outputs
hide what it made (see `runs.store`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from engine.client.graphs import Issue
from engine.spec.graph import GraphSpec
from engine.spec.ops import OpRegistry
from engine.spec.userfiles import (
    DEFAULT_OUT_DIR,
    OUT_DIR_PARAM,
    UserPathRefused,
    UsersRoot,
    name_problem,
    owner_id,
    resolve_under,
)

USER_PATH_ROLE_PARAMS = ("disk_path", "hicache.disk_path")
"""Role params naming a folder under the owner's root (dotted: a key inside a mapping param, as
`sglang_llm`'s HiCache disk tier)."""
USER_PATH_NODE_PARAMS = (OUT_DIR_PARAM,)
"""Node params naming a folder under the owner's root, whatever the node's op (besides the
output folders its op declares)."""
CHECKPOINT_ROLE_KINDS = frozenset({"llm", "sglang_llm", "diffusion"})
"""Role kinds whose `model` may be a checkpoint folder (the others take built-in names only)."""


class PathRefused(LookupError):
    """A named path cannot be used: `issues` says which and why (a run that meets it at its start
    ends failed, like one whose uploaded file is gone)."""

    def __init__(self, issues: list[Issue]) -> None:
        self.issues = issues
        super().__init__("; ".join(issue.message for issue in issues))


@dataclass(frozen=True, slots=True)
class PathRoots:
    """The roots names resolve under (from `studio.config.StudioConfig`)."""

    users: Path
    """`<data dir>/users`: one folder per user id below it."""
    models: tuple[Path, ...]
    hidden: tuple[Path, ...] = ()
    """Other folders of the server an error may name and its users may not see (the model cache)."""

    @classmethod
    def of(cls, config: Any) -> PathRoots:
        return cls(users=config.users_root, models=tuple(config.model_dirs), hidden=(config.model_cache,))

    def with_hidden(self, more: Iterable[Path]) -> PathRoots:
        """These roots, with `more` folders cut out of errors (another node's model roots)."""
        return replace(self, hidden=tuple(dict.fromkeys((*self.hidden, *more))))

    @property
    def hidden_in_errors(self) -> tuple[Path, ...]:
        """Every folder but the users' that `without_roots` cuts out of a message."""
        return (*self.models, *self.hidden)

    def user_root(self, user_id: Any) -> Path:
        """The user's own folder, made (0700) if need be (`UsersRoot.folder`)."""
        try:
            return UsersRoot(self.users).folder(owner_id(int(user_id)))
        except UserPathRefused as exc:
            raise PathRefused([Issue("path_refused", str(exc))]) from None


CHECKPOINT_MARKER = "config.json"
"""What makes a folder a checkpoint (a Hugging Face config beside the weights)."""
LIST_DEPTH = 3
"""How deep below a model root `list_checkpoints` looks (`org/model/revision`)."""
LIST_LIMIT = 500
"""The most checkpoints `list_checkpoints` reports (a root holding more is cut short, and says so)."""


def find_checkpoint(roots: tuple[Path, ...], name: str) -> Path | None:
    """The checkpoint folder `name` stands for under the first root holding one (None: no root
    does, or the name is not a relative name: `name_problem`). Never follows a link."""
    if name_problem(name) is not None:
        return None
    for root in roots:
        try:
            path = resolve_under(root, name)
        except ValueError:
            return None
        if path.is_dir() and (path / CHECKPOINT_MARKER).is_file() and not (path / CHECKPOINT_MARKER).is_symlink():
            return path
    return None


@dataclass(frozen=True, slots=True)
class Checkpoints:
    """The checkpoints found under the model roots, by name relative to their root."""

    names: list[str]
    truncated: bool
    """More than `LIST_LIMIT` were there."""


def list_checkpoints(roots: tuple[Path, ...]) -> Checkpoints:
    """Checkpoint folders under each root, at most `LIST_DEPTH` deep, first root first (a name
    held by two roots counts once, as `find_checkpoint` resolves it). Links and hidden folders
    are skipped, and a checkpoint's own subfolders are not searched."""
    names: dict[str, None] = {}
    for root in roots:
        stack = [(root, 0)]
        while stack:
            folder, depth = stack.pop()
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name, reverse=True)
            except OSError:
                continue
            for entry in entries:
                if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                    continue
                path = Path(entry.path)
                marker = path / CHECKPOINT_MARKER
                if marker.is_file() and not marker.is_symlink():
                    names[str(PurePosixPath(path.relative_to(root)))] = None
                    if len(names) > LIST_LIMIT:
                        return Checkpoints(sorted(names)[:LIST_LIMIT], truncated=True)
                elif depth + 1 < LIST_DEPTH:
                    stack.append((path, depth + 1))
    return Checkpoints(sorted(names), truncated=False)


def _builtin_model(name: str) -> bool:
    from engine.client.models import is_builtin_model

    return is_builtin_model(name)


def _output_dirs(registry: OpRegistry, node_kind: Any, op: Any) -> tuple[str, ...]:
    """The output folders a python node's op declares (none for an op the registry lacks)."""
    if node_kind != "python" or not isinstance(op, str):
        return ()
    found = registry.find(op)
    return () if found is None else found.info.output_dirs


def _node_path_params(registry: OpRegistry, node_kind: Any, op: Any) -> tuple[str, ...]:
    declared = _output_dirs(registry, node_kind, op)
    return (*USER_PATH_NODE_PARAMS, *(p for p in declared if p not in USER_PATH_NODE_PARAMS))


_ABSENT = object()


def _role_param(params: dict[str, Any], dotted: str) -> Any:
    """The value at `dotted` in a role's params (`_ABSENT`: not given, or a parent is not a mapping)."""
    value: Any = params
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return _ABSENT
        value = value[key]
    return value


def _with_role_param(params: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """`params` with `dotted` set to `value`; the mappings on the way are copied, not modified."""
    head, _, rest = dotted.partition(".")
    return {**params, head: _with_role_param(params[head], rest, value) if rest else value}


def _issue(message: str, *, role: str | None = None, node: str | None = None, param: str) -> Issue:
    return Issue("path_refused", message, role=role, node=node, path=param)


def spec_path_issues(spec: GraphSpec, registry: OpRegistry) -> list[Issue]:
    """Names that are not relative (absolute, `..`): an issue on the role or node, naming the param.
    `registry`: the ops whose declared output folders are names too."""
    issues = []
    for role in spec.roles:
        for param in USER_PATH_ROLE_PARAMS:
            name = _role_param(role.params, param)
            if name is not _ABSENT and (problem := name_problem(name)):
                issues.append(_issue(f"role {role.name!r}: params.{param}: {problem}", role=role.name,
                                     param=f"params.{param}"))
        if role.model is not None and (problem := name_problem(role.model)):
            issues.append(_issue(f"role {role.name!r}: model: {problem} (name a built-in model or a checkpoint"
                                 " folder under the server's model directories)", role=role.name, param="model"))
    for node in spec.nodes:
        for param in _node_path_params(registry, node.kind, node.op):
            if param in node.params and (problem := name_problem(node.params[param])):
                issues.append(_issue(f"node {node.id!r}: params.{param}: {problem}", node=node.id,
                                     param=f"params.{param}"))
    return issues


def _model_path(roots: PathRoots, role: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the model reference the workers get, or the problem)."""
    model = role.get("model")
    if model is None or role.get("kind") not in CHECKPOINT_ROLE_KINDS or _builtin_model(model):
        return model, None
    for root in roots.models:
        try:
            resolve_under(root, model)
        except ValueError as exc:
            return None, str(exc)
    path = find_checkpoint(roots.models, model)
    if path is not None:
        return str(path), None
    where = f"{len(roots.models)} configured" if roots.models else "none configured: OMNIFLOW_MODEL_DIRS"
    return None, f"{model!r} is neither a built-in model nor a checkpoint in the model directories ({where})"


def model_reference(roots: PathRoots, kind: str, model: str) -> str:
    """What a role's workers get for `model`: a built-in name as it is, a checkpoint name as its
    folder under the model directories (the first that holds it); PathRefused when there is none."""
    resolved, problem = _model_path(roots, {"kind": kind, "model": model})
    if problem is not None or resolved is None:
        raise PathRefused([_issue(f"model: {problem}", param="model")])
    return resolved


def resolve_role_paths(document: dict[str, Any], user_id: Any, roots: PathRoots) -> dict[str, Any]:
    """`document` (a GraphSpec dict) with its roles' names (`USER_PATH_ROLE_PARAMS`, checkpoint
    models) replaced by the server paths they stand for on this process, which starts the role
    units; its nodes' names stay names (whoever writes resolves them: `engine.spec.userfiles`).
    The document itself is not modified. PathRefused lists every name that cannot be used."""
    return _resolved(document, user_id, roots, None)


def resolve_spec_paths(document: dict[str, Any], user_id: Any, roots: PathRoots,
                       registry: OpRegistry) -> dict[str, Any]:
    """`resolve_role_paths`, and the nodes' output folder names too (`registry`: the ops whose
    declared output folders are names) as they resolve here: how a run or deployment asked for
    is checked before it is queued. PathRefused lists every name that cannot be used."""
    return _resolved(document, user_id, roots, registry)


def _resolved(document: dict[str, Any], user_id: Any, roots: PathRoots,
              registry: OpRegistry | None) -> dict[str, Any]:
    """The document with its roles' names resolved, and its nodes' too given a `registry`."""
    issues: list[Issue] = []
    root = roots.user_root(user_id)

    def under(name: Any, where: str, **at: Any) -> str | None:
        try:
            return str(resolve_under(root, name))
        except ValueError as exc:
            issues.append(_issue(f"{where}: {exc}", **at))
            return None

    roles = []
    for role in document.get("roles", []):
        params = dict(role.get("params", {}))
        for param in USER_PATH_ROLE_PARAMS:
            name = _role_param(params, param)
            if name is not _ABSENT:
                params = _with_role_param(params, param, under(name, f"role {role['name']!r}: params.{param}",
                                                               role=role["name"], param=f"params.{param}"))
        model, problem = _model_path(roots, role)
        if problem is not None:
            issues.append(_issue(f"role {role['name']!r}: model: {problem}", role=role["name"], param="model"))
        roles.append({**role, "params": params, **({"model": model} if model is not None else {})})
    nodes = document.get("nodes", [])
    if registry is not None:
        nodes = []
        for node in document.get("nodes", []):
            params = dict(node.get("params", {}))
            for param in _output_dirs(registry, node.get("kind"), node.get("op")):
                params.setdefault(param, DEFAULT_OUT_DIR)
            for param in _node_path_params(registry, node.get("kind"), node.get("op")):
                if param in params:
                    params[param] = under(params[param], f"node {node['id']!r}: params.{param}", node=node["id"],
                                          param=f"params.{param}")
            nodes.append({**node, "params": params} if params else node)
    if issues:
        raise PathRefused(issues)
    return {**document, "roles": roles, "nodes": nodes}


def server_path_name(value: str, user_root: Path) -> str | None:
    """The name, relative to the user's folder, of a server path under it (None: not under it)."""
    if not value.startswith(str(user_root) + os.sep) and value != str(user_root):
        return None
    return str(PurePosixPath(Path(value).relative_to(user_root))) or "."


def without_roots(text: str, roots: PathRoots) -> str:
    """An error message as its user may read it: a path under a model root (or the model cache)
    reads as the model's name there, a path in a user's folder as its name in that folder, so what the API shows never
    says where the server keeps things (the worker's log keeps the whole message)."""
    if not text:
        return text
    text = re.sub(re.escape(str(roots.users) + os.sep) + r"\d+(?:" + re.escape(os.sep) + r"|\b)", "", text)
    for root in roots.hidden_in_errors:
        text = text.replace(str(root) + os.sep, "")
    return text


def output_folder_names(document: dict[str, Any], registry: OpRegistry) -> list[str]:
    """The names (relative to the owner's folder) of every output folder `document`'s nodes write
    under: their output folder params, given or the declared ones' default, each once. Checks
    nothing: a name that does not resolve is refused where it is used (`resolve_under`)."""
    names: dict[str, None] = {}
    for node in document.get("nodes", []):
        params = dict(node.get("params", {}))
        for param in _output_dirs(registry, node.get("kind"), node.get("op")):
            params.setdefault(param, DEFAULT_OUT_DIR)
        for param in _node_path_params(registry, node.get("kind"), node.get("op")):
            if isinstance(params.get(param), str):
                names[params[param]] = None
    return list(names)


def run_folders(user_root: Path, names: list[str], run_id: str) -> list[Path]:
    """The folders a run's ops wrote their files into, by the layout of the output ops
    (`media.save_outputs`: `<output folder>/<run id>/`): `<name>/<run_id>` under `user_root` for
    each output folder name, where it is a directory (never through a link). A name that does not
    resolve (absolute, `..`, through a link) adds nothing: it was refused when the run started, so
    no op wrote under it. Nothing is removed here."""
    folders: dict[Path, None] = {}
    for name in names:
        try:
            folder = resolve_under(user_root, name) / run_id
        except ValueError:
            continue
        if folder.is_dir() and not folder.is_symlink():
            folders[folder] = None
    return list(folders)


def run_output_folders(document: dict[str, Any], run_id: str, user_root: Path, registry: OpRegistry) -> list[Path]:
    """`run_folders` of `document`'s output folder names (`output_folder_names`)."""
    return run_folders(user_root, output_folder_names(document, registry), run_id)
