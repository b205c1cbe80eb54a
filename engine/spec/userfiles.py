"""User files: folder names a run's nodes write under, resolved where they are written.

A server that runs other people's graphs gives each run an owner (`NodeCall.owner`: whoever
submitted it, never the graph) and names every folder a node writes into (its `out_dir`, the
params its op declares as output folders: `@op(output_dirs=...)`) relative to that owner's own
folder, `<users root>/<owner>/`. The names travel as names; the process that writes (a role
worker on its node, or the in-process unit of a run worker) resolves them under its own users
root (`UsersRoot`, from its launcher: the node's `OMNIFLOW_DATA_DIR`), so a node configured with
another data dir than the run worker's writes under its own, where its node agent finds them again.

Rules (`resolve_under`): absolute names, `~`, `..`, NUL and backslashes are refused, and so is
any existing component below the root that is a symbolic link; the owner's folder is made 0700.
A call without an owner (the command line: a person running their own graph) keeps its names as
they are, relative to the worker's working directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NewType

OwnerId = NewType("OwnerId", str)
"""Whose files a run writes: one path component (a server's user id)."""

OUT_DIR_PARAM = "out_dir"
"""A node param naming a folder under the owner's root, whatever the node's op."""
DEFAULT_OUT_DIR = "outputs"
"""What a declared output folder a node leaves out is, under the owner's root (the op's own
default is relative to the worker's working directory)."""

_OWNER = re.compile(r"[A-Za-z0-9_-]{1,64}")


class UserPathRefused(ValueError):
    """A name that cannot be used under an owner's folder (the message says which and why)."""


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


def owner_id(value: Any) -> OwnerId:
    """`value` (a user id) as an owner id; UserPathRefused when it is not one path component."""
    text = str(value)
    if not _OWNER.fullmatch(text):
        raise UserPathRefused(f"{text[:80]!r} is not an owner id (letters, digits, '_' or '-')")
    return OwnerId(text)


@dataclass(frozen=True, slots=True)
class UsersRoot:
    """Where this process keeps its owners' folders: `<path>/<owner>/` (a server's
    `<OMNIFLOW_DATA_DIR>/users`). Given to a worker by whoever launches it."""

    path: Path

    def folder(self, owner: OwnerId) -> Path:
        """The owner's own folder, made (0700) if need be; UserPathRefused when it is not a plain
        directory (a link put there)."""
        root = self.path / owner_id(owner)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        root.mkdir(mode=0o700, exist_ok=True)
        if root.is_symlink() or not root.is_dir():
            raise UserPathRefused(f"the folder of owner {owner} is not a plain directory")
        os.chmod(root, 0o700)
        return root

    def resolve(self, owner: OwnerId, name: Any) -> Path:
        """The server path `name` stands for in the owner's folder (`resolve_under`); UserPathRefused
        naming why not. The named folder itself is not made (its writer makes it)."""
        folder = self.folder(owner)
        try:
            return resolve_under(folder, name)
        except ValueError as exc:
            raise UserPathRefused(str(exc)) from None


def output_params(params: Mapping[str, Any], output_dirs: Iterable[str], users: UsersRoot | None,
                  owner: OwnerId | None, *, node_id: str) -> dict[str, Any]:
    """`params` of a node about to write, with its output folder names (`out_dir` and the op's
    declared `output_dirs`; a declared one left out is `DEFAULT_OUT_DIR`) replaced by the paths
    they stand for in `owner`'s folder under `users`. Without an owner the params are as given.
    UserPathRefused (naming the node and param) for a name that cannot be used, or an owner but no
    users root here. `params` is not modified."""
    if owner is None:
        return dict(params)
    declared = tuple(output_dirs)
    resolved = {**{name: DEFAULT_OUT_DIR for name in declared}, **params}
    for param in dict.fromkeys((OUT_DIR_PARAM, *declared)):
        if param not in resolved:
            continue
        if users is None:
            raise UserPathRefused(f"node {node_id!r}: params.{param}: this worker has no users root (its launcher"
                                  " gives one: --users-root), so it cannot write a run's files")
        try:
            resolved[param] = str(users.resolve(owner, resolved[param]))
        except UserPathRefused as exc:
            raise UserPathRefused(f"node {node_id!r}: params.{param}: {exc}") from None
    return resolved
