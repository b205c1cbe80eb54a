"""Replica supervision for `LocalCluster`: replace the replicas that end unasked.

As Ray Serve and Kubernetes do: a replica one of whose processes ends without being asked
to (killed, crashed, or stopped by itself, say because the GPU weights it attached are gone
or its event loop stalled) is deregistered at once, what is left of it is stopped, and a
fresh replica takes its place under a new worker id (`…-r1`, `…-r2`), after a back-off that
doubles while replacements fail to start or die young. `max_restarts` such replacements in a
row give the place up. Each loss, replacement, failed start and give-up is a `ReplicaEvent`.

One task per place (`_Slot`) watches whichever replica fills it, from the first to the
last replacement; a place is *pending* while it has no replica (lost, replacement not up).
The cluster stops a supervised replica on purpose (retire, stop) only after `unsupervise`,
so that nothing replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from engine.flow.discovery import Registry, RegistryError

if TYPE_CHECKING:
    from engine.worker.launcher import LaunchedWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a supervising `LocalCluster` replaces replicas that end unasked.

    The first replacement starts `backoff_s` after the loss; each further loss of a replica
    that had not yet stayed up `healthy_after_s`, and each replacement that fails to start,
    doubles the wait, up to `max_backoff_s`. A replica that stayed up that long starts the
    count afresh. After `max_restarts` replacements in a row (None: no limit; 0: none at all)
    the place is given up and the role runs one replica short."""

    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    healthy_after_s: float = 60.0
    max_restarts: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.backoff_s <= self.max_backoff_s or not self.healthy_after_s >= 0:
            raise ValueError(f"bad restart policy {self}: need 0 <= backoff_s <= max_backoff_s, healthy_after_s >= 0")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ValueError(f"bad restart policy {self}: max_restarts must be >= 0 or None")

    def delay_s(self, failures: int) -> float:
        """The wait before replacement number `failures` + 1 of a row."""
        return min(self.backoff_s * 2.0 ** failures, self.max_backoff_s)


class ReplicaEventKind(StrEnum):
    LOST = "lost"
    """A process of `worker`'s replica ended unasked; the replica is deregistered and stopped."""
    REPLACED = "replaced"
    """`worker` is a fresh replica, ready and registered, in place of the one `replaces` names."""
    RESTART_FAILED = "restart_failed"
    """A replacement for `replaces` did not come up (`reason`); another try follows the back-off."""
    GAVE_UP = "gave_up"
    """The place of the replica `replaces` names is given up (`max_restarts`)."""


@dataclass(frozen=True, slots=True)
class ReplicaEvent:
    kind: ReplicaEventKind
    role: str
    worker_id: str
    """The replica's rank 0: the one lost, or the new one."""
    reason: str = ""
    worker: LaunchedWorker | None = None
    """REPLACED: the new replica (with its ranks); LOST: the one lost."""
    replaces: str | None = None
    """REPLACED, RESTART_FAILED, GAVE_UP: the worker id of the replica lost."""


@dataclass(eq=False, slots=True)
class _Slot:
    """One replica's place, which successive replacements fill."""

    role: str
    index: int
    worker: LaunchedWorker | None
    """The replica filling it; None while it is pending."""
    lost: LaunchedWorker | None = None
    """While pending: the replica it lost."""
    generation: int = 0
    failures: int = 0
    """Replacements in a row that did not stay up `healthy_after_s`, or did not start."""
    task: asyncio.Task[None] | None = None


def exit_reason(worker: LaunchedWorker, code: int | None) -> str:
    """`worker` ended with status `code` (-N: signal N), in words."""
    if code is None:
        how = "exited (status unknown)"
    elif code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:  # a real-time signal has no name
            name = str(-code)
        how = f"was killed by signal {name}"
    else:
        how = f"exited with status {code}"
    rank = f" (tensor-parallel rank {worker.tp_rank})" if worker.tp_rank else ""
    return f"worker {worker.worker_id}{rank} of role {worker.role!r} {how}"


StartReplica = Callable[[str, int, int], Awaitable["LaunchedWorker"]]
"""(role, index, generation) -> a started, registered replica in the cluster's `workers`."""


