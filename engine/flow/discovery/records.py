"""Worker records, registry events, and the `Registry` protocol."""


from __future__ import annotations

import abc
import enum
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")

Clock = Callable[[], float]

FENCE_TTL_S = 24 * 3600.0
"""How long a fenced worker id stays refused (``Registry.fence``): longer than any cut-off a
worker process could outlive and come back from (its node agent, back sooner, ends it anyway)."""


# ---------------------------------------------------------------------------------------------
# Errors


class RegistryError(Exception):
    """Base class of every error raised by a registry."""


class UnknownWorkerError(RegistryError):
    """The worker has no live record (never registered, deregistered, fenced, or its TTL expired).

    A worker that gets this from ``heartbeat`` must ``register`` again; ``register`` tells a
    record merely lost (a Redis restart or flush, a pause past the TTL: it registers) from a
    fenced id (:class:`FencedWorkerError`: the worker must stop).
    """

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"worker {worker_id!r} is not registered (or its registration expired)")
        self.worker_id = worker_id


class FencedWorkerError(RegistryError):
    """``register`` refused a fenced worker id (see ``Registry.fence``): the worker was declared
    lost -- its node cut off, say -- and its replica placed again elsewhere, so it must not serve
    again; a worker that gets this drains and exits."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"worker {worker_id!r} was fenced (declared lost and replaced): it may not register again")
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
      re-registering an id with a different role moves it to that role. It refuses a fenced id
      with :class:`FencedWorkerError`, atomically with respect to ``fence``.
    * ``heartbeat`` renews the lease and stores the load; it raises
      :class:`UnknownWorkerError` when there is no live record, and the caller must
      ``register`` again.
    * ``fence`` is ``deregister`` plus a tombstone: the id is retired for ``fence_ttl_s``, so a
      worker declared lost by someone else (its process may still run, cut off) cannot come back
      by itself. Only an expired record is re-registered, never a fenced one.
    * ``workers`` lists live workers only, sorted by ``worker_id``.
    * ``watch`` yields changes after the watch starts (see :class:`RegistryWatch`); a heartbeat
      whose load is unchanged produces no event.
    * Backend failures raise :class:`RegistryUnavailableError`; no call blocks without a timeout.
    """

    async def register(self, info: WorkerInfo, load: WorkerLoad | None = None) -> WorkerSnapshot:
        """Create or replace ``info.worker_id``'s record; returns the stored snapshot. Raises
        :class:`FencedWorkerError` when the id is fenced."""
        ...

    async def heartbeat(self, worker_id: str, load: WorkerLoad) -> WorkerSnapshot:
        """Renew the lease and store ``load``; raises :class:`UnknownWorkerError` if not live."""
        ...

    async def deregister(self, worker_id: str) -> bool:
        """Remove the record; returns whether a live record existed."""
        ...

    async def fence(self, worker_id: str) -> bool:
        """Remove the record and retire the id: ``register`` refuses it from now on (for the
        registry's ``fence_ttl_s``). Returns whether a live record existed."""
        ...

    async def fenced(self, worker_ids: Sequence[str]) -> set[str]:
        """Which of ``worker_ids`` are fenced now (their tombstones, which a Redis flush or restart
        loses: whoever keeps the durable record of lost workers fences them again)."""
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
