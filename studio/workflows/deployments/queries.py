"""Short read-only queries to a node agent, answered beside its Celery tasks (the distributed mode).

A node agent's Celery worker runs one task at a time (`-P solo`, `deployments.node`), and starting
or reconciling a deployment's workers can take longer than anyone waits for an answer. A question
that only reads what the node holds (a file a run wrote there, `runs.nodefiles`) therefore does
not go through that queue. The asker pushes a `NodeQuery` (JSON) onto the node's Redis list
`<prefix>:node-queries:<node>` and waits on its own reply list, `<prefix>:node-reply:<32 hex>`,
at most `timeout_s` (`ask`). In the agent's process a `QueryServer` (threads started with the
agent, `tasks._supervise_this_node`) pops the queries and answers each on its reply list with what
the handler for its type returns: `Answered` (the handler's struct) or `Refused` (why), whatever
task the agent runs meanwhile. Answers are JSON, never pickle.

A dead node is an error naming it within the timeout, never a hang: a query nobody took by then is
taken back off the list (so an agent that comes back never answers questions nobody waits for;
should the asker die first, the list expires, `QUEUE_TTL_S`), and an answer nobody took expires
with its key (`REPLY_TTL_S`).

Whoever reaches the studio's Redis may ask, as they may send the agent Celery tasks (the broker is
that Redis). So the server trusts nothing in a query: one larger than `MAX_QUERY_BYTES`, of no
type it serves, for another node, or with a reply key this module did not make is dropped (and
logged), so a query cannot have the agent write elsewhere in Redis; what a query may read is its
handler's to bound (`runs.nodefiles` builds every path itself).
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import reduce
from operator import or_
from typing import Any, TypeVar

import msgspec
import redis

log = logging.getLogger(__name__)

REPLY_TTL_S = 60
"""How long an answer nobody took stays in Redis."""
QUEUE_TTL_S = 60
"""How long a node's query list outlives its last push (queries whose askers died before taking
them back, on a node whose agent is away)."""
MAX_QUERY_BYTES = 16 << 10
"""A query is a few names; anything larger is not one of ours."""
READERS = 2
"""Threads serving a node's queries: one slow read does not hold up the next query."""
POLL_S = 1.0
"""How long a reader blocks on the list before it looks whether the agent is stopping."""
_RETRY_S = 1.0
"""The pause before a reader tries Redis again after it failed."""

A = TypeVar("A", bound=msgspec.Struct)


class NodeQueryError(Exception):
    """The query got no answer, or the node refused it; the message says why (naming the node,
    never its paths). A handler raises it (or a subclass) to refuse a query."""


class NodeQuery(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=True):
    """A query to the agent of `node`, answered on the Redis list `reply` (`reply_key`). Each kind
    is a subclass with a `tag` of its own and the fields its handler reads."""

    node: str
    reply: str


class Answered(msgspec.Struct, frozen=True, tag_field="kind", tag="answered", forbid_unknown_fields=True):
    """The handler's answer, its own struct as JSON."""

    value: msgspec.Raw


class Refused(msgspec.Struct, frozen=True, tag_field="kind", tag="refused", forbid_unknown_fields=True):
    """Why the node did not answer the query (a handler's `NodeQueryError`, or its failure)."""

    why: str


_replies = msgspec.json.Decoder(Answered | Refused)


def queue_key(prefix: str, node: str) -> str:
    """The Redis list the agent of `node` serves queries from."""
    return f"{prefix}:node-queries:{node}"


def reply_key(prefix: str) -> str:
    """A fresh reply list for one query."""
    return f"{prefix}:node-reply:{uuid.uuid4().hex}"


def check_reply_key(prefix: str, key: str) -> None:
    """`NodeQueryError` unless `key` is one `reply_key(prefix)` makes."""
    if not re.fullmatch(re.escape(prefix) + r":node-reply:[0-9a-f]{32}", key):
        raise NodeQueryError(f"not a reply key of this studio: {key!r}")


