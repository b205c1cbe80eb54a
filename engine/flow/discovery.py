"""Service discovery: which role workers are alive, where they listen, how loaded they are.

Workers ``register`` a :class:`WorkerInfo` and then ``heartbeat`` their :class:`WorkerLoad`
more often than the registry's TTL; a worker whose heartbeats stop disappears after the TTL.
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
  - ``events``: pub/sub channel carrying :class:`RegistryEvent` JSON.

  Expiry does not rely on keyspace notifications (often disabled): a watch also polls
  membership every ``poll_interval_s`` and reports workers that vanished.

All values on the wire are JSON; nothing is pickled.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import inspect
import json
import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as redis_exc
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

log = logging.getLogger(__name__)

_T = TypeVar("_T")

Clock = Callable[[], float]


# ---------------------------------------------------------------------------------------------
# Errors


class RegistryError(Exception):
    """Base class of every error raised by a registry."""


class UnknownWorkerError(RegistryError):
    """The worker has no live record (never registered, deregistered, or its TTL expired).

    A worker that gets this from ``heartbeat`` must ``register`` again.
    """

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"worker {worker_id!r} is not registered (or its registration expired)")
        self.worker_id = worker_id


class RegistryUnavailableError(RegistryError):
    """The registry backend could not be reached or did not answer within its timeout."""


class RegistryClosedError(RegistryError):
    """The registry was closed; no further calls are accepted."""


# ---------------------------------------------------------------------------------------------
# Records


def _require(data: Mapping[str, Any], key: str, kind: Any, what: str) -> Any:
    """``data[key]`` if present and an instance of ``kind``; else ``ValueError`` naming the field."""
    if key not in data:
        raise ValueError(f"{what}: missing field {key!r}")
    value = data[key]
    # bool is an int subclass, but a JSON true is never a valid count or timestamp.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{what}: field {key!r} has the wrong type: {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker is and where to reach it; fixed for the life of a registration.

    ``capacity`` is the number of node executions it runs concurrently (>= 1). ``host`` and
    ``pid`` default to the calling process, which is the usual case: a worker describing itself.
    ``meta`` must be JSON-able; it is not part of the hash.
    """

    worker_id: str
    role: str
    address: str
    capacity: int = 1
    model: str | None = None
    device: str = "cpu"
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("WorkerInfo.worker_id must be non-empty")
        if not self.role:
            raise ValueError("WorkerInfo.role must be non-empty")
        if self.capacity < 1:
            raise ValueError(f"WorkerInfo.capacity must be >= 1, got {self.capacity}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; ``from_dict`` inverts it."""
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "address": self.address,
            "capacity": self.capacity,
            "model": self.model,
            "device": self.device,
            "host": self.host,
            "pid": self.pid,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerInfo:
        """Build from ``to_dict`` output; raises ``ValueError`` on a missing or mistyped field."""
        what = "WorkerInfo"
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"{what}: field 'model' must be a string or null, got {model!r}")
        return cls(
            worker_id=_require(data, "worker_id", str, what),
            role=_require(data, "role", str, what),
            address=_require(data, "address", str, what),
            capacity=_require(data, "capacity", int, what),
            model=model,
            device=_require(data, "device", str, what),
            host=_require(data, "host", str, what),
            pid=_require(data, "pid", int, what),
            meta=dict(_require(data, "meta", dict, what)),
        )


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's self-reported load at its last heartbeat.

    ``outstanding``: node executions accepted and not finished; ``queue_depth``: of those, how
    many wait for a slot; ``metrics``: free-form numeric gauges (e.g. KV hit rates).
    """

    outstanding: int = 0
    queue_depth: int = 0
    busy: bool = False
    metrics: dict[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.outstanding < 0 or self.queue_depth < 0:
            raise ValueError(f"WorkerLoad counts must be >= 0, got {self.outstanding}, {self.queue_depth}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; ``from_dict`` inverts it."""
        return {
            "outstanding": self.outstanding,
            "queue_depth": self.queue_depth,
            "busy": self.busy,
            "metrics": dict(self.metrics),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerLoad:
        """Build from ``to_dict`` output; raises ``ValueError`` on a missing or mistyped field."""
        what = "WorkerLoad"
        metrics = _require(data, "metrics", dict, what)
        for key, value in metrics.items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{what}: metric {key!r} must map a string to a number, got {value!r}")
        return cls(
            outstanding=_require(data, "outstanding", int, what),
            queue_depth=_require(data, "queue_depth", int, what),
            busy=_require(data, "busy", bool, what),
            metrics={k: float(v) for k, v in metrics.items()},
        )


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """A live worker as the registry last saw it; ``last_heartbeat`` is wall-clock seconds."""

    info: WorkerInfo
    load: WorkerLoad
    last_heartbeat: float

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> str:
        return self.info.role

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; ``from_dict`` inverts it."""
        return {
            "info": self.info.to_dict(),
            "load": self.load.to_dict(),
            "last_heartbeat": self.last_heartbeat,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerSnapshot:
        """Build from ``to_dict`` output; raises ``ValueError`` on a missing or mistyped field."""
        what = "WorkerSnapshot"
        return cls(
            info=WorkerInfo.from_dict(_require(data, "info", dict, what)),
            load=WorkerLoad.from_dict(_require(data, "load", dict, what)),
            last_heartbeat=float(_require(data, "last_heartbeat", int | float, what)),
        )


class RegistryEventKind(enum.Enum):
    """What happened to a worker, as seen by one watch."""

    ADDED = "added"
    UPDATED = "updated"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class RegistryEvent:
    """One change of the worker set.

    ``snapshot`` is the new state for ADDED and UPDATED, and ``None`` for REMOVED (a worker that
    expired has no final state to report).
    """

    kind: RegistryEventKind
    worker_id: str
    role: str
    snapshot: WorkerSnapshot | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; ``from_dict`` inverts it."""
        return {
            "kind": self.kind.value,
            "worker_id": self.worker_id,
            "role": self.role,
            "snapshot": None if self.snapshot is None else self.snapshot.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RegistryEvent:
        """Build from ``to_dict`` output; raises ``ValueError`` on a missing or mistyped field."""
        what = "RegistryEvent"
        raw_snapshot = data.get("snapshot")
        return cls(
            kind=RegistryEventKind(_require(data, "kind", str, what)),
            worker_id=_require(data, "worker_id", str, what),
            role=_require(data, "role", str, what),
            snapshot=None if raw_snapshot is None else WorkerSnapshot.from_dict(raw_snapshot),
        )


# ---------------------------------------------------------------------------------------------
# Protocol


class RegistryWatch(abc.ABC, AsyncIterator[RegistryEvent]):
    """An async iterator of :class:`RegistryEvent`, closeable with ``aclose()``.

    It delivers every change committed after the watch has *started*. ``InProcessRegistry``
    starts a watch when ``watch()`` returns; ``RedisRegistry`` starts it on ``await start()``,
    on ``async with``, or on the first ``__anext__`` -- use one of the first two when no change
    may be missed. Iteration ends (``StopAsyncIteration``) after ``aclose()`` or when the
    registry is closed. Events are queued without bound until read.
    """

    async def start(self) -> None:
        """Begin receiving events; idempotent."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop the watch and release its resources; idempotent."""

    def __aiter__(self) -> RegistryWatch:
        return self

    async def __aenter__(self) -> RegistryWatch:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class Registry(Protocol):
    """Where role workers announce themselves and dispatchers find them.

    Contract shared by every implementation:

    * ``register`` creates or replaces the worker's record and starts its TTL lease;
      re-registering an id with a different role moves it to that role.
    * ``heartbeat`` renews the lease and stores the load; it raises
      :class:`UnknownWorkerError` when there is no live record, and the caller must
      ``register`` again.
    * ``workers`` lists live workers only, sorted by ``worker_id``.
    * ``watch`` yields changes after the watch starts (see :class:`RegistryWatch`); a heartbeat
      whose load is unchanged produces no event.
    * Backend failures raise :class:`RegistryUnavailableError`; no call blocks without a timeout.
    """

    async def register(self, info: WorkerInfo, load: WorkerLoad | None = None) -> WorkerSnapshot:
        """Create or replace ``info.worker_id``'s record; returns the stored snapshot."""
        ...

    async def heartbeat(self, worker_id: str, load: WorkerLoad) -> WorkerSnapshot:
        """Renew the lease and store ``load``; raises :class:`UnknownWorkerError` if not live."""
        ...

    async def deregister(self, worker_id: str) -> bool:
        """Remove the record; returns whether a live record existed."""
        ...

    async def workers(self, role: str | None = None) -> list[WorkerSnapshot]:
        """Live workers (of ``role``, or all), sorted by ``worker_id``."""
        ...

    def watch(self, role: str | None = None) -> RegistryWatch:
        """Changes of workers (of ``role``, or all) from now on."""
        ...

    async def close(self) -> None:
        """Close every open watch and release resources; idempotent."""
        ...


# ---------------------------------------------------------------------------------------------
# In-process implementation


class _InProcessWatch(RegistryWatch):
    def __init__(self, registry: InProcessRegistry, role: str | None, sweep_interval_s: float) -> None:
        self._registry = registry
        self._role = role
        self._sweep_interval_s = sweep_interval_s
        self._queue: asyncio.Queue[RegistryEvent | None] = asyncio.Queue()
        self._closed = False

    def _offer(self, event: RegistryEvent) -> None:
        if not self._closed and (self._role is None or event.role == self._role):
            self._queue.put_nowait(event)

    def _end(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put_nowait(None)

    async def __anext__(self) -> RegistryEvent:
        while True:
            if self._closed:
                raise StopAsyncIteration
            try:
                async with asyncio.timeout(self._sweep_interval_s):
                    event = await self._queue.get()
            except TimeoutError:
                # Nobody may be reading the registry: sweep so that expiry still reaches us.
                self._registry._expire()
                continue
            if event is None:
                raise StopAsyncIteration
            return event

    async def aclose(self) -> None:
        self._registry._watches.discard(self)
        self._end()


class InProcessRegistry:
    """A :class:`Registry` held in memory, for the embedded mode and tests.

    ``clock`` returns wall-clock seconds (default ``time.time``); inject a fake one to test
    expiry without sleeping. A worker is live while ``clock() - last_heartbeat < ttl_s``.
    Expired workers are dropped, with a REMOVED event, at the start of every call and, while a
    watch waits, every ``sweep_interval_s`` real seconds (default ``ttl_s / 2``).
    Not thread-safe: use from one event loop.
    """

    def __init__(
        self, ttl_s: float = 3.0, *, clock: Clock = time.time, sweep_interval_s: float | None = None
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._sweep_interval_s = sweep_interval_s if sweep_interval_s is not None else ttl_s / 2
        self._records: dict[str, WorkerSnapshot] = {}
        self._watches: set[_InProcessWatch] = set()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RegistryClosedError("registry is closed")

    def _publish(self, event: RegistryEvent) -> None:
        for watch in list(self._watches):
            watch._offer(event)

    def _expire(self) -> None:
        now = self._clock()
        dead = [s for s in self._records.values() if now - s.last_heartbeat >= self.ttl_s]
        for snapshot in dead:
            del self._records[snapshot.worker_id]
            self._publish(RegistryEvent(RegistryEventKind.REMOVED, snapshot.worker_id, snapshot.role))

    async def register(self, info: WorkerInfo, load: WorkerLoad | None = None) -> WorkerSnapshot:
        self._check_open()
        self._expire()
        snapshot = WorkerSnapshot(info, load if load is not None else WorkerLoad(), self._clock())
        old = self._records.get(info.worker_id)
        self._records[info.worker_id] = snapshot
        for event in _register_events(old, snapshot):
            self._publish(event)
        return snapshot

    async def heartbeat(self, worker_id: str, load: WorkerLoad) -> WorkerSnapshot:
        self._check_open()
        self._expire()
        old = self._records.get(worker_id)
        if old is None:
            raise UnknownWorkerError(worker_id)
        snapshot = WorkerSnapshot(old.info, load, self._clock())
        self._records[worker_id] = snapshot
        if load != old.load:
            self._publish(RegistryEvent(RegistryEventKind.UPDATED, worker_id, old.role, snapshot))
        return snapshot

    async def deregister(self, worker_id: str) -> bool:
        self._check_open()
        self._expire()
        old = self._records.pop(worker_id, None)
        if old is None:
            return False
        self._publish(RegistryEvent(RegistryEventKind.REMOVED, worker_id, old.role))
        return True

    async def workers(self, role: str | None = None) -> list[WorkerSnapshot]:
        self._check_open()
        self._expire()
        return [
            self._records[wid]
            for wid in sorted(self._records)
            if role is None or self._records[wid].role == role
        ]

    def watch(self, role: str | None = None) -> RegistryWatch:
        self._check_open()
        watch = _InProcessWatch(self, role, self._sweep_interval_s)
        self._watches.add(watch)
        return watch

    async def close(self) -> None:
        self._closed = True
        for watch in list(self._watches):
            await watch.aclose()
        self._records.clear()


def _register_events(old: WorkerSnapshot | None, new: WorkerSnapshot) -> list[RegistryEvent]:
    """Events for a (re-)registration: ADDED, UPDATED, or a move between roles."""
    if old is None:
        return [RegistryEvent(RegistryEventKind.ADDED, new.worker_id, new.role, new)]
    if old.role != new.role:
        return [
            RegistryEvent(RegistryEventKind.REMOVED, old.worker_id, old.role),
            RegistryEvent(RegistryEventKind.ADDED, new.worker_id, new.role, new),
        ]
    return [RegistryEvent(RegistryEventKind.UPDATED, new.worker_id, new.role, new)]


# ---------------------------------------------------------------------------------------------
# Redis implementation

# Drops index entries whose worker key is gone, atomically per entry, so that a concurrent
# re-registration (SET + SADD) is never un-indexed by a reader that saw the old key expire.
_CLEAN_INDEX_LUA = """
local removed = 0
for i = 2, #ARGV do
  if redis.call('EXISTS', ARGV[1] .. ARGV[i]) == 0 then
    removed = removed + redis.call('SREM', KEYS[1], ARGV[i])
  end
end
return removed
"""


class RedisRegistry:
    """A :class:`Registry` in Redis, shared by every process using the same ``namespace``.

    ``ttl_s`` is the liveness lease: a worker must heartbeat more often. ``op_timeout_s`` bounds
    every Redis call (socket connect and read timeouts plus an overall deadline); an unreachable
    or silent server raises :class:`RegistryUnavailableError`. ``poll_interval_s`` (default
    ``ttl_s / 2``) is how often a watch re-reads membership to notice expired workers, so an
    expiry is reported within ``ttl_s + poll_interval_s``.

    The index clean-up script touches keys not passed in KEYS, so this targets a single Redis
    node, not Redis Cluster.
    """

    def __init__(
        self,
        url: str,
        namespace: str = "omniflow",
        ttl_s: float = 3.0,
        *,
        op_timeout_s: float = 2.0,
        poll_interval_s: float | None = None,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if not namespace or ":" in namespace:
            raise ValueError(f"namespace must be non-empty and contain no ':', got {namespace!r}")
        self.url = url
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.op_timeout_s = op_timeout_s
        self.poll_interval_s = poll_interval_s if poll_interval_s is not None else ttl_s / 2
        self._ttl_ms = max(1, math.ceil(ttl_s * 1000))
        # One quick retry absorbs a dropped pooled connection; more would only delay the error.
        self._client: aioredis.Redis = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=op_timeout_s,
            socket_connect_timeout=op_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), retries=1),
        )
        self._clean_index = self._client.register_script(_CLEAN_INDEX_LUA)
        self._watches: set[_RedisWatch] = set()
        self._closed = False

    # Keys ------------------------------------------------------------------------------------

    @property
    def channel(self) -> str:
        """The pub/sub channel carrying this namespace's events."""
        return f"{self.namespace}:events"

    def _worker_prefix(self) -> str:
        return f"{self.namespace}:worker:"

    def _worker_key(self, worker_id: str) -> str:
        return self._worker_prefix() + worker_id

    def _role_key(self, role: str) -> str:
        return f"{self.namespace}:role:{role}"

    def _roles_key(self) -> str:
        return f"{self.namespace}:roles"

    # Plumbing --------------------------------------------------------------------------------

    async def _call(self, awaitable: Awaitable[_T]) -> _T:
        """Await a Redis call under the operation deadline, mapping failures to registry errors."""
        if self._closed:
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # never started; closing avoids a "never awaited" warning
            raise RegistryClosedError("registry is closed")
        try:
            async with asyncio.timeout(self.op_timeout_s):
                return await awaitable
        except (redis_exc.ConnectionError, redis_exc.TimeoutError, TimeoutError, OSError) as exc:
            raise RegistryUnavailableError(f"Redis at {self.url} is unavailable: {exc}") from exc
        except redis_exc.RedisError as exc:
            raise RegistryError(f"Redis at {self.url} failed: {exc}") from exc

    async def _get_snapshot(self, worker_id: str) -> WorkerSnapshot | None:
        raw = await self._call(self._client.get(self._worker_key(worker_id)))
        return None if raw is None else _decode_snapshot(raw, worker_id)

    async def _publish(self, events: list[RegistryEvent]) -> None:
        for event in events:
            await self._call(self._client.publish(self.channel, json.dumps(event.to_dict())))

    # Registry --------------------------------------------------------------------------------

    async def register(self, info: WorkerInfo, load: WorkerLoad | None = None) -> WorkerSnapshot:
        snapshot = WorkerSnapshot(info, load if load is not None else WorkerLoad(), time.time())
        old = await self._get_snapshot(info.worker_id)
        pipe = self._client.pipeline(transaction=True)
        pipe.set(self._worker_key(info.worker_id), json.dumps(snapshot.to_dict()), px=self._ttl_ms)
        pipe.sadd(self._role_key(info.role), info.worker_id)
        pipe.sadd(self._roles_key(), info.role)
        if old is not None and old.role != info.role:
            pipe.srem(self._role_key(old.role), info.worker_id)
        await self._call(pipe.execute())
        await self._publish(_register_events(old, snapshot))
        return snapshot

    async def heartbeat(self, worker_id: str, load: WorkerLoad) -> WorkerSnapshot:
        old = await self._get_snapshot(worker_id)
        if old is None:
            raise UnknownWorkerError(worker_id)
        snapshot = WorkerSnapshot(old.info, load, time.time())
        # XX: never resurrect a record that expired between the GET and this SET.
        stored = await self._call(
            self._client.set(
                self._worker_key(worker_id), json.dumps(snapshot.to_dict()), px=self._ttl_ms, xx=True
            )
        )
        if not stored:
            raise UnknownWorkerError(worker_id)
        if load != old.load:
            await self._publish([RegistryEvent(RegistryEventKind.UPDATED, worker_id, old.role, snapshot)])
        return snapshot

    async def deregister(self, worker_id: str) -> bool:
        old = await self._get_snapshot(worker_id)
        if old is None:
            return False
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._worker_key(worker_id))
        pipe.srem(self._role_key(old.role), worker_id)
        deleted, _ = await self._call(pipe.execute())
        if not deleted:
            return False  # expired or removed by someone else in the meantime
        await self._publish([RegistryEvent(RegistryEventKind.REMOVED, worker_id, old.role)])
        return True

    async def workers(self, role: str | None = None) -> list[WorkerSnapshot]:
        if role is None:
            roles = sorted(await self._call(self._client.smembers(self._roles_key())))
        else:
            roles = [role]
        if not roles:
            return []
        pipe = self._client.pipeline(transaction=False)
        for r in roles:
            pipe.smembers(self._role_key(r))
        members: list[set[str]] = await self._call(pipe.execute())
        ids_by_role = {r: sorted(ids) for r, ids in zip(roles, members, strict=True)}
        all_ids = [wid for r in roles for wid in ids_by_role[r]]
        if not all_ids:
            return []
        raws: list[str | None] = await self._call(self._client.mget([self._worker_key(w) for w in all_ids]))
        found: dict[str, WorkerSnapshot] = {}
        stale: dict[str, list[str]] = {}
        position = 0
        for r in roles:
            for wid in ids_by_role[r]:
                raw = raws[position]
                position += 1
                snapshot = None if raw is None else _decode_snapshot(raw, wid)
                if snapshot is None:
                    stale.setdefault(r, []).append(wid)
                elif snapshot.role == r:  # else: a move between roles in flight; listed under its new role
                    found[wid] = snapshot
        for r, ids in stale.items():
            await self._call(self._clean_index(keys=[self._role_key(r)], args=[self._worker_prefix(), *ids]))
        return [found[wid] for wid in sorted(found)]

    def watch(self, role: str | None = None) -> RegistryWatch:
        if self._closed:
            raise RegistryClosedError("registry is closed")
        watch = _RedisWatch(self, role)
        self._watches.add(watch)
        return watch

    async def close(self) -> None:
        if self._closed:
            return
        for watch in list(self._watches):
            await watch.aclose()
        self._closed = True
        await self._client.aclose()


def _decode_snapshot(raw: str, worker_id: str) -> WorkerSnapshot | None:
    """Parse a stored record; a corrupt one is logged and treated as absent rather than fatal."""
    try:
        return WorkerSnapshot.from_dict(json.loads(raw))
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring corrupt registry record for worker %r: %s", worker_id, exc)
        return None


class _RedisWatch(RegistryWatch):
    """Pub/sub events reconciled with periodic membership polls, in one sequential loop.

    ``_known`` (worker_id -> role) is what this watch has reported as live; every event is
    checked against it, so a worker is reported ADDED once, UPDATED while known, and REMOVED
    once, whether the news arrives by pub/sub or by a poll.
    """

    def __init__(self, registry: RedisRegistry, role: str | None) -> None:
        self._registry = registry
        self._role = role
        self._pubsub = registry._client.pubsub()
        self._known: dict[str, str] = {}
        self._pending: deque[RegistryEvent] = deque()
        self._started = False
        self._closed = False
        self._next_poll = 0.0

    async def start(self) -> None:
        """Subscribe, then read the baseline membership; a watch that fails to start is closed."""
        if self._started:
            return
        if self._closed:
            raise RegistryClosedError("watch is closed")
        try:
            await self._subscribe()
            self._known = {s.worker_id: s.role for s in await self._registry.workers(self._role)}
        except RegistryError:
            await self.aclose()
            raise
        self._next_poll = time.monotonic() + self._registry.poll_interval_s
        self._started = True

    async def _subscribe(self) -> None:
        call = self._registry._call
        await call(self._pubsub.subscribe(self._registry.channel))
        # Wait for the confirmation so that the server has the subscription before the baseline
        # read: every change after the baseline then reaches us by pub/sub, by poll, or both.
        deadline = time.monotonic() + self._registry.op_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RegistryUnavailableError(
                    f"no subscribe confirmation from Redis at {self._registry.url}"
                )
            message = await call(self._pubsub.get_message(timeout=remaining / 2))
            if message is not None and message.get("type") == "subscribe":
                return

    async def __anext__(self) -> RegistryEvent:
        if self._closed:
            raise StopAsyncIteration
        await self.start()
        call = self._registry._call
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            now = time.monotonic()
            if now >= self._next_poll:
                await self._poll()
                self._next_poll = time.monotonic() + self._registry.poll_interval_s
                continue
            # Stay well inside the operation deadline that _call enforces around the wait.
            wait_s = min(self._next_poll - now, self._registry.op_timeout_s / 2)
            message = await call(self._pubsub.get_message(ignore_subscribe_messages=True, timeout=wait_s))
            if message is not None and message.get("type") == "message":
                self._apply_message(message["data"])
        return self._pending.popleft()

    def _apply_message(self, data: str) -> None:
        try:
            event = RegistryEvent.from_dict(json.loads(data))
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("ignoring malformed registry event on %s: %s", self._registry.channel, exc)
            return
        if self._role is not None and event.role != self._role:
            return
        if event.kind is RegistryEventKind.REMOVED:
            if self._known.get(event.worker_id) == event.role:
                del self._known[event.worker_id]
                self._pending.append(event)
            return
        kind = RegistryEventKind.UPDATED if event.worker_id in self._known else RegistryEventKind.ADDED
        self._known[event.worker_id] = event.role
        self._pending.append(RegistryEvent(kind, event.worker_id, event.role, event.snapshot))

    async def _poll(self) -> None:
        live = {s.worker_id: s for s in await self._registry.workers(self._role)}
        for wid in sorted(self._known):
            if wid not in live or live[wid].role != self._known[wid]:
                self._pending.append(RegistryEvent(RegistryEventKind.REMOVED, wid, self._known.pop(wid)))
        for wid, snapshot in live.items():
            if wid not in self._known:
                self._known[wid] = snapshot.role
                self._pending.append(RegistryEvent(RegistryEventKind.ADDED, wid, snapshot.role, snapshot))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._registry._watches.discard(self)
        try:
            await self._pubsub.aclose()
        except (redis_exc.RedisError, OSError) as exc:
            # Closing a connection to a dead server must not mask the caller's own error.
            log.debug("error closing registry watch connection: %s", exc)


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
