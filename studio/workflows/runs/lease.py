"""Run leases: a run is executed by whoever holds its lease, and only while they renew it.

Whatever executes a run (a Celery worker's `execute_run` task, or the web process's
`RunService` in the embedded mode) claims it with `LeaseTerms` (`store.claim`): the row gets
the holder's id (`lease_owner`) and an expiry one lease period ahead (`lease_expires_at`),
and `attempts` counts the execution. While the run executes, a `LeaseKeeper` on the
executor's event loop renews the leases it holds every `tick_s` (a third of the period, at
most a second) and reads whether each run was asked to cancel (`cancel_requested`) or was
taken from it (finished by someone else, restarted elsewhere): a run whose lease it lost is
stopped without writing anything more (`store.record` refuses a writer that no longer holds
the lease: `LeaseLost`).

What happens to a lease that lapses (its executor died) is `studio.workflows.runs.recovery`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec
from django.db import DatabaseError
from django.utils import timezone

log = logging.getLogger(__name__)

RUN_RESTARTED = "run_restarted"
"""The type of `RunRestarted`, as stored and published: `{seq, run_id, time, type, attempt, error}`."""


class RunRestarted(msgspec.Struct, tag=RUN_RESTARTED, kw_only=True):
    """The event the studio stores when a run whose executor stopped is executed again (its
    `attempt`, and why the last one stopped). Every node is pending again after it, and the events
    of the new execution follow (from `run_started`)."""

    seq: int
    run_id: str
    time: float
    attempt: int
    error: str


class LeaseLost(RuntimeError):
    """This executor no longer holds the run's lease (it lapsed and the run was restarted or
    ended elsewhere): it must stop the run and write nothing more."""


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    """Who holds a lease, and for how long each renewal extends it."""

    owner: str
    period_s: float

    @property
    def tick_s(self) -> float:
        """How often the holder renews (and reads cancel requests)."""
        return min(self.period_s / 3, 1.0)

    def expiry(self) -> dt.datetime:
        return timezone.now() + dt.timedelta(seconds=self.period_s)


def executor_id(kind: str) -> str:
    """A lease owner id unique to this process and call: `kind:host:pid:nonce`."""
    return f"{kind}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class LeaseCheck:
    """What one renewal found."""

    lost: frozenset[str]
    """Runs whose lease this holder no longer has: stop them, write nothing."""
    cancel: frozenset[str]
    """Runs still held that were asked to cancel."""


# ------------------------------------------------------------------------------ keeper
class LeaseStore(Protocol):
    async def renew(self, run_ids: list[str]) -> LeaseCheck:
        """Extend this holder's leases on `run_ids` (`store.renew`)."""
        ...


@dataclass(slots=True)
class _Held:
    on_cancel: Callable[[], None]
    on_lost: Callable[[], None]
    cancelling: bool = False


class LeaseKeeper:
    """Renews the leases of the runs one executor holds, on the executor's event loop: one
    renewal task while any run is held, none otherwise. `hold`/`release` on that loop only."""

    def __init__(self, store: LeaseStore, terms: LeaseTerms) -> None:
        self._store = store
        self.terms = terms
        self._held: dict[str, _Held] = {}
        self._task: asyncio.Task[None] | None = None

    def hold(self, run_id: str, *, on_cancel: Callable[[], None], on_lost: Callable[[], None]) -> None:
        """Keep renewing `run_id`'s lease (just claimed) until `release`; `on_cancel` is called
        once when it is asked to cancel, `on_lost` when the lease was taken from it."""
        self._held[run_id] = _Held(on_cancel, on_lost)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._renew(), name="omniflow-run-leases")

    def release(self, run_id: str) -> None:
        self._held.pop(run_id, None)

    @property
    def held(self) -> list[str]:
        return list(self._held)

    async def _renew(self) -> None:
        while self._held:
            await asyncio.sleep(self.terms.tick_s)
            if not self._held:
                return
            try:
                check = await self._store.renew(list(self._held))
            except DatabaseError:  # the database away for a moment: the lease still runs; try next tick
                log.exception("renewing the leases of runs %s failed", sorted(self._held))
                continue
            for run_id in check.lost:
                held = self._held.pop(run_id, None)
                if held is not None:
                    log.error("run %s: its lease was lost (taken over after it lapsed); stopping it here", run_id)
                    held.on_lost()
            for run_id in check.cancel:
                held = self._held.get(run_id)
                if held is not None and not held.cancelling:
                    held.cancelling = True
                    held.on_cancel()

    async def aclose(self) -> None:
        self._held.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
