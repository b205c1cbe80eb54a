"""The in-process registry: for the embedded mode and tests."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from engine.flow.discovery.records import (
    FENCE_TTL_S,
    Clock,
    FencedWorkerError,
    RegistryClosedError,
    RegistryEvent,
    RegistryEventKind,
    RegistryWatch,
    UnknownWorkerError,
    WorkerInfo,
    WorkerLoad,
    WorkerSnapshot,
    _register_events,
)

log = logging.getLogger(__name__)


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
    watch waits, every ``sweep_interval_s`` real seconds (default ``ttl_s / 2``). A fenced id is
    refused for ``fence_ttl_s`` of ``clock``.
    Not thread-safe: use from one event loop.
    """

    def __init__(
        self, ttl_s: float = 3.0, *, clock: Clock = time.time, sweep_interval_s: float | None = None,
        fence_ttl_s: float = FENCE_TTL_S,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if not fence_ttl_s > 0:
            raise ValueError(f"fence_ttl_s must be > 0, got {fence_ttl_s}")
        self.ttl_s = ttl_s
        self.fence_ttl_s = fence_ttl_s
        self._clock = clock
        self._sweep_interval_s = sweep_interval_s if sweep_interval_s is not None else ttl_s / 2
        self._records: dict[str, WorkerSnapshot] = {}
        self._fenced: dict[str, float] = {}
        """Fenced worker id -> when (``clock``) its fence ends."""
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
        for worker_id in [w for w, until in self._fenced.items() if now >= until]:
            del self._fenced[worker_id]

    async def register(self, info: WorkerInfo, load: WorkerLoad | None = None) -> WorkerSnapshot:
        self._check_open()
        self._expire()
        if info.worker_id in self._fenced:
            raise FencedWorkerError(info.worker_id)
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

    async def fence(self, worker_id: str) -> bool:
        self._check_open()
        self._fenced[worker_id] = self._clock() + self.fence_ttl_s
        return await self.deregister(worker_id)

    async def fenced(self, worker_ids: Sequence[str]) -> set[str]:
        self._check_open()
        self._expire()
        return {w for w in worker_ids if w in self._fenced}

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
        self._fenced.clear()




# ---------------------------------------------------------------------------------------------
# Redis implementation

# Drops index entries whose worker key is gone, atomically per entry, so that a concurrent
# re-registration (SET + SADD) is never un-indexed by a reader that saw the old key expire.
