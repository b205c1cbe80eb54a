"""Run outputs reach their user as run files, never as server paths.

An op that writes files (`save_outputs`) returns where it wrote them; under the studio those
are server paths below the owner's folder (`studio.workflows.paths`). `ServerPaths` finds them in
a value about to be stored or sent (a node output, the run's outputs) and replaces each: a file
becomes a run file of the run (`{"$file", "url", "name"}`, downloaded by its owner only through the
API), a folder or a path that is gone its name relative to the user's folder; an error or progress
message has the folders cut out of the paths it mentions.

`ServerPaths` itself reads nothing: it only tells which strings name a place in the user's folder
(here or on another node, a `NamedFile`) and puts in what it is told each one is shown as. What
decides that, reading the files under the owner's rules, is `runs.namedfiles`, before the run's
row is locked.
An error message names a checkpoint under a model root as the role names it, relative to that root.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from studio.workflows.paths import server_path_name


@dataclass(frozen=True, slots=True)
class NamedFile:
    """A place a value names in the owner's folder: `name` relative to that folder, on `node`'s
    disk (None: this machine's). Only the name's text is known: whether it resolves in the folder,
    and what lies there, is for whoever reads it (`runs.namedfiles`)."""

    name: str
    node: str | None = None

    @property
    def run_file_name(self) -> str:
        """The name a run file of it is stored under (`RunFile.name` holds 64 characters: its end)."""
        return self.name[-64:]


ShowFile = Callable[[NamedFile], Any]
"""What a named place is shown as: its run file's reference, or text (its name, or why it is not a run file)."""


def read_at_most(path: Path, limit: int) -> bytes | None:
    """The file's bytes, or None when it holds more than `limit`: never more than `limit` + 1 are
    read (the file may still be growing)."""
    with path.open("rb") as file:
        data = file.read(limit + 1)
    return None if len(data) > limit else data


def sniff_content_type(data: bytes) -> tuple[str, str]:
    """(content type, file extension) of produced bytes, from their magic numbers."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png", ".png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg", ".jpg"
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "audio/wav", ".wav"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp", ".webp"
    if data.startswith(b"fLaC"):
        return "audio/flac", ".flac"
    if data.startswith((b"ID3", b"\xff\xfb")):
        return "audio/mpeg", ".mp3"
    if data.startswith(b"OggS"):
        return "audio/ogg", ".ogg"
    return "application/octet-stream", ".bin"


class ServerPaths:
    """The server paths below one user's folder in the values of one run: the folder on this
    machine (`user_root`), and the user's folders on the other nodes (`elsewhere`: node name ->
    folder), where the run's role workers wrote under their own data dir. Reads no file."""

    def __init__(self, user_root: Path, elsewhere: Mapping[str, Path] | None = None,
                 models: Sequence[Path] = ()) -> None:
        """`models`: the model roots (`OMNIFLOW_MODEL_DIRS`, the model cache, those of the other nodes),
        cut out of error messages."""
        self.root = user_root
        self.prefix = str(user_root) + os.sep
        self.elsewhere = {node: root for node, root in (elsewhere or {}).items() if root != user_root}
        self.models = list(models)

    def named(self, values: Iterable[Any]) -> list[NamedFile]:
        """Every place `values` (JSON data) name in the user's folders, each once, in order."""
        found: dict[NamedFile, None] = {}

        def note(file: NamedFile) -> str:
            found[file] = None
            return file.name

        for value in values:
            self._walk(value, note)
        return list(found)

    def hide(self, value: Any, show: ShowFile) -> Any:
        """`value` with every server path below the user's folders replaced by what `show` says of
        the place it names, and every other string cut as `hide_in_text` does (not modified in place)."""
        return self._walk(value, show)

    def hide_in_text(self, text: str) -> str:
        """A message with the user's folders and the model roots cut out of the paths it mentions."""
        if not text:
            return text
        roots = [*self.elsewhere.values(), *self.models]
        prefixes = [self.prefix, *(str(root) + os.sep for root in roots)]
        for prefix in sorted(prefixes, key=len, reverse=True):  # a root inside another goes first
            text = text.replace(prefix, "")
        return text

    def _walk(self, value: Any, show: ShowFile) -> Any:
        if isinstance(value, str):
            file = self._named(value)
            return self.hide_in_text(value) if file is None else show(file)
        if isinstance(value, dict):
            return {k: self._walk(v, show) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._walk(v, show) for v in value]
        return value

    def _named(self, value: str) -> NamedFile | None:
        """The place `value` names in one of the user's folders (None: it names none). A string
        beginning with the folder may still climb out of it (`..`) or pass through a link: the
        name is what it says, whoever reads it resolves it (`resolve_under`)."""
        name = server_path_name(value, self.root)
        if name is not None:
            return NamedFile(name)
        for node, root in self.elsewhere.items():
            name = server_path_name(value, root)
            if name is not None:
                return NamedFile(name, node)
        return None