def ask(client: redis.Redis, prefix: str, query: NodeQuery, answer: type[A], timeout_s: float) -> A:
    """Put `query` to its node's agent and wait for the answer, an `answer`, at most `timeout_s`
    (`NodeQueryError` when the node refused it, said nothing in time, or Redis failed)."""
    check_reply_key(prefix, query.reply)
    raw = msgspec.json.encode(query)
    queue = queue_key(prefix, query.node)
    untaken = 0
    try:
        with client.pipeline() as pipe:
            pipe.rpush(queue, raw)
            pipe.expire(queue, QUEUE_TTL_S)
            pipe.execute()
        popped = client.blpop([query.reply], timeout=timeout_s)  # takes the one answer: nothing is left behind
        if popped is None:
            # Taken back unless the agent took it just now (its late answer expires with the key).
            untaken = client.lrem(queue, 1, raw)
    except redis.RedisError as exc:
        raise NodeQueryError(f"Redis failed while asking node {query.node!r}: {exc}") from None
    if popped is None:
        why = ": nothing took the query there (is its agent running?)" if untaken else ""
        raise NodeQueryError(f"node {query.node!r} did not answer within {timeout_s:g} s{why}")
    try:
        reply = _replies.decode(popped[1])
        if isinstance(reply, Refused):
            raise NodeQueryError(reply.why)
        return msgspec.json.decode(reply.value, type=answer)
    except msgspec.DecodeError as exc:
        raise NodeQueryError(f"node {query.node!r} answered with something else: {exc}") from None


@dataclass(frozen=True, slots=True)
class Reply:
    """What to push, and where."""

    key: str
    payload: bytes


Handler = Callable[[Any], msgspec.Struct]
"""Answers one kind of query (its `NodeQuery` subclass) with a struct, or raises `NodeQueryError`."""


class QueryServer:
    """Serves the queries to this node (`node`) with `handlers` (query type -> its handler), in
    `readers` threads of this process between `start()` and `stop()`. Handlers run on those
    threads: they must only read, and touch no database connection of another thread."""

    def __init__(self, redis_url: str, prefix: str, node: str, handlers: Mapping[type[NodeQuery], Handler], *,
                 readers: int = READERS, poll_s: float = POLL_S) -> None:
        self.prefix, self.node = prefix, node
        self.queue = queue_key(prefix, node)
        self.handlers = dict(handlers)
        self._queries = msgspec.json.Decoder(reduce(or_, self.handlers))
        self.poll_s = poll_s
        self._client = redis.Redis.from_url(redis_url, socket_timeout=poll_s + 10, socket_connect_timeout=5)
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._serve, name=f"omniflow-node-queries-{i}", daemon=True)
                         for i in range(readers)]

    def reply(self, raw: bytes) -> Reply | None:
        """The reply to one query as popped from the list; None when it is dropped (logged)."""
        if len(raw) > MAX_QUERY_BYTES:
            log.warning("node %s: dropped a query of %d bytes (at most %d)", self.node, len(raw), MAX_QUERY_BYTES)
            return None
        try:
            query: NodeQuery = self._queries.decode(raw)
            check_reply_key(self.prefix, query.reply)
        except (msgspec.DecodeError, NodeQueryError) as exc:
            log.warning("node %s: dropped a query that is not one of ours: %s", self.node, exc)
            return None
        if query.node != self.node:  # pushed on the wrong list: not ours to answer
            log.warning("node %s: dropped a query for node %r", self.node, query.node)
            return None
        try:
            value = self.handlers[type(query)](query)
        except NodeQueryError as exc:
            return Reply(query.reply, msgspec.json.encode(Refused(str(exc))))
        except Exception as exc:  # a handler's bug must neither end the reader nor leave the asker waiting
            log.exception("node %s: answering %r failed", self.node, query)
            refused = Refused(f"node {self.node!r} failed to answer ({type(exc).__name__}); its agent's log says why")
            return Reply(query.reply, msgspec.json.encode(refused))
        return Reply(query.reply, msgspec.json.encode(Answered(msgspec.Raw(msgspec.json.encode(value)))))

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                popped = self._client.blpop([self.queue], timeout=self.poll_s)
            except redis.RedisError as exc:
                log.warning("node %s: reading its queries failed (%s); trying again in %.1f s", self.node, exc,
                            _RETRY_S)
                self._stopped.wait(_RETRY_S)
                continue
            if popped is None:
                continue
            reply = self.reply(popped[1])
            if reply is None:
                continue
            try:
                with self._client.pipeline() as pipe:
                    pipe.rpush(reply.key, reply.payload)
                    pipe.expire(reply.key, REPLY_TTL_S)
                    pipe.execute()
            except redis.RedisError as exc:  # the asker times out, naming the node
                log.warning("node %s: answering a query failed: %s", self.node, exc)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()
        log.info("node %s: serving its queries (%s) on %d threads", self.node,
                 ", ".join(sorted(t.__struct_config__.tag for t in self.handlers)), len(self._threads))

    def stop(self) -> None:
        """Stop taking queries; a query being answered is answered first (readers end within `poll_s`)."""
        self._stopped.set()
        for thread in self._threads:
            thread.join(timeout=self.poll_s + 10)
        self._client.close()
