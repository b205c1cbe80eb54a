"""A file a run wrote on another node, fetched from that node's agent (the distributed mode).

A run's role workers write under their own node's users root (`runs.folders`). `runs.outputs`
recognises such a path by the root the node announced (`liveness.node_paths`), and `runs.namedfiles`
fetches the file to store it as a run file like a local one, before the run's row is locked: the studio asks the node's agent a `UserFileQuery` and waits for
its answer at most `FETCH_TIMEOUT_S` (`deployments.queries`: a Redis list the agent serves on
threads of its own, so the answer never waits behind a deployment the agent is starting).

The agent answers with a path it builds itself: its own users root, the owner id, the name resolved
under it (`resolve_under`: no absolute name, no `..`, no link), read only if it is a regular file,
at most `OMNIFLOW_MAX_RUN_FILE_BYTES` (`NodeFile`, JSON on the wire); or refuses, saying why
without its paths (`NodeFileError`).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import redis

from engine.spec.userfiles import resolve_under
from studio.config import StudioConfig
from studio.workflows.deployments.queries import NodeQuery, NodeQueryError, ask, reply_key
from studio.workflows.runs.outputs import read_at_most

FETCH_TIMEOUT_S = 15.0
"""How long the studio waits for a node's answer before showing the file by name."""


class NodeFileError(NodeQueryError):
    """The file could not be fetched or read; the message says why (without the node's paths)."""


class UserFileQuery(NodeQuery, frozen=True, tag="read_user_file"):
    """The file `name` in user `owner`'s folder on the node."""

    owner: str
    name: str


class NodeFile(msgspec.Struct, frozen=True):
    """What a node read: the bytes of a regular file, or None when the name is a folder or gone."""

    data: bytes | None


def read_user_file(users_root: Path, owner: str, name: str, limit: int) -> NodeFile:
    """The file `name` in `owner`'s folder under this node's `users_root`, read as the node's own
    rules allow (`NodeFileError` naming why not); at most `limit` bytes."""
    if not owner.isdigit():
        raise NodeFileError(f"not a user id: {owner!r}")
    try:
        path = resolve_under(users_root / owner, name)
    except ValueError as exc:
        raise NodeFileError(str(exc)) from None
    if path.is_symlink() or not path.is_file():
        return NodeFile(None)
    try:
        data = read_at_most(path, limit)
    except OSError as exc:  # its strerror only: the message would name the node's path
        raise NodeFileError(f"could not read it: {exc.strerror}") from None
    if data is None:
        raise NodeFileError(f"larger than {limit} bytes, OMNIFLOW_MAX_RUN_FILE_BYTES")
    return NodeFile(data)


def serve(config: StudioConfig, query: UserFileQuery) -> NodeFile:
    """The node agent's answer to `query`, under this node's users root and limits (its handler in
    `deployments.queries.QueryServer`)."""
    return read_user_file(config.users_root, query.owner, query.name, config.max_run_file_bytes)


def fetch(config: StudioConfig, node: str, owner: str, name: str, timeout_s: float = FETCH_TIMEOUT_S) -> NodeFile:
    """Ask `node`'s agent for `name` in `owner`'s folder there and wait for its answer
    (`NodeFileError` naming why it is not to be had, within `timeout_s` when the node is gone)."""
    assert config.redis_url is not None, "fetching from nodes needs the distributed mode's Redis"
    query = UserFileQuery(node=node, reply=reply_key(config.redis_prefix), owner=owner, name=name)
    client = redis.Redis.from_url(config.redis_url, socket_timeout=timeout_s + 5, socket_connect_timeout=5)
    try:
        return ask(client, config.redis_prefix, query, NodeFile, timeout_s)
    except NodeQueryError as exc:
        raise NodeFileError(str(exc)) from None
    finally:
        client.close()
