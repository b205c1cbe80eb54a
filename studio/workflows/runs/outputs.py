"""Run outputs reach their user as run files, never as server paths.

An op that writes files (`save_outputs`) returns where it wrote them; under the studio those
are server paths below the owner's folder (`studio.workflows.paths`). `ServerPaths.hide` walks
a value about to be stored or sent (a node output, the run's outputs, an error message) and
replaces every such path: a file becomes a run file of the run (`{"$file", "url", "name"}`,
downloaded by its owner only through the API), a folder or a path that is gone its name
relative to the user's folder. Only a name that resolves in that folder is read (`resolve_under`:
no `..`, no link on the way): a value beginning with the folder's path may still point elsewhere.
A path below the user's folder on another node (where a role worker of the run wrote) is read by
that node itself (`runs.nodefiles`, through `SaveElsewhere`), under the same rules.
An error message names a checkpoint under a model root as the role names it, relative to that root.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from studio.workflows.paths import resolve_under, server_path_name

SaveFile = Callable[[str, Path], dict[str, Any] | str]
"""Stores the file at the path as a run file named by the str (once); returns its reference, or
what to show instead where it is not stored (a file over the size limit)."""

SaveElsewhere = Callable[[str, str], Any]
"""Stores the file named by the second str in the user's folder on the node named by the first, as
that node reads it; returns its reference, or what to show instead (a folder's name, or why not)."""


def read_at_most(path: Path, limit: int) -> bytes | None:
    """The file's bytes, or None when it holds more than `limit`: never more than `limit` + 1 are
    read (the file may still be growing)."""
    with path.open("rb") as file:
        data = file.read(limit + 1)
    return None if len(data) > limit else data


class ServerPaths:
    """Hides the server paths below one user's folder in the values of one run: the folder on this
    machine (`user_root`), and the user's folders on the other nodes (`elsewhere`: node name ->
    folder), where the run's role workers wrote under their own data dir. A file there lies on
    another machine's disk: `save_elsewhere` has that node read it; without one, its name is shown."""

    def __init__(self, user_root: Path, save: SaveFile, elsewhere: Mapping[str, Path] | None = None,
                 save_elsewhere: SaveElsewhere | None = None, models: Sequence[Path] = ()) -> None:
        """`models`: the model roots (`OMNIFLOW_MODEL_DIRS`, the model cache, those of the other nodes),
        cut out of error messages."""
        self.root = user_root
        self.prefix = str(user_root) + os.sep
        self.elsewhere = {node: root for node, root in (elsewhere or {}).items() if root != user_root}
        self.models = list(models)
        self._save = save
        self._save_elsewhere = save_elsewhere

    def hide(self, value: Any) -> Any:
        """`value` with every server path below the user's folder replaced (not modified in place)."""
        if isinstance(value, str):
            return self._string(value)
        if isinstance(value, dict):
            return {k: self.hide(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.hide(v) for v in value]
        return value

    def hide_in_text(self, text: str) -> str:
        """A message with the user's folders and the model roots cut out of the paths it mentions."""
        if not text:
            return text
        roots = [*self.elsewhere.values(), *self.models]
        prefixes = [self.prefix, *(str(root) + os.sep for root in roots)]
        for prefix in sorted(prefixes, key=len, reverse=True):  # a root inside another goes first
            text = text.replace(prefix, "")
        return text

    def _string(self, value: str) -> Any:
        name = server_path_name(value, self.root)
        if name is None:
            for node, root in self.elsewhere.items():
                name = server_path_name(value, root)
                if name is not None:
                    return name if self._save_elsewhere is None else self._save_elsewhere(node, name)
            return self.hide_in_text(value)
        # Read only what the name reaches the way a name resolves in the owner's folder: a string
        # beginning with the folder may still climb out of it (`..`) or pass through a link.
        try:
            path = resolve_under(self.root, name)
        except ValueError:
            return name
        if path.is_file():
            return self._save(name, path)
        return name
