"""What becomes of a run whose executor is gone, and cancelling a run executed elsewhere.

A run's executor renews its lease (`studio.workflows.runs.lease`). One that dies (SIGKILL,
OOM) stops renewing; every Celery worker of the run queue sweeps the run table every half
lease period (`sweep_expired`, from `studio.workflows.tasks`), and so does the embedded
studio's `RunService` (from its start on: `resume_stale`), so a lapsed lease is noticed
within two lease periods of the last renewal. The run is then executed again from the start
while it has been executed at most `retries` (OMNIFLOW_RUN_LEASE_RETRIES) times: a
`run_restarted` event goes into its log, its node states and outputs are reset, it is
`pending` again and dispatched anew, and the new execution's events follow in the same log
(from `run_started`). After that it is failed with "the worker executing this run stopped
(lease expired at …)". A run asked to cancel is cancelled instead. A running row without a
lease (left by a process from before leases) counts as lapsed; a fresh lease, whoever holds
it, is never touched. A chat session whose turn it was takes turns again once the run has
ended (`studio.workflows.chat.turns`).

`request_cancel` is how the API cancels a run this process does not execute: a pending run,
or one whose lease lapsed, ends `cancelled` at once; a live holder is asked to cancel it and
does within a lease tick.

Every function here is synchronous (ORM), like `store`.
"""

from __future__ import annotations

import datetime as dt
import enum
import logging
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from engine.client.runs import RunStatus
from studio.workflows.models import Run
from studio.workflows.models import RunStatus as DbRunStatus
from studio.workflows.runs.lease import RunRestarted
from studio.workflows.runs.store import finish, record

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ cancel
class CancelRequest(enum.StrEnum):
    CANCELLED = "cancelled"
    """It ended `cancelled` now (it was pending, or its executor had stopped)."""
    REQUESTED = "requested"
    """Its executor was asked to cancel it; it ends `cancelled` within a lease tick."""
    FINISHED = "finished"
    """It had already ended; nothing changed."""


@dataclass(frozen=True, slots=True)
class CancelResult:
    outcome: CancelRequest
    events: list[dict[str, Any]]
    """Events stored (to publish) when it ended now."""


def _expired(run: Run, now: dt.datetime) -> bool:
    return run.lease_expires_at is None or run.lease_expires_at < now


def request_cancel(run_id: str) -> CancelResult:
    """Cancel a run this process does not execute (see the module docstring)."""
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(pk=run_id).first()
        if run is None or run.finished:
            return CancelResult(CancelRequest.FINISHED, [])
        if run.status == DbRunStatus.PENDING:
            return CancelResult(CancelRequest.CANCELLED, finish(run, RunStatus.CANCELLED, "cancelled by request"))
        if _expired(run, timezone.now()):
            return CancelResult(CancelRequest.CANCELLED, finish(
                run, RunStatus.CANCELLED, f"cancelled by request; {_stopped(run)}"))
        if not run.cancel_requested:
            run.cancel_requested = True
            run.save(update_fields=["cancel_requested"])
    return CancelResult(CancelRequest.REQUESTED, [])


# ------------------------------------------------------------------------------- sweep
@dataclass(frozen=True, slots=True)
class Swept:
    """A run whose lease had lapsed, and what became of it."""

    run_id: str
    events: list[dict[str, Any]]
    """Stored events to publish."""
    restarted: bool
    """Pending again: dispatch it."""


def _stopped(run: Run) -> str:
    when = "never" if run.lease_expires_at is None else run.lease_expires_at.isoformat(timespec="seconds")
    return f"the worker executing this run stopped (lease expired at {when})"


def sweep_expired(retries: int) -> list[Swept]:
    """Restart or end every running run whose lease lapsed. Safe to run in many processes at
    once: each run is taken under its row lock, and one another sweeper holds is skipped."""
    now = timezone.now()
    lapsed = Q(status=DbRunStatus.RUNNING) & (Q(lease_expires_at__lt=now) | Q(lease_expires_at__isnull=True))
    swept = []
    for run_id in Run.objects.filter(lapsed).values_list("pk", flat=True):
        with transaction.atomic():
            run = Run.objects.select_for_update(skip_locked=True).filter(lapsed, pk=run_id).first()
            if run is None:
                continue
            if run.cancel_requested:
                events = finish(run, RunStatus.CANCELLED, f"cancelled by request; {_stopped(run)}")
                swept.append(Swept(str(run.pk), events, restarted=False))
            elif run.attempts <= retries:
                log.warning("run %s: %s; executing it again (attempt %d)", run.pk, _stopped(run), run.attempts + 1)
                event = RunRestarted(seq=run.last_seq + 1, run_id=str(run.pk), time=now.timestamp(),
                                     attempt=run.attempts + 1, error=_stopped(run))
                swept.append(Swept(str(run.pk), record(str(run.pk), [event]), restarted=True))
            else:
                log.warning("run %s: %s; failing it after %d attempts", run.pk, _stopped(run), run.attempts)
                events = finish(run, RunStatus.FAILED, f"{_stopped(run)}; it was executed {run.attempts} times")
                swept.append(Swept(str(run.pk), events, restarted=False))
    return swept


