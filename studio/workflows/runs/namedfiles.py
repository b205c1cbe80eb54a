"""The files a batch of a run's events names, read before the batch is stored.

`store.record` stores a batch under the run's row lock, which lease renewals, cancels and the API's
reads of the run wait behind. Reading what the batch's values name in the owner's folders
(`outputs.ServerPaths`) may take long: a file a role worker wrote on another node is fetched from
that node's agent, and a node that died within its heartbeat's TTL answers nothing for
`nodefiles.FETCH_TIMEOUT_S`. So `gather` reads them all first, holding no lock and no transaction,
each place the batch names once, under the rules the studio always kept:
- a name on this machine is read only if it resolves in the owner's folder (`resolve_under`: no
  `..`, no link on the way) to a regular file of at most `OMNIFLOW_MAX_RUN_FILE_BYTES`; one that
  does not resolve there, a folder or a path that is gone is shown as its name, a file too large or
  unreadable as its name and why;
- a name on another node is read by that node's agent under its own rules (`nodefiles.fetch`); when
  it cannot be, its name says why (`on node X, ...`), and the event is stored all the same;
- a name a run file of the run is already stored under (by an earlier batch) is not read again.
The bytes come back sniffed and hashed (`ReadFile`), so that what is left for the row lock is
writing the run files (owned by the run's owner) and the events (`store._show_files`).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from studio.config import StudioConfig
from studio.workflows.deployments import liveness
from studio.workflows.models import FileRole, RunFile
from studio.workflows.paths import PathRoots, resolve_under
from studio.workflows.runs import nodefiles
from studio.workflows.runs.outputs import NamedFile, ServerPaths, read_at_most, sniff_content_type

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReadFile:
    """A named file's bytes as read where it lies, with what storing them as a run file needs."""

    data: bytes
    filename: str
    content_type: str
    """Sniffed from the bytes; "" when they say nothing (the run file's type is the filename's guess then)."""
    sha256: str

    @classmethod
    def of(cls, data: bytes, filename: str) -> ReadFile:
        content_type, _ = sniff_content_type(data)
        return cls(data, filename, "" if content_type == "application/octet-stream" else content_type,
                   hashlib.sha256(data).hexdigest())


@dataclass(frozen=True, slots=True)
class NotRead:
    """A named place that is not stored as a run file, and the text shown instead (its name, or its
    name and why not). Also what a place already stored as a run file is shown as, should that run
    file be gone by the time the batch is stored."""

    shown: str


Found = ReadFile | NotRead


@dataclass(frozen=True, slots=True)
class NamedFiles:
    """What a batch of one run's events names in its owner's folders, as gathered before the batch
    is stored: the paths that recognise them (`paths`) and what each place came to (`found`, every
    place `paths.named` finds in the batch's values)."""

    paths: ServerPaths
    found: dict[NamedFile, Found]


def server_paths(config: StudioConfig, owner: str) -> ServerPaths:
    """The server paths of `owner`'s folders: here, and on every node that announced its users root
    (`liveness.node_paths`); and the model roots, cut out of errors."""
    nodes = liveness.node_paths()
    roots = PathRoots.of(config).with_hidden(nodes.models)
    return ServerPaths(roots.users / owner, {node: root / owner for node, root in nodes.users.items()},
                       models=roots.hidden_in_errors)


def gather(config: StudioConfig, run_id: str, owner: str, values: list[Any]) -> NamedFiles:
    """Read every place `values` (JSON data of one batch of run `run_id`'s events) name in the
    folders of `owner` (the run's owner's id), as the module says. Takes no lock; the run's files
    are only read here (a query), never written."""
    paths = server_paths(config, owner)
    named = paths.named(values)
    if not named:
        return NamedFiles(paths, {})
    stored = set(RunFile.objects.filter(run_id=run_id, role=FileRole.OUTPUT,
                                        name__in={file.run_file_name for file in named})
                 .values_list("name", flat=True))
    found: dict[NamedFile, Found] = {}
    for file in named:
        if file.run_file_name in stored:  # by an earlier batch: shown by that run file, not read again
            found[file] = NotRead(file.name)
        elif file.node is None:
            found[file] = read_here(paths.root, file.name, config.max_run_file_bytes)
        elif config.redis_url is None:  # not the distributed mode: no agent to ask that node's disk
            found[file] = NotRead(file.name)
        else:
            found[file] = fetch_from(config, file.node, owner, file.name)
    return NamedFiles(paths, found)


def read_here(user_root: Path, name: str, limit: int) -> Found:
    """`name` in the user's folder on this machine, read if it resolves there to a regular file of
    at most `limit` bytes."""
    try:
        path = resolve_under(user_root, name)
    except ValueError:  # not a name in the folder (`..`, a link on the way): shown as given, nothing read
        return NotRead(name)
    try:
        if not path.is_file():
            return NotRead(name)
        data = read_at_most(path, limit)
    except OSError as exc:  # its strerror only: the message would name the server's path
        return NotRead(f"{name} (not stored as a run file: could not read it: {exc.strerror})")
    if data is None:
        return NotRead(f"{name} (not stored as a run file: larger than {limit} bytes, OMNIFLOW_MAX_RUN_FILE_BYTES)")
    return ReadFile.of(data, path.name)


def fetch_from(config: StudioConfig, node: str, owner: str, name: str) -> Found:
    """`name` in `owner`'s folder on `node`, as that node's agent reads it (`nodefiles.fetch`)."""
    try:
        fetched = nodefiles.fetch(config, node, owner, name)
    except nodefiles.NodeFileError as exc:
        log.warning("a run file of user %s: %s on node %s was not fetched: %s", owner, name, node, exc)
        return NotRead(f"{name} (not stored as a run file: on node {node}, {exc})")
    return NotRead(name) if fetched.data is None else ReadFile.of(fetched.data, PurePosixPath(name).name)
