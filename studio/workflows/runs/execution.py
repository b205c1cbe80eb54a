"""The seam between the studio and the engine: execute one stored run by id.

`execute_run` claims the run (so executing it twice is harmless), submits it to an
`Executor`, and for every batch of events the executor emits: stores them (Run, NodeRun
and RunEvent rows, output files) and then publishes them to live followers. A follower
that reads the database and then the bus therefore misses nothing.

It runs wherever an executor lives: on the engine loop of the web process (embedded,
`RunService`) or in a Celery worker (`execute_standalone`, distributed). Which executor
runs a claimed run is the `ExecutorSource`'s choice: the process's own (in-process
dispatch) for a plain run, a `WorkerDispatcher` on the deployment's role workers for a
run submitted against a deployment (see `studio.workflows.deployments`). Either way the run is
submitted with its tenant (`Run.tenant`: its owner, or its deployment's shared scope), so the
units it shares with other users' runs keep their caches apart.

With a `LeaseKeeper`, the run's lease (taken by `store.claim`) is renewed while it
executes; a cancel request read at a renewal cancels it, and a lost lease stops it here
without another write (`studio.workflows.runs.lease`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

import msgspec

from engine.client.graphs import GraphValidationError, parse_spec
from engine.client.runs import (
    EventLog,
    Executor,
    HeldBlob,
    NodeOutputEvent,
    Run,
    RunEvent,
    RunFinished,
    RunInputError,
    RunStatus,
    TransferError,
    in_process_executor,
)
from engine.spec.kinds import KindRegistry
from engine.spec.ops import OpConfig
from engine.spec.userfiles import UsersRoot
from studio.workflows.runs.bus import RunEventBus
from studio.workflows.runs.lease import LeaseKeeper
from studio.workflows.runs.metrics import RunMetrics
from studio.workflows.runs.store import NODE_MEDIA_LIMIT, EventsRefused, RunTicket

log = logging.getLogger(__name__)


class DeploymentUnavailable(RuntimeError):
    """The run's deployment has no workers this process can reach (stopped, or hosted elsewhere)."""


class ExecutorSource(Protocol):
    async def executor_for(self, ticket: RunTicket) -> Executor:
        """The executor that runs `ticket`; raises DeploymentUnavailable."""
        ...

    async def materialize(self, ticket: RunTicket, outputs: dict[str, Any]) -> dict[str, Any]:
        """The run's outputs as plain values (references to workers' tensors pulled)."""
        ...


