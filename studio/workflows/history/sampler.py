"""The sampler: every `OMNIFLOW_METRICS_INTERVAL_S`, one point per live worker into the history.

One `MetricsSampler` per studio process, owned by its `StudioEngine` (`engine().history`),
started by the ASGI application when it serves (`studio.asgi`), never by a browser: however
many cluster pages are open, each worker gets one point per interval. In the distributed mode
every web process runs one, and the one holding the Redis lease (`HistoryStore.hold_sampler`,
renewed each tick, lapsing after `LEASE_INTERVALS` intervals) writes; the others wait to take
over. The sampler runs on a thread of its own (`omniflow-metrics`): it reads the active
deployments from the database and their workers' snapshots from the engine loop, which owns
the registries (`EmbeddedDeployments.snapshots`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from django.db import DatabaseError, close_old_connections, connections

from engine.client.cluster import RegistryError, WorkerSnapshot
from studio.workflows.history.points import point_of
from studio.workflows.history.store import HistoryStore, HistoryUnavailable, Sample, WorkerMeta
from studio.workflows.runs.service import EngineLoopError

log = logging.getLogger(__name__)

LEASE_INTERVALS = 3
"""A sampler that missed this many ticks (and at least `MIN_LEASE_S`) hands over to another process."""
MIN_LEASE_S = 2.0

LiveWorkers = Callable[[], dict[str, list[WorkerSnapshot]]]
"""Deployment id -> its live workers' snapshots, now."""


def reason(exc: BaseException) -> str:
    """`exc` as a log line gives it: its type, and its message when it has one (a bare
    `TimeoutError()` has none, which logged alone read as an empty reason)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class MetricsSampler:
    def __init__(self, store: HistoryStore, live: LiveWorkers, *, interval_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.interval_s = interval_s
        self.owner = f"sampler-{uuid.uuid4().hex[:12]}"
        self._live = live
        self._clock = clock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def lease_s(self) -> float:
        return max(MIN_LEASE_S, LEASE_INTERVALS * self.interval_s)

    def sample_once(self) -> int:
        """Take one point of every live worker, if this sampler holds the lease; how many it wrote.
        Raises `HistoryUnavailable` (the store), `RegistryError`/`TimeoutError` (the registry) or
        `EngineLoopError` (the studio's engine loop is not up yet)."""
        if not self.store.hold_sampler(self.owner, self.lease_s):
            return 0
        live = self._live()
        t = self._clock()
        samples = [Sample(WorkerMeta(worker_id=s.worker_id, deployment=deployment, role=s.role, device=s.info.device,
                                     host=s.info.host, model=s.info.model), point_of(s, t))
                   for deployment, snapshots in live.items() for s in snapshots]
        self.store.append(t, samples)
        return len(samples)

    # ------------------------------------------------------------------ thread
    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Start sampling on the sampler's thread (idempotent)."""
        with self._lock:
            if self._thread is not None:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._main, name="omniflow-metrics", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and give the lease up (idempotent)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout_s)
        try:
            self.store.release_sampler(self.owner)
        except HistoryUnavailable as exc:
            log.warning("%s", exc)

    def _main(self) -> None:
        failing = False
        while not self._stop.is_set():
            began = time.monotonic()
            close_old_connections()
            try:
                self.sample_once()
            except (HistoryUnavailable, RegistryError, TimeoutError, DatabaseError, EngineLoopError) as exc:
                if not failing:  # once per outage, not once per tick
                    log.warning("sampling worker metrics failed: %s", reason(exc))
                failing = True
            else:
                failing = False
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))
        connections.close_all()  # this thread's own
