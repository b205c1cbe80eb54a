"""The executor: runs plans on asyncio, many runs at once.

Each run is a `Run`: a small state machine per node (`pending -> queued -> running ->
done | failed | skipped | cancelled`) driven by deliveries along edges. All state is
touched only from the event loop, so there are no locks. Node work goes through a
`Dispatcher`; the executor itself only runs `input` and `output` nodes. When a node fires
(trigger groups, joins, cycles) is `engine.flow.firing`'s to decide; a run acts on it:
it dispatches the node (with its timeout and retries), records its events, and hands its
outputs on along the edges (stream edges as `StreamChannel`s).

A dispatched node runs in a task: the first node a completion launches goes on in the
completing node's task when that node let the event loop turn (it waited on a worker or a
thread), else in a task of its own, so every node starts in a turn of the loop of its own.
A finished run holds no reference cycle: dropped (`Executor.forget`), it is freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.flow.attempt import AttemptFailed, attempt, node_call
from engine.flow.deliveries import Deliveries
from engine.flow.dispatch import Dispatcher
from engine.flow.events import (
    HeldBlob,
    NodeState,
    RunEvent,
    RunStatus,
)
from engine.flow.firing import Firing, NodeFailure, RunActions, RunNode, gather_inputs
from engine.flow.plan import Plan, build_plan
from engine.flow.recorder import RunRecorder
from engine.flow.streams import StreamChannel
from engine.flow.validate import input_type_problem
from engine.spec.calls import NodeContext, NodeResult, RanOn
from engine.spec.graph import GraphSpec, NodeSpec
from engine.spec.kinds import KindRegistry


class RunInputError(ValueError):
    """Run inputs do not match the workflow's `input` nodes."""


@dataclass(slots=True)
class NodeSummary:
    state: NodeState
    attempts: int
    iterations: int
    started_ms: float | None
    duration_ms: float | None
    error: str | None

    @classmethod
    def of(cls, node: RunNode, t0: float) -> NodeSummary:
        """`node`'s summary, its times from `t0` (the run's start, `time.perf_counter()`)."""
        return cls(
            state=node.state,
            attempts=node.attempt,
            iterations=node.fired,
            started_ms=None if node.first_started is None else (node.first_started - t0) * 1e3,
            duration_ms=None if node.first_started is None else node.busy_s * 1e3,
            error=node.error,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": str(self.state),
            "attempts": self.attempts,
            "iterations": self.iterations,
            "started_ms": self.started_ms,
            "duration_ms": self.duration_ms,
            "error": self.error,
        }


@dataclass(slots=True)
class RunResult:
    run_id: str
    workflow: str
    status: RunStatus
    outputs: dict[str, Any]
    error: str | None
    failed_node: str | None
    duration_ms: float
    nodes: dict[str, NodeSummary]

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "workflow": self.workflow,
            "status": str(self.status),
            "outputs": self.outputs,
            "error": self.error,
            "failed_node": self.failed_node,
            "duration_ms": self.duration_ms,
            "nodes": {k: v.to_dict() for k, v in self.nodes.items()},
        }


class HandOn:
    """Which node a completing node's task runs next (`Run._execute`): the first node its completion
    launches, sparing a task and a turn of the loop before that node's dispatch. Only a node that let
    the loop turn while it ran hands on, so each node starts in a turn of its own and a chain of nodes
    that never wait takes turns with the other runs node by node, as in tasks of their own."""

    def __init__(self) -> None:
        self._open = False
        self._next: tuple[RunNode, dict[str, Any]] | None = None
        self._turns = 0
        """Turns of the event loop seen (`watch`): did a node let the loop turn while it ran?"""

    def watch(self) -> int:
        """Before a node's attempt: the turn count to give `open` after it."""
        asyncio.get_running_loop().call_soon(self._tick)  # runs before the node's task resumes, if it waits
        return self._turns

    def _tick(self) -> None:
        self._turns += 1

    def open(self, turns: int) -> None:
        """A node's task completes its node (which started at `turns`): hand on if it let the loop turn."""
        self._open = self._turns != turns

    def take(self, node: RunNode, inputs: dict[str, Any]) -> bool:
        """Whether launched `node` is the completing task's to run next (then it is kept here)."""
        if self._open and self._next is None:
            self._next = (node, inputs)
            return True
        return False

    def close(self) -> tuple[RunNode, dict[str, Any]] | None:
        """The completion is over: the node handed on, if any."""
        self._open = False
        handed, self._next = self._next, None
        return handed


