"""A file a run wrote on another node, fetched from that node's agent (the distributed mode).

A run's role workers write under their own node's users root (`runs.folders`). `runs.outputs`
recognises such a path by the root the node announced (`liveness.node_paths`) and stores the file
as a run file like a local one: the studio sends `omniflow.read_user_file(node, owner, name, reply)`
to the node's queue (`node.<name>`) and waits on the Redis list `reply` for the answer, at most
`FETCH_TIMEOUT_S`. Waiting on a list, not on a Celery result: the run worker waits inside its own
task, and the studio keeps no result backend.

The agent answers with a path it builds itself: its own users root, the owner id, the name resolved
under it (`resolve_under`: no absolute name, no `..`, no link), read only if it is a regular file,
at most `limit` bytes (`NodeFile`). The answer is JSON (`{"data": base64}`, `{"not_file": true}`
for a folder or a name that is gone, `{"error": why}`), never pickle; the reply key must be one
this module makes, so a message cannot have the agent write elsewhere in Redis.
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis
from celery import current_app

from engine.spec.userfiles import resolve_under
from studio.config import StudioConfig
from studio.workflows.deployments.node import node_queue
from studio.workflows.runs.outputs import read_at_most

FETCH_TIMEOUT_S = 15.0
"""How long the studio waits for a node's answer before showing the file by name."""
REPLY_TTL_S = 60
"""How long an answer nobody took stays in Redis."""


class NodeFileError(Exception):
    """The file could not be fetched or read; the message says why (without the node's paths)."""


@dataclass(frozen=True, slots=True)
class NodeFile:
    """What a node read: the bytes of a regular file, or None when the name is a folder or gone."""

    data: bytes | None


def reply_key(prefix: str) -> str:
    return f"{prefix}:nodefile:{uuid.uuid4().hex}"


def check_reply_key(prefix: str, key: str) -> None:
    if not re.fullmatch(re.escape(prefix) + r":nodefile:[0-9a-f]{32}", key):
        raise NodeFileError(f"not a reply key of this studio: {key!r}")


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
    data = read_at_most(path, limit)
    if data is None:
        raise NodeFileError(f"larger than {limit} bytes, OMNIFLOW_MAX_RUN_FILE_BYTES")
    return NodeFile(data)


def encode_answer(read: Callable[[], NodeFile]) -> bytes:
    """The JSON answer to a fetch: what `read` returns, or the error it raises."""
    try:
        found = read()
    except NodeFileError as exc:
        return json.dumps({"error": str(exc)}).encode()
    if found.data is None:
        return json.dumps({"not_file": True}).encode()
    return json.dumps({"data": base64.b64encode(found.data).decode("ascii")}).encode()


def answer(client: redis.Redis, key: str, payload: bytes) -> None:
    with client.pipeline() as pipe:
        pipe.rpush(key, payload)
        pipe.expire(key, REPLY_TTL_S)
        pipe.execute()


def await_answer(client: redis.Redis, key: str, node: str, timeout_s: float = FETCH_TIMEOUT_S) -> NodeFile:
    """The node's answer on `key` (`NodeFileError` when it refused, or said nothing within `timeout_s`)."""
    try:
        popped = client.blpop([key], timeout=timeout_s)  # takes the one answer: nothing is left behind
    except redis.RedisError as exc:
        raise NodeFileError(f"Redis failed while waiting for node {node!r}: {exc}") from None
    if popped is None:  # an answer arriving later expires with its key (REPLY_TTL_S)
        raise NodeFileError(f"node {node!r} did not answer within {timeout_s:g} s")
    body = json.loads(popped[1])
    if "error" in body:
        raise NodeFileError(str(body["error"]))
    if body.get("not_file"):
        return NodeFile(None)
    return NodeFile(base64.b64decode(body["data"]))


def fetch(config: StudioConfig, node: str, owner: str, name: str, timeout_s: float = FETCH_TIMEOUT_S) -> NodeFile:
    """Ask `node`'s agent for `name` in `owner`'s folder there and wait for its answer
    (`NodeFileError` naming why it is not to be had)."""
    assert config.redis_url is not None, "fetching from nodes needs the distributed mode's Redis"
    key = reply_key(config.redis_prefix)
    client = redis.Redis.from_url(config.redis_url, socket_timeout=timeout_s + 5, socket_connect_timeout=5)
    try:
        current_app.send_task("omniflow.read_user_file", args=[node, owner, name, key], queue=node_queue(node))
        return await_answer(client, key, node, timeout_s)
    finally:
        client.close()


def serve(config: StudioConfig, owner: str, name: str, key: str) -> None:
    """The node agent's side: read `name` in `owner`'s folder under this node's users root and
    answer on `key`."""
    check_reply_key(config.redis_prefix, key)
    assert config.redis_url is not None, "a node agent runs in the distributed mode"
    payload = encode_answer(lambda: read_user_file(config.users_root, owner, name, config.max_run_file_bytes))
    client = redis.Redis.from_url(config.redis_url, socket_timeout=10, socket_connect_timeout=5)
    try:
        answer(client, key, payload)
    finally:
        client.close()
