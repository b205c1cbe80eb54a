"""RunService: executes the studio's runs in this process (the embedded mode).

One per process, owned by the workflows AppConfig (`studio.workflows.apps.engine()`
reaches it); there is no module-level instance. It owns:

* the **engine loop**: an asyncio loop on its own thread (`omniflow-engine`) with one
  in-process `Executor` (`engine.client.runs.in_process_executor`). The loop belongs to
  the service, not to the web server, so the same code runs under daphne, uvicorn,
  `runserver`, Django's test client and a Celery worker;
* the **database thread** (`omniflow-db`) every event write goes through, in order;
* the **deployments** it hosts (`EmbeddedDeployments`, given to it): their role workers'
  clusters and executors live on the engine loop, and runs submitted against a
  deployment execute there. `call(coro)` runs a coroutine on the loop from any thread.

Its runs are claimed under a lease of its own (`lease.LeaseKeeper`, renewed on the engine
loop), so a run it executes can be cancelled from another process, and one it no longer
executes (it stopped mid-run) is cancelled at once (`recovery.request_cancel`).

A studio process that stopped mid-run (restarted, SIGKILLed, OOM) leaves its runs running
under leases nobody renews. `resume_stale`, once per process start (`studio.asgi`), sweeps
them as the Celery mode's run workers do (`recovery.sweep_expired`: executed again here while
they have been executed at most `lease_retries` times, else failed saying the lease expired),
takes up the pending runs, and from then on sweeps every half lease period until `stop()`, so
the runs of another studio process sharing the database that dies are taken up too, within
two lease periods. Runs under a fresh lease (another live process executes them) are left
alone. Pending runs are taken up only at the start: they hold no lease, so a sweep cannot
tell one a live process has queued from one a dead process left.

With `max_runs` (`OMNIFLOW_MAX_RUNS`) at most that many runs execute at once; the others wait,
pending, first come first served (the order `queue_position` counts), and a cancelled one leaves
the queue at once. Stopping the service leaves waiting runs pending, for the next start.

`submit(run_id)` and `cancel(run_id)` may be called from any thread (request threads
call them). The loop starts on first use; `stop()` cancels what still runs, closes the
dispatcher and joins both threads, after which the service can start again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import gc
import logging
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from django.db import DatabaseError, close_old_connections
from redis.exceptions import RedisError

from engine.client.runs import Executor, RunStatus, in_process_executor
from engine.spec.kinds import KindRegistry
from engine.spec.ops import OpConfig
from engine.spec.userfiles import UsersRoot
from studio.workflows.runs.bus import RunEventBus
from studio.workflows.runs.execution import ExecutorSource, OwnExecutor, execute_run
from studio.workflows.runs.lease import LeaseKeeper, LeaseTerms, executor_id
from studio.workflows.runs.metrics import RunMetrics
from studio.workflows.runs.recovery import CancelRequest, CancelResult, Swept, request_cancel, sweep_expired
from studio.workflows.runs.store import RunTicket, ThreadedRunStore, pending_runs

log = logging.getLogger(__name__)


class CancelOutcome(enum.StrEnum):
    CANCELLED = "cancelled"
    """The run was stopped (it ends `cancelled`)."""
    FINISHED = "finished"
    """It had already ended; nothing changed."""
    REQUESTED = "requested"
    """It is running in another process, which was asked to cancel it (within a lease tick)."""


CANCEL_OUTCOMES = {CancelRequest.CANCELLED: CancelOutcome.CANCELLED, CancelRequest.REQUESTED: CancelOutcome.REQUESTED,
                   CancelRequest.FINISHED: CancelOutcome.FINISHED}


def _request_cancel(run_id: str) -> CancelResult:
    close_old_connections()
    return request_cancel(run_id)


def _sweep_expired(retries: int) -> list[Swept]:
    close_old_connections()
    return sweep_expired(retries)


class DeploymentHost(ExecutorSource, Protocol):
    """What the service needs of the deployments it hosts (`EmbeddedDeployments`)."""

    async def aclose(self) -> None: ...


class _Executors:
    """Plain runs to the service's own executor, runs of deployments to the deployments."""

    def __init__(self, own: Executor, deployments: DeploymentHost | None) -> None:
        self._own = OwnExecutor(own)
        self._deployments = deployments

    async def executor_for(self, ticket: RunTicket) -> Executor:
        if ticket.deployment_id is None or self._deployments is None:
            return await self._own.executor_for(ticket)
        return await self._deployments.executor_for(ticket)

    async def materialize(self, ticket: RunTicket, outputs: dict[str, Any]) -> dict[str, Any]:
        if ticket.deployment_id is None or self._deployments is None:
            return outputs
        return await self._deployments.materialize(ticket, outputs)


class EngineLoopError(RuntimeError):
    """The engine loop did not start: in time (it is still starting), or at all (the cause chained)."""


@dataclass(slots=True)
class _Starting:
    """One start of the engine loop: `ready` is set once it runs, or once `error` says why not."""

    ready: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