class Run:
    """One execution of a plan. Created by `Executor.submit`; read its events with
    `events()`, wait for the result with `wait()`, stop it with `cancel()`."""

    def __init__(
        self,
        plan: Plan,
        inputs: dict[str, Any],
        dispatcher: Dispatcher,
        *,
        run_id: str,
        timeout_s: float | None,
        stream_capacity: int = 0,
        tenant: str | None = None,
        owner: str | None = None,
        keep_blobs: int = 0,
    ) -> None:
        self.id = run_id
        self._record = RunRecorder(run_id, plan, keep_blobs=keep_blobs)
        self.tenant = tenant
        """Whose run this is (`NodeCall.tenant`); None: the nodes' `tenant` params, if any."""
        self.owner = owner
        """Whose folder its output folder names are in (`NodeCall.owner`); None: no owner."""
        self.plan = plan
        self.inputs = inputs
        self.timeout_s = timeout_s
        self.status = RunStatus.PENDING
        self.outputs: dict[str, Any] = {}
        self.error: str | None = None
        self.failed_node: str | None = None
        self.log = self._record.log
        self._dispatcher = dispatcher
        self._nodes = {
            nid: RunNode(
                spec=plan.nodes[nid],
                cyclic=plan.topo.is_cyclic(nid),
                component=plan.topo.component_of[nid],
            )
            for nid in plan.order
        }
        self._active = 0
        self._deliveries = Deliveries(plan, self._nodes, stream_capacity)
        self._finished: asyncio.Future[tuple[RunStatus, str | None, str | None]] = (
            asyncio.get_running_loop().create_future())
        self._firing = Firing(plan, self._nodes, RunActions(
            fire=self._fire, skip=self._skip, mark_skipped=self._mark_skipped, ended=self._finished.done))
        self._t0 = time.perf_counter()
        self._supervisor: asyncio.Task[None] | None = None
        self._result: RunResult | None = None
        self._hand_on = HandOn()

    # ----------------------------------------------------------------- public
    def events(self, since: int = 0) -> AsyncIterator[RunEvent]:
        """Events from seq `since` on (those already emitted first), ending with run_finished."""
        return self.log.follow(since)

    async def wait(self) -> RunResult:
        if self._supervisor is not None:
            await asyncio.shield(self._supervisor)
        assert self._result is not None
        return self._result

    @property
    def done(self) -> bool:
        return self._result is not None

    async def cancel(self) -> None:
        """Stop the run: running nodes are cancelled (their units see the cancellation)."""
        if self._result is None and not self._finished.done():
            self._finished.set_result((RunStatus.CANCELLED, "cancelled by request", None))
        await self.wait()

    def take_blobs(self, seq: int) -> list[HeldBlob]:
        """The byte blobs a `node_output` event (by its seq) only previews (the value, or the
        blobs in its lists and dicts, each with its place), once; else none. Kept only for runs
        submitted with `keep_blobs` (a server showing every node's images and audio), until taken."""
        return self._record.take_blobs(seq)

    def node_state(self, node_id: str) -> NodeState:
        return self._nodes[node_id].state

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name=f"run-{self.id}")

    async def _supervise(self) -> None:
        self.status = RunStatus.RUNNING
        self._record.started()
        for nid in self.plan.order:
            if not self.plan.topo.preds[nid]:
                self._fire(self._nodes[nid])
        self._check_quiet()
        if self.timeout_s is None:  # no deadline: spare the timeout scope
            status, error, failed_node = await self._finished
        else:
            try:
                async with asyncio.timeout(self.timeout_s):
                    status, error, failed_node = await self._finished
            except TimeoutError:
                status, error, failed_node = RunStatus.FAILED, f"run timed out after {self.timeout_s} s", None
        await self._finish(status, error, failed_node)

    async def _finish(self, status: RunStatus, error: str | None, failed_node: str | None) -> None:
        tasks = [n.task for n in self._nodes.values() if n.task is not None and not n.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        now = time.perf_counter()
        for node in self._nodes.values():
            node.task = None  # done: a cancelled one holds its error, whose frames hold this run
            if node.state in (NodeState.QUEUED, NodeState.RUNNING):
                node.stop_clock(now)
                self._set_state(node, NodeState.CANCELLED)
            elif node.state == NodeState.PENDING and status != RunStatus.DONE:
                self._set_state(node, NodeState.CANCELLED)
            for channel in node.stream_channels.values():
                channel.close()
        self.status = status
        self.error = error
        self.failed_node = failed_node
        duration_ms = (now - self._t0) * 1e3
        self._record.finished(status, self.outputs, error, failed_node, duration_ms)
        self._result = RunResult(self.id, self.plan.name, status, dict(self.outputs), error, failed_node, duration_ms,
                                 {nid: NodeSummary.of(n, self._t0) for nid, n in self._nodes.items()})
        self._firing.end()

    def _fail(self, node: RunNode, message: str) -> None:
        node.error = message
        self._set_state(node, NodeState.FAILED)
        if not self._finished.done():
            self._finished.set_result((RunStatus.FAILED, f"node {node.spec.id!r} failed: {message}", node.spec.id))

    # --------------------------------------------------------------- events
    def _set_state(self, node: RunNode, state: NodeState, where: RanOn | None = None) -> None:
        self._record.state(node, state, where)

    def _progress(self, node_id: str, fraction: float | None, message: str) -> None:
        if self._result is None:
            self._record.progress(node_id, fraction, message)

    # --------------------------------------------------------------- firing
    def _mark_skipped(self, node: RunNode, reason: str) -> None:
        node.error = reason
        self._set_state(node, NodeState.SKIPPED)

    def _skip(self, node: RunNode, reason: str) -> None:
        node.drop_unread(())
        node.error = reason
        self._set_state(node, NodeState.SKIPPED)
        for edge in self.plan.out_edges[node.spec.id]:
            channel = node.stream_channels.get(edge.index)
            if channel is not None:
                channel.close()
        self._firing.after_settle(node)

    def _fire(self, node: RunNode, group: frozenset[str] | None = None) -> None:
        if self._finished.done():
            return
        spec = node.spec
        if spec.max_iterations is not None and node.fired >= spec.max_iterations:
            self._fail(node, f"reached max_iterations={spec.max_iterations} without leaving its loop")
            return
        try:
            inputs = gather_inputs(self.plan, node, group)
        except NodeFailure as exc:
            self._fail(node, str(exc))
            return
        node.drop_unread(() if isinstance(inputs, str) else inputs.values())
        node.inbox = {}
        node.delivered = set()
        if isinstance(inputs, str):
            if node.fired == 0:
                self._skip(node, inputs)
            return
        node.fired += 1
        node.attempt = 0
        if spec.kind not in ("input", "output"):
            self._launch(node, inputs)
            return
        now = time.perf_counter()  # an input or output node is done as it fires, in the executor
        node.first_started = node.first_started or now
        if spec.kind == "input":
            self._complete(node, NodeResult(outputs={"value": self.inputs[spec.id]}), now)
            return
        value = self.outputs[spec.id] = _output_value(spec, inputs.get("value"))
        self._complete(node, NodeResult(outputs={}), now, output_value=value)

    def _launch(self, node: RunNode, inputs: dict[str, Any]) -> None:
        node.attempt += 1
        self._active += 1
        self._set_state(node, NodeState.QUEUED)
        if self._hand_on.take(node, inputs):
            node.task = asyncio.current_task()
            return
        node.task = asyncio.get_running_loop().create_task(self._execute(node, inputs))

    def _started(self, node: RunNode, inputs: dict[str, Any], where: RanOn) -> None:
        # Its stream inputs bound their producers only now that it runs: queued for a slot,
        # it might wait for one its own producer holds.
        for value in inputs.values():
            if isinstance(value, StreamChannel):
                value.attach()
        node.started = time.perf_counter()
        if node.first_started is None:
            node.first_started = node.started
        self._set_state(node, NodeState.RUNNING, where=where)

    async def _execute(self, node: RunNode, inputs: dict[str, Any]) -> None:
        """A node's task: runs `node`, then each node its completion handed on to it (`_launch`)."""
        next_up: tuple[RunNode, dict[str, Any]] | None = (node, inputs)
        while next_up is not None:
            next_up = await self._execute_node(*next_up)

    async def _execute_node(self, node: RunNode, inputs: dict[str, Any]) -> tuple[RunNode, dict[str, Any]] | None:
        """Run one attempt of `node`; the node its completion launched into this task, if any."""
        spec = node.spec
        role = self.plan.roles[spec.role] if spec.role is not None else None
        assert role is not None, "validated: dispatched nodes have a role"
        call = node_call(self.id, self.tenant, spec, inputs, iteration=node.fired, attempt=node.attempt,
                         owner=self.owner)
        ctx = NodeContext(run_id=self.id, node_id=spec.id, iteration=node.fired, attempt=node.attempt,
                          report_progress=lambda f, m: self._progress(spec.id, f, m))
        turns = self._hand_on.watch()
        try:
            outcome = await attempt(self._dispatcher, role, call, ctx, timeout_s=spec.timeout_s,
                                    started=functools.partial(self._started, node, inputs),
                                    on_frame=functools.partial(self._on_frame, node))
        finally:
            for value in inputs.values():
                if isinstance(value, StreamChannel):
                    value.detach()  # the frames it left unread must not hold their producer back
        if isinstance(outcome, AttemptFailed):
            self._attempt_failed(node, inputs, outcome.message, final=outcome.final)
            return None
        node.task = None
        self._active -= 1
        if self._finished.done():
            return None
        self._hand_on.open(turns)
        completed = False
        try:
            self._complete(node, outcome, time.perf_counter())
            self._check_quiet()
            completed = True
        finally:
            next_up = self._hand_on.close()
            if not completed and next_up is not None:
                # This task ends with the error: the node it was handed runs in a task of its own.
                next_up[0].task = asyncio.get_running_loop().create_task(self._execute(*next_up))
        return next_up

    def _attempt_failed(self, node: RunNode, inputs: dict[str, Any], message: str, final: bool = False) -> None:
        node.task = None
        node.stop_clock(time.perf_counter())
        self._active -= 1
        has_streams = bool(node.stream_channels) or any(isinstance(v, StreamChannel) for v in inputs.values())
        if not final and node.attempt <= node.spec.retries and not has_streams and not self._finished.done():
            node.error = message
            self._set_state(node, NodeState.FAILED)
            self._launch(node, inputs)
            return
        self._fail(node, message)

    async def _on_frame(self, node: RunNode, index: int, frame: dict[str, Any]) -> None:
        self._record.frame(node, index, frame)
        for target in await self._deliveries.frame(node, index, frame):
            self._firing.evaluate(self._nodes[target])

    def _complete(self, node: RunNode, result: NodeResult, now: float, output_value: Any = None) -> None:
        spec = node.spec
        node.stop_clock(now)
        if result.route is not None:
            allowed = spec.routes or []
            wrong = [t for t in result.route if t not in allowed]
            if wrong:
                self._fail(node, f"chose {wrong}, which are not among its routes {allowed}")
                return
        node.error = None
        self._set_state(node, NodeState.DONE)
        if spec.kind == "output":
            self._record.outputs(node, {"value": output_value})
        elif not spec.stream:
            self._record.outputs(node, result.outputs)
        for target in self._deliveries.result(node, result.outputs, result.route):
            self._firing.evaluate(self._nodes[target])
        self._firing.after_settle(node)
        # A cyclic node may have received deliveries for its next activation while it ran.
        if node.cyclic and node.delivered:
            self._firing.evaluate(node)

    def _check_quiet(self) -> None:
        """When nothing is queued or running, resolve what is left and finish the run."""
        if self._active or self._finished.done():
            return
        if self._firing.resolve_quiet(lambda: self._active > 0) and not self._finished.done():
            self._finished.set_result((RunStatus.DONE, None, None))


class Executor:
    """Runs plans; owns no compute itself (see `Dispatcher`).

    `submit` validates inputs and starts the run at once; many runs proceed
    concurrently on the same event loop. A stream edge holds at most `stream_capacity` frames
    its reader has not taken (0: no limit); its producer waits for room (`StreamChannel`).
    """

    DEFAULT_STREAM_CAPACITY = 64

    def __init__(self, dispatcher: Dispatcher, kinds: KindRegistry, *,
                 stream_capacity: int = DEFAULT_STREAM_CAPACITY) -> None:
        if stream_capacity < 0:
            raise ValueError(f"stream_capacity must be 0 (no limit) or more, not {stream_capacity}")
        self._dispatcher = dispatcher
        self._kinds = kinds
        self._stream_capacity = stream_capacity
        self._runs: dict[str, Run] = {}
        self._ids = itertools.count()

    def plan(self, spec: GraphSpec) -> Plan:
        return build_plan(spec, self._kinds)

    async def submit(
        self,
        workflow: Plan | GraphSpec,
        inputs: dict[str, Any] | None = None,
        *,
        run_id: str | None = None,
        timeout_s: float | None = None,
        tenant: str | None = None,
        owner: str | None = None,
        keep_blobs: int = 0,
    ) -> Run:
        """Start a run of `workflow`. `tenant`: whose run it is (a server's user, or a sharing
        scope); every cache its nodes touch is namespaced by it, whatever the nodes' params say.
        None (the command line): a node's `tenant` param, if it has one. `owner`: whose folder the
        nodes' output folder names are relative to (`engine.spec.userfiles`; None: the command
        line's, names as they are). `keep_blobs`: keep up to
        this many of the byte blobs nodes produce (outputs and streamed frames) for `Run.take_blobs`."""
        plan = workflow if isinstance(workflow, Plan) else self.plan(workflow)
        values = resolve_inputs(plan, inputs or {})
        rid = run_id or os.urandom(6).hex()  # as random as uuid4's first 12 hex digits, without the UUID
        if rid in self._runs:
            raise ValueError(f"run id {rid!r} is already in use")
        run = Run(plan, values, self._dispatcher, run_id=rid, timeout_s=timeout_s,
                  stream_capacity=self._stream_capacity, tenant=tenant, owner=owner, keep_blobs=keep_blobs)
        self._runs[rid] = run
        run.start()
        return run

    def get(self, run_id: str) -> Run:
        return self._runs[run_id]

    def forget(self, run_id: str) -> None:
        """Drop a finished run from memory."""
        run = self._runs.get(run_id)
        if run is not None and run.done:
            del self._runs[run_id]

    async def cancel(self, run_id: str) -> None:
        await self._runs[run_id].cancel()

    async def aclose(self) -> None:
        """Cancel every unfinished run and close the dispatcher."""
        for run in list(self._runs.values()):
            if not run.done:
                with contextlib.suppress(asyncio.CancelledError):
                    await run.cancel()
        await self._dispatcher.close()


def _output_value(spec: NodeSpec, value: Any) -> Any:
    """What an output node gives the run: a `text` output that gathered a stream's text frames
    (a joining port) is their text, joined as a stream-mode reader joins them, not a list of
    deltas (a chat reply reads as text)."""
    port = spec.inputs.get("value")
    if (port is not None and port.type == "text" and port.join in ("ordered", "dynamic") and isinstance(value, list)
            and all(isinstance(v, str) for v in value)):
        return "".join(value)
    return value


def resolve_inputs(plan: Plan, given: dict[str, Any]) -> dict[str, Any]:
    """Run inputs by input node id, defaults filled in; every problem reported at once."""
    problems = []
    unknown = sorted(set(given) - set(plan.input_nodes))
    if unknown:
        problems.append(f"unknown input{'s' if len(unknown) > 1 else ''} {unknown}"
                        f" (the workflow takes {list(plan.input_nodes) or 'none'})")
    values: dict[str, Any] = {}
    for nid in plan.input_nodes:
        node = plan.nodes[nid]
        if nid in given:
            values[nid] = given[nid]
        elif "default" in node.params:
            values[nid] = node.params["default"]
        else:
            problems.append(f"input {nid!r} has no value and no default")
    problems.extend(problem for nid, value in values.items()
                    if value is not None and (problem := input_type_problem(plan.nodes[nid], value)))
    if problems:
        raise RunInputError("; ".join(problems))
    return values
