"""Service discovery: which role workers are alive, where they listen, how loaded they are.

Workers ``register`` a :class:`WorkerInfo` and then ``heartbeat`` their :class:`WorkerLoad`
more often than the registry's TTL; a worker whose heartbeats stop disappears after the TTL.
A worker whose record is lost (expired, or Redis restarted) registers again; one whose id was
``fence``d -- declared lost by someone else, its replica placed elsewhere -- cannot.
Dispatchers read ``workers(role)`` and may ``watch`` for changes.

Two implementations of the :class:`Registry` protocol:

* :class:`InProcessRegistry` -- a dict in the current event loop, for the embedded mode and
  tests. Expiry is lazy (on every call) plus a periodic sweep while someone watches.
* :class:`RedisRegistry` -- shared across processes and hosts through Redis. Layout under
  ``<namespace>:``

  - ``worker:<worker_id>``: JSON of the :class:`WorkerSnapshot`, ``SET ... PX ttl``; the
    key's TTL *is* the liveness lease, refreshed by each heartbeat.
  - ``role:<role>``: set of worker ids registered for a role (an index; entries whose
    worker key has expired are removed on read).
  - ``roles``: set of role names ever registered in the namespace.
  - ``fenced:<worker_id>``: a tombstone (``SET ... PX fence_ttl``): ``fence`` retired the id,
    ``register`` refuses it (:class:`FencedWorkerError`).
  - ``events``: pub/sub channel carrying :class:`RegistryEvent` JSON.

  Expiry does not rely on keyspace notifications (often disabled): a watch also polls
  membership every ``poll_interval_s`` and reports workers that vanished.

All values on the wire are JSON; nothing is pickled.
"""

from __future__ import annotations

from engine.flow.discovery.memory import InProcessRegistry
from engine.flow.discovery.records import (
    FENCE_TTL_S,
    FencedWorkerError,
    Registry,
    RegistryClosedError,
    RegistryError,
    RegistryEvent,
    RegistryEventKind,
    RegistryUnavailableError,
    RegistryWatch,
    UnknownWorkerError,
    WorkerInfo,
    WorkerLoad,
    WorkerSnapshot,
)
from engine.flow.discovery.redis import RedisRegistry

__all__ = [
    "FENCE_TTL_S",
    "FencedWorkerError",
    "InProcessRegistry",
    "RedisRegistry",
    "Registry",
    "RegistryClosedError",
    "RegistryError",
    "RegistryEvent",
    "RegistryEventKind",
    "RegistryUnavailableError",
    "RegistryWatch",
    "UnknownWorkerError",
    "WorkerInfo",
    "WorkerLoad",
    "WorkerSnapshot",
    "make_registry",
]

# ---------------------------------------------------------------------------------------------
# Factory


def make_registry(
    url: str | None,
    *,
    namespace: str = "omniflow",
    ttl_s: float = 3.0,
    op_timeout_s: float = 2.0,
) -> Registry:
    """The registry for ``url``: ``None`` or ``memory://`` -> :class:`InProcessRegistry`,
    ``redis://``/``rediss://``/``unix://`` -> :class:`RedisRegistry`; anything else raises
    ``ValueError`` naming the URL. Does not connect."""
    if url is None or url == "memory://":
        return InProcessRegistry(ttl_s=ttl_s)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisRegistry(url, namespace=namespace, ttl_s=ttl_s, op_timeout_s=op_timeout_s)
    raise ValueError(f"unsupported registry URL {url!r}: expected None, 'memory://' or 'redis://...'")