class RunService:
    def __init__(self, kinds: KindRegistry, bus: RunEventBus, metrics: RunMetrics | None = None,
                 *, ops: OpConfig, deployments: DeploymentHost | None = None, start_timeout_s: float = 120.0,
                 lease_s: float = 30.0, lease_retries: int = 1, max_runs: int = 0,
                 users: UsersRoot | None = None) -> None:
        """`ops`: what the python units of runs without a deployment may run; `users`: where they
        write a run's files (`engine.spec.userfiles`: the studio's users root). `max_runs`: how many
        runs execute at once (0: no limit); the others wait, pending, first come first served.
        `lease_retries`: how often a swept run is executed again before it is failed.
        `start_timeout_s`: how long a call waits for the engine loop to start (the loop imports
        torch and the engine: 43 s was seen on two loaded cores)."""
        if max_runs < 0:
            raise ValueError(f"max_runs must be >= 0, not {max_runs}")
        if lease_retries < 0:
            raise ValueError(f"lease_retries must be >= 0, not {lease_retries}")
        self.kinds = kinds
        self.ops = ops
        self.users = users
        self.bus = bus
        self.metrics = metrics or RunMetrics()
        self.deployments = deployments
        self._start_timeout_s = start_timeout_s
        self._lease_s = lease_s
        self._lease_retries = lease_retries
        self._sweeper: asyncio.Task[None] | None = None
        self._keeper: LeaseKeeper | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._starting: _Starting | None = None
        """The start in flight or done (None before it and after `stop`)."""
        self._db: concurrent.futures.ThreadPoolExecutor | None = None
        self._store: ThreadedRunStore | None = None
        self._executor: Executor | None = None
        self._executors: _Executors | None = None
        self._tasks: dict[str, asyncio.Task[RunStatus | None]] = {}
        self._cancels: dict[str, asyncio.Event] = {}
        self._max_runs = max_runs
        self._slots: asyncio.Semaphore | None = None
        self._queued: set[str] = set()
        """Runs waiting for a slot (pending: nothing of theirs started)."""

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._loop is not None

    def start(self) -> None:
        """Start the engine loop (idempotent). Every caller waits for the one start, at most
        `start_timeout_s`: a caller that gives up leaves it starting, never starts a second."""
        with self._lock:
            if self._loop is not None:
                return
            if self._starting is None:
                self._starting = starting = _Starting()
                self._db = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omniflow-db")
                self._store = ThreadedRunStore(self._db, LeaseTerms(executor_id("studio"), self._lease_s))
                self._keeper = LeaseKeeper(self._store, self._store.lease)
                self._thread = threading.Thread(target=self._main, args=(starting,), name="omniflow-engine",
                                                daemon=True)
                self._thread.start()
            starting = self._starting
        if not starting.ready.wait(self._start_timeout_s):
            raise EngineLoopError(f"the engine loop did not start within {self._start_timeout_s:g} s (still starting)")
        if starting.error is not None:
            raise EngineLoopError(f"the engine loop failed to start: {starting.error}") from starting.error

    def _main(self, starting: _Starting) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._executor = in_process_executor(self.kinds, ops=self.ops, users=self.users)  # torch: on this thread
        except Exception as exc:  # the callers waiting in `start` raise it
            log.exception("the engine loop failed to start")
            loop.close()
            with self._lock:
                starting.error = exc
                self._starting = self._thread = None
                if self._db is not None:
                    self._db.shutdown(wait=False)
                self._db = self._store = self._keeper = None
            starting.ready.set()
            return
        # What is loaded by now (Django, torch, the ops' modules) lives as long as the process: out of
        # the collector's full passes, which otherwise walk it (155 ms here) inside some run's latency.
        gc.freeze()
        self._executors = _Executors(self._executor, self.deployments)
        self._slots = asyncio.Semaphore(self._max_runs) if self._max_runs else None  # FIFO: runs start in turn
        self._loop = loop
        starting.ready.set()
        try:
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _shutdown(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        for run_id in self._queued:
            self._tasks[run_id].cancel()  # still pending: the next start (`resume_stale`) takes it up
        for event in self._cancels.values():
            event.set()
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        assert self._executor is not None and self._store is not None and self._keeper is not None
        await self._keeper.aclose()
        await self._executor.aclose()
        if self.deployments is not None:
            await self.deployments.aclose()
        await self._store.close()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel unfinished runs, close the dispatcher and join the threads (after a start in
        flight, which it waits for)."""
        starting = self._starting
        if starting is not None and not starting.ready.wait(self._start_timeout_s):
            raise EngineLoopError("the engine loop is still starting: it cannot be stopped yet")
        with self._lock:
            loop, thread, db = self._loop, self._thread, self._db
            if loop is None or thread is None or db is None:
                return
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
            if thread.is_alive():
                raise RuntimeError("the engine loop did not stop in time")
            db.shutdown(wait=True)
            self._loop = self._thread = self._db = self._store = self._executor = self._executors = None
            self._keeper = self._starting = None
            self._tasks.clear()
            self._cancels.clear()

    # ---------------------------------------------------------------------- calls
    def call(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run `coro` on the engine loop (started if need be); from any thread but the loop's."""
        self.start()
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def submit(self, run_id: str) -> None:
        """Execute the stored pending run `run_id`; returns at once (thread-safe)."""
        self.call(self._start_run(str(run_id)))

    def resume_stale(self) -> list[str]:
        """On a process start: sweep the runs whose lease lapsed (a previous process stopped
        mid-run; see the module docstring), execute the pending ones, and keep sweeping every half
        lease period until `stop()`. Call it once, before this process accepts runs. The ids of
        the runs it swept or took up."""
        self.start()
        assert self._db is not None
        swept = self._db.submit(_sweep_expired, self._lease_retries).result()
        self.call(self._publish_swept(swept, dispatch=False)).result()
        pending = self._db.submit(pending_runs).result()  # the restarted ones among them
        for run_id in pending:
            self.submit(run_id)
        self.call(self._start_sweeping()).result()
        return list(dict.fromkeys([*(one.run_id for one in swept), *pending]))

    async def _start_sweeping(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(), name="omniflow-run-sweep")

    async def _sweep_forever(self) -> None:
        interval = self._lease_s / 2
        log.info("sweeping runs with lapsed leases every %.1f s", interval)
        while True:
            await asyncio.sleep(interval)
            assert self._db is not None
            try:
                swept = await asyncio.get_running_loop().run_in_executor(
                    self._db, _sweep_expired, self._lease_retries)
            except DatabaseError as exc:  # the database away for a moment: the next sweep retries
                log.warning("sweeping runs with lapsed leases failed (next try in %.1f s): %s", interval, exc)
                continue
            await self._publish_swept(swept, dispatch=True)

    async def _publish_swept(self, swept: list[Swept], *, dispatch: bool) -> None:
        """Publish what the sweep stored; with `dispatch`, execute the restarted runs here."""
        for one in swept:
            try:
                await self.bus.publish(one.run_id, one.events)
            except (RedisError, OSError) as exc:  # stored all the same: followers read them back from the log
                log.warning("run %s: publishing what the run sweep stored failed: %s", one.run_id, exc)
            if dispatch and one.restarted:
                await self._start_run(one.run_id)

    async def _start_run(self, run_id: str) -> None:
        if run_id in self._tasks:
            return
        assert self._executors is not None and self._store is not None
        cancel = self._cancels[run_id] = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self._execute(run_id, cancel), name=f"omniflow-run-{run_id}")
        self._tasks[run_id] = task
        task.add_done_callback(lambda t: self._finished(run_id, t))

    async def _execute(self, run_id: str, cancel: asyncio.Event) -> RunStatus | None:
        assert self._executors is not None and self._store is not None
        if self._slots is not None:
            self._queued.add(run_id)
            try:
                await self._slots.acquire()
            finally:
                self._queued.discard(run_id)
        try:
            return await execute_run(run_id, executors=self._executors, store=self._store, bus=self.bus,
                                     metrics=self.metrics, cancel=cancel, keeper=self._keeper)
        finally:
            if self._slots is not None:
                self._slots.release()

    def _finished(self, run_id: str, task: asyncio.Task[RunStatus | None]) -> None:
        self._tasks.pop(run_id, None)
        self._cancels.pop(run_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("run %s failed in the studio", run_id, exc_info=task.exception())

    def cancel(self, run_id: str, timeout_s: float = 30.0) -> CancelOutcome:
        """Stop a run of this process and wait until it has ended, or cancel one no process
        executes, or ask the process executing it to (thread-safe)."""
        return self.call(self._cancel(str(run_id))).result(timeout_s)

    async def _cancel(self, run_id: str) -> CancelOutcome:
        assert self._db is not None
        task = self._tasks.get(run_id)
        if task is not None and run_id in self._queued:
            # Waiting for a slot, nothing of it started: it leaves the queue, and ends as any pending run.
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            task = None
        if task is not None:
            self._cancels[run_id].set()
            status = await asyncio.shield(task)
            return CancelOutcome.CANCELLED if status == RunStatus.CANCELLED else CancelOutcome.FINISHED
        result = await asyncio.get_running_loop().run_in_executor(self._db, _request_cancel, run_id)
        if result.events:
            await self.bus.publish(run_id, result.events)
        return CANCEL_OUTCOMES[result.outcome]

    def wait(self, run_id: str, timeout_s: float = 30.0) -> RunStatus | None:
        """Block until the run (if it executes here) has ended; for tests and commands."""
        return self.call(self._wait(str(run_id))).result(timeout_s)

    async def _wait(self, run_id: str) -> RunStatus | None:
        task = self._tasks.get(run_id)
        return None if task is None else await asyncio.shield(task)
