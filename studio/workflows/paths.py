"""Paths a workflow names, confined to the roots the server configures.

A spec saved in the studio is data: where it names a place on disk it names it relative to a
root, never as a server path. Three kinds of names:

* **user files**: the llm role param `disk_path` (the disk KV tier) and a node's `out_dir`
  (the output folder of ops such as `save_outputs`) are relative to the owner's own folder,
  `<OMNIFLOW_DATA_DIR>/users/<user id>/` (made 0700 on first use). An output op given no
  `out_dir` writes under `outputs/` there;
* **model checkpoints**: a role `model` of a kind that loads checkpoints (`llm`, `sglang_llm`,
  `diffusion`) is a built-in model name or a checkpoint folder relative to one of
  `OMNIFLOW_MODEL_DIRS` (the first that holds it).

Absolute names, `..`, and symbolic links (any component, under the root) are refused with an
issue on the role or node naming the param. `spec_path_issues` checks the names (no file
system: the editor and REST validation report them); `resolve_spec_paths` turns them into
server paths just before a run or deployment starts (it also refuses links and missing
checkpoints); `server_path_name` is how run outputs hide what it made (see `runs.store`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from engine.flow.validate import Issue
from engine.spec.graph import GraphSpec

USER_PATH_ROLE_PARAMS = ("disk_path",)
"""Role params naming a folder under the owner's root."""
USER_PATH_NODE_PARAMS = ("out_dir",)
"""Node params naming a folder under the owner's root."""
OUTPUT_OPS = frozenset({"save_outputs"})
"""Ops (by their function's name) that write under `out_dir`, defaulting to a folder relative to
the process's working directory: the studio always gives them one under the owner's root."""
DEFAULT_OUT_DIR = "outputs"
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

    @classmethod
    def of(cls, config: Any) -> PathRoots:
        return cls(users=config.users_root, models=tuple(config.model_dirs))

    def user_root(self, user_id: Any) -> Path:
        """The user's own folder, made (0700) if need be."""
        root = self.users / str(int(user_id))
        self.users.mkdir(mode=0o700, parents=True, exist_ok=True)
        root.mkdir(mode=0o700, exist_ok=True)
        if root.is_symlink() or not root.is_dir():
            raise PathRefused([Issue("path_refused", f"the folder of user {user_id} is not a plain directory")])
        os.chmod(root, 0o700)
        return root


def name_problem(name: Any) -> str | None:
    """Why `name` is not a relative name (None: it is one). No file system access."""
    if not isinstance(name, str) or not name.strip():
        return f"{name!r} is not a name"
    if "\x00" in name or "\\" in name:
        return f"{name!r} holds a NUL or a backslash"
    path = PurePosixPath(name)
    if path.is_absolute() or name.startswith("~"):
        return f"{name!r} is an absolute path; name a folder relative to your files instead"
    if ".." in path.parts:
        return f"{name!r} climbs out of its root with '..'"
    return None


def resolve_under(root: Path, name: str) -> Path:
    """`root / name` for a relative `name`, refused (ValueError) when the name is not relative or
    any existing component below `root` is a symbolic link. Nothing is created."""
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    path = root
    for part in PurePosixPath(name).parts:
        if part == ".":
            continue
        path = path / part
        if path.is_symlink():
            raise ValueError(f"{name!r}: {str(path.relative_to(root))!r} is a symbolic link")
    return path


def _builtin_model(name: str) -> bool:
    from engine.compute.models.catalog import BUILTIN_MODELS

    return name in BUILTIN_MODELS


def _op_name(op: str | None) -> str:
    return (op or "").replace(":", ".").rsplit(".", 1)[-1]


def _issue(message: str, *, role: str | None = None, node: str | None = None, param: str) -> Issue:
    return Issue("path_refused", message, role=role, node=node, path=param)


def spec_path_issues(spec: GraphSpec) -> list[Issue]:
    """Names that are not relative (absolute, `..`): an issue on the role or node, naming the param."""
    issues = []
    for role in spec.roles:
        for param in USER_PATH_ROLE_PARAMS:
            if param in role.params and (problem := name_problem(role.params[param])):
                issues.append(_issue(f"role {role.name!r}: params.{param}: {problem}", role=role.name,
                                     param=f"params.{param}"))
        if role.model is not None and (problem := name_problem(role.model)):
            issues.append(_issue(f"role {role.name!r}: model: {problem} (name a built-in model or a checkpoint"
                                 " folder under the server's model directories)", role=role.name, param="model"))
    for node in spec.nodes:
        for param in USER_PATH_NODE_PARAMS:
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
            path = resolve_under(root, model)
        except ValueError as exc:
            return None, str(exc)
        if path.is_dir():
            return str(path), None
    where = f"{len(roots.models)} configured" if roots.models else "none configured: OMNIFLOW_MODEL_DIRS"
    return None, f"{model!r} is neither a built-in model nor a checkpoint in the model directories ({where})"


def resolve_spec_paths(document: dict[str, Any], user_id: Any, roots: PathRoots) -> dict[str, Any]:
    """`document` (a GraphSpec dict) with every name above replaced by the server path it stands
    for; the document itself is not modified. PathRefused lists every name that cannot be used."""
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
            if param in params:
                params[param] = under(params[param], f"role {role['name']!r}: params.{param}", role=role["name"],
                                      param=f"params.{param}")
        model, problem = _model_path(roots, role)
        if problem is not None:
            issues.append(_issue(f"role {role['name']!r}: model: {problem}", role=role["name"], param="model"))
        roles.append({**role, "params": params, **({"model": model} if model is not None else {})})
    nodes = []
    for node in document.get("nodes", []):
        params = dict(node.get("params", {}))
        if node.get("kind") == "python" and _op_name(node.get("op")) in OUTPUT_OPS:
            params.setdefault("out_dir", DEFAULT_OUT_DIR)
        for param in USER_PATH_NODE_PARAMS:
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