class OwnExecutor:
    """One executor for every run (in-process dispatch); runs of deployments are refused."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    async def executor_for(self, ticket: RunTicket) -> Executor:
        if ticket.deployment_id is not None:
            raise DeploymentUnavailable(f"deployment {ticket.deployment_id} has no workers this process can reach")
        return self.executor

    async def materialize(self, ticket: RunTicket, outputs: dict[str, Any]) -> dict[str, Any]:
        return outputs


class RunStore(Protocol):
    async def claim(self, run_id: str) -> RunTicket | None: ...

    async def record(self, run_id: str, events: list[RunEvent], final_outputs: dict | None = None,
                     blobs: dict[int, list[HeldBlob]] | None = None) -> list[dict]:
        """Store the executor's events (typed; `seq` numbered on from the ticket's `seq_base`);
        they come back as stored (JSON data), to publish. `EventsRefused` when the database
        refuses them (nothing written)."""
        ...

    async def finish_unstarted(self, run_id: str, status: RunStatus, error: str, *,
                               only_pending: bool) -> list[dict] | None: ...


async def _next_event(log_: EventLog, position: int) -> None:
    """Return once the log holds an event at `position`."""
    follower = log_.follow(position)
    try:
        await anext(follower, None)
    finally:
        await follower.aclose()


async def _blobs(run: Run, batch: list[RunEvent], ticket: RunTicket,
                 executors: ExecutorSource) -> dict[int, list[HeldBlob]]:
    """The byte blobs (images, audio) the `node_output` events of `batch` only preview, by
    stored seq, each with its place in the value, pulled from the workers that hold them. Blobs
    that cannot be pulled any more (their worker gone, its lease over) keep their previews: the
    run goes on without them."""
    held = {e.seq + ticket.seq_base: blobs for e in batch if isinstance(e, NodeOutputEvent)
            and (blobs := run.take_blobs(e.seq))}
    if not held:
        return {}
    refs = {f"{seq}/{i}": blob.value for seq, blobs in held.items() for i, blob in enumerate(blobs)}
    try:
        pulled = await executors.materialize(ticket, refs)
    except (TransferError, DeploymentUnavailable) as exc:
        log.warning("run %s: node outputs %s could not be pulled for previews: %s", ticket.run_id, sorted(held), exc)
        return {}
    return {seq: [HeldBlob(blob.path, bytes(data)) for i, blob in enumerate(blobs)
                  if isinstance(data := pulled.get(f"{seq}/{i}"), bytes | bytearray | memoryview)]
            for seq, blobs in held.items()}


async def _pump(run: Run, ticket: RunTicket, executors: ExecutorSource, store: RunStore, bus: RunEventBus,
                metrics: RunMetrics, cancel: asyncio.Event) -> RunStatus:
    run_id = ticket.run_id
    position = 0
    cancel_requested = asyncio.ensure_future(cancel.wait())
    cancelling = False
    try:
        while True:
            if cancel_requested.done() and not cancelling:
                cancelling = True
                if not run.done:
                    await run.cancel()  # the run's remaining events are in its log when this returns
            batch = run.log.snapshot(position)
            if not batch:
                arrival = asyncio.ensure_future(_next_event(run.log, position))
                waiting = {arrival} if cancelling else {arrival, cancel_requested}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if not arrival.done():
                    arrival.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await arrival
                continue
            final = isinstance(batch[-1], RunFinished)
            outputs = await executors.materialize(ticket, (await run.wait()).outputs) if final else None
            events = [msgspec.structs.replace(e, seq=e.seq + ticket.seq_base) for e in batch]
            blobs = await _blobs(run, batch, ticket, executors)
            try:
                stored = await store.record(run_id, events, outputs, blobs)
            except EventsRefused as exc:
                return await _refused(run, run_id, store, bus, metrics, exc)
            await bus.publish(run_id, stored)
            metrics.observe(batch, ticket.node_kinds)
            position += len(batch)
            if final:
                return batch[-1].status
    finally:
        cancel_requested.cancel()


async def _refused(run: Run, run_id: str, store: RunStore, bus: RunEventBus, metrics: RunMetrics,
                   refused: EventsRefused) -> RunStatus:
    """The run's events could not be stored: it is stopped and ends `failed` saying why, rather
    than run on unrecorded (its lease would lapse and it would be executed again, to the same end)."""
    log.error("run %s: %s; failing it", run_id, refused)
    if not run.done:
        await run.cancel()
    events = await store.finish_unstarted(run_id, RunStatus.FAILED, f"its results could not be stored: {refused}",
                                          only_pending=False)
    if events:
        await bus.publish(run_id, events)
        metrics.runs_finished.labels(str(RunStatus.FAILED)).inc()
    return RunStatus.FAILED


async def execute_run(run_id: str, *, executors: ExecutorSource, store: RunStore, bus: RunEventBus,
                      metrics: RunMetrics, cancel: asyncio.Event | None = None,
                      keeper: LeaseKeeper | None = None) -> RunStatus | None:
    """Execute the stored run `run_id` to its end; None when it was not pending.

    Setting `cancel` stops it (before it starts, or while it runs). A run that cannot
    start (its spec or inputs no longer pass, a file is gone, its deployment is gone)
    ends `failed` with one `run_finished` event carrying the reason. With `keeper` (and a
    store claiming under its lease), the lease is renewed until the run ends; losing it
    cancels the task executing this coroutine."""
    cancel = cancel or asyncio.Event()
    if cancel.is_set():
        events = await store.finish_unstarted(run_id, RunStatus.CANCELLED, "cancelled by request", only_pending=True)
        if events:
            await bus.publish(run_id, events)
        return RunStatus.CANCELLED if events else None
    try:
        ticket = await store.claim(run_id)
    except LookupError as exc:
        ticket, error = None, str(exc)
    else:
        error = None
    if ticket is None and error is None:
        return None
    if keeper is not None and ticket is not None:
        task = asyncio.current_task()
        assert task is not None
        keeper.hold(run_id, on_cancel=cancel.set, on_lost=task.cancel)
    try:
        return await _execute_claimed(run_id, ticket, error, executors=executors, store=store, bus=bus,
                                      metrics=metrics, cancel=cancel)
    finally:
        if keeper is not None:
            keeper.release(run_id)


async def _execute_claimed(run_id: str, ticket: RunTicket | None, error: str | None, *, executors: ExecutorSource,
                           store: RunStore, bus: RunEventBus, metrics: RunMetrics,
                           cancel: asyncio.Event) -> RunStatus | None:
    run = None
    executor: Executor | None = None
    if ticket is not None:
        try:
            executor = await executors.executor_for(ticket)
            plan = executor.plan(parse_spec(ticket.spec))
            run = await executor.submit(plan, ticket.inputs, run_id=run_id, timeout_s=ticket.timeout_s,
                                        tenant=ticket.tenant, owner=ticket.owner, keep_blobs=NODE_MEDIA_LIMIT)
        except GraphValidationError as exc:
            error = "the workflow is not valid: " + "; ".join(i.message for i in exc.issues)
        except RunInputError as exc:
            error = f"invalid inputs: {exc}"
        except DeploymentUnavailable as exc:
            error = str(exc)
    if run is None:
        events = await store.finish_unstarted(run_id, RunStatus.FAILED, error or "could not start", only_pending=False)
        if events:
            await bus.publish(run_id, events)
            metrics.runs_finished.labels(str(RunStatus.FAILED)).inc()
        return RunStatus.FAILED
    assert ticket is not None and executor is not None
    metrics.runs_submitted.inc()
    metrics.runs_active.inc()
    try:
        return await _pump(run, ticket, executors, store, bus, metrics, cancel)
    finally:
        metrics.runs_active.dec()
        if not run.done:  # the pump failed (e.g. the database went away): stop the run too
            log.error("run %s: its events could not be stored; cancelling it", run_id)
            await run.cancel()
        executor.forget(run_id)


async def execute_standalone(run_id: str, *, kinds: KindRegistry, ops: OpConfig, store: RunStore, bus: RunEventBus,
                             metrics: RunMetrics, executors: ExecutorSource | None = None,
                             keeper: LeaseKeeper | None = None, users: UsersRoot | None = None) -> RunStatus | None:
    """Execute one run with an executor of its own (a Celery worker's task). `ops`: what its
    python units may run; `users`: where they write a run's files (this node's users root).
    `executors` (when given) serves runs of deployments; the caller closes it."""
    executor = in_process_executor(kinds, ops=ops, users=users)  # torch: when a run executes, not at import
    source = executors or OwnExecutor(executor)
    try:
        return await execute_run(run_id, executors=_Fallback(source, executor), store=store, bus=bus,
                                 metrics=metrics, keeper=keeper)
    finally:
        await executor.aclose()


class _Fallback:
    """Runs of deployments to `source`, every other run to `executor`."""

    def __init__(self, source: ExecutorSource, executor: Executor) -> None:
        self._source = source
        self._executor = executor

    async def executor_for(self, ticket: RunTicket) -> Executor:
        if ticket.deployment_id is None:
            return self._executor
        return await self._source.executor_for(ticket)

    async def materialize(self, ticket: RunTicket, outputs: dict[str, Any]) -> dict[str, Any]:
        if ticket.deployment_id is None:
            return outputs  # the in-process executor's outputs are values already
        return await self._source.materialize(ticket, outputs)