class Supervisor:
    """The supervision of one cluster's replicas (see the module docstring). `start` starts a
    replica; `end` stops processes and reaps them; `workers` is the cluster's list of live
    replicas, which the supervisor takes lost ones off."""

    def __init__(self, policy: RestartPolicy, *, registry: Registry, workers: list[LaunchedWorker],
                 start: StartReplica, end: Callable[[list[LaunchedWorker]], Awaitable[None]],
                 on_event: Callable[[ReplicaEvent], Awaitable[None]] | None) -> None:
        self.policy = policy
        self._registry = registry
        self._workers = workers
        self._start = start
        self._end = end
        self._on_event = on_event
        self._slots: list[_Slot] = []

    def watch(self, worker: LaunchedWorker, index: int) -> None:
        """Supervise `worker`, replica `index` of its role, from now on."""
        slot = _Slot(worker.role, index, worker)
        slot.task = asyncio.get_running_loop().create_task(self._supervise(slot),
                                                           name=f"omniflow-supervise-{worker.worker_id}")
        self._slots.append(slot)

    def pending(self, role: str) -> int:
        """How many replicas of `role` are lost and waiting for (or starting) their replacement."""
        return sum(1 for slot in self._slots if slot.role == role and slot.worker is None)

    async def cancel_pending(self, role: str, count: int) -> int:
        """Give up to `count` pending places of `role` (scaling down); returns how many."""
        slots = [slot for slot in self._slots if slot.role == role and slot.worker is None][:count]
        await self._cancel(slots)
        return len(slots)

    async def unsupervise(self, worker: LaunchedWorker) -> None:
        """Stop supervising the place `worker` fills, or filled until it was lost (it is being
        stopped on purpose: nothing replaces it)."""
        await self._cancel([slot for slot in self._slots if worker in (slot.worker, slot.lost)])

    async def close(self) -> None:
        await self._cancel(list(self._slots))

    async def _cancel(self, slots: list[_Slot]) -> None:
        for slot in slots:
            self._forget(slot)
        # A listener that stops the cluster from inside an event must not wait for itself.
        tasks = [s.task for s in slots if s.task is not None and s.task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _forget(self, slot: _Slot) -> None:
        if slot in self._slots:
            self._slots.remove(slot)

    async def _emit(self, event: ReplicaEvent) -> None:
        log.log(logging.INFO if event.kind is ReplicaEventKind.REPLACED else logging.WARNING,
                "role %r: replica %s %s%s", event.role, event.worker_id, event.kind.value,
                f": {event.reason}" if event.reason else "")
        if self._on_event is not None:
            try:
                await self._on_event(event)
            except Exception:  # a listener's failure must not stop the supervision
                log.exception("the replica event listener failed on %s", event)

    async def _supervise(self, slot: _Slot) -> None:
        """Watch the replica filling `slot`; when it is lost, replace it; until given up."""
        try:
            # `slot` leaves `_slots` when a listener stops the cluster or retires the replica meanwhile.
            while slot.worker is not None and slot in self._slots:
                await self._lose(slot, slot.worker)
                if slot in self._slots:
                    await self._replace(slot)  # fills `slot.worker`, or leaves it None when given up
        except Exception:  # a defect here must not leave the place counted as pending for good
            log.exception("supervising replica %d of role %r failed; it is no longer supervised",
                          slot.index, slot.role)
        finally:
            self._forget(slot)

    async def _lose(self, slot: _Slot, worker: LaunchedWorker) -> None:
        """Wait for any process of `worker`'s replica to end; then take it off the registry,
        stop what is left of it, and mark its place pending."""
        born = time.monotonic()
        waits = {asyncio.ensure_future(rank.process.wait()): rank for rank in worker.processes}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        lived = time.monotonic() - born
        dead = waits[next(iter(done))]
        reason = exit_reason(dead, dead.process.returncode)
        # Off the registry first, so no new call goes there while the rest of it stops; shielded:
        # a cancellation inside a Redis command can leave the shared client unusable.
        with contextlib.suppress(RegistryError):  # gone already, or the registry is down: its TTL ends it
            await asyncio.shield(self._registry.deregister(worker.worker_id))
        await self._end(worker.processes)  # what is left of a tensor-parallel replica, and the relays
        # Only now, and at once: until here a stop() still ends it, and it counts as live, not pending.
        if worker in self._workers:
            self._workers.remove(worker)
        slot.worker, slot.lost = None, worker
        if lived >= self.policy.healthy_after_s:
            slot.failures = 0
        await self._emit(ReplicaEvent(ReplicaEventKind.LOST, worker.role, worker.worker_id, reason, worker))

    async def _replace(self, slot: _Slot) -> None:
        """A fresh replica in `slot`'s place (`slot.worker`), after the back-off; none once the
        policy gives up."""
        policy, lost = self.policy, slot.lost
        assert lost is not None
        while policy.max_restarts is None or slot.failures < policy.max_restarts:
            await asyncio.sleep(policy.delay_s(slot.failures))
            slot.failures += 1
            slot.generation += 1
            try:
                fresh = await self._start(slot.role, slot.index, slot.generation)
            except Exception as exc:  # noqa: BLE001 - any failure to start is this attempt's; the next follows the back-off
                await self._emit(ReplicaEvent(ReplicaEventKind.RESTART_FAILED, slot.role, lost.worker_id,
                                              f"{type(exc).__name__}: {exc}", replaces=lost.worker_id))
                if slot not in self._slots:  # a listener stopped the cluster meanwhile
                    return
                continue
            slot.worker, slot.lost = fresh, None
            await self._emit(ReplicaEvent(ReplicaEventKind.REPLACED, slot.role, fresh.worker_id,
                                          f"in place of {lost.worker_id}", fresh, replaces=lost.worker_id))
            return
        why = ("restarts are off (max_restarts 0)" if not policy.max_restarts else
               f"{slot.failures} replacement(s) in a row failed to start or did not stay up"
               f" {policy.healthy_after_s:g} s")
        await self._emit(ReplicaEvent(ReplicaEventKind.GAVE_UP, slot.role, lost.worker_id, why,
                                      replaces=lost.worker_id))
