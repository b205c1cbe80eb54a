"""The executor: runs plans on asyncio, many runs at once.

Each run is a `Run`: a small state machine per node (`pending -> queued -> running ->
done | failed | skipped | cancelled`) driven by deliveries along edges. All state is
touched only from the event loop, so there are no locks. Node work goes through a
`Dispatcher`; the executor itself only runs `input` and `output` nodes.

Firing rule. A node fires when one of its trigger groups is satisfied: every member
has delivered in this activation or is *settled* (can never deliver again), and at
least one delivered. A node that never fired is skipped once all its groups are dead
(every member settled without delivering). A predecessor outside any cycle is settled
when it reaches a terminal state; one inside a cycle is settled when its whole cycle
is quiet (nothing in it queued or running, nothing outside feeding it still active,
and no member able to fire).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.flow.dispatch import Dispatcher
from engine.flow.events import (
    EventLog,
    NodeOutputEvent,
    NodeProgressEvent,
    NodeState,
    NodeStateEvent,
    RunEvent,
    RunFinished,
    RunStarted,
    RunStatus,
    is_blob,
    preview,
)
from engine.flow.plan import Plan, build_plan
from engine.flow.streams import StreamChannel, StreamGroup
from engine.spec.calls import FinalNodeError, NodeCall, NodeContext, NodeResult, RanOn, node_tenant
from engine.spec.graph import GraphSpec, NodeSpec
from engine.spec.kinds import KindRegistry


class RunInputError(ValueError):
    """Run inputs do not match the workflow's `input` nodes."""


class NodeFailure(RuntimeError):
    """Raised into a run's result: which node failed and why."""


@dataclass(slots=True)
class NodeSummary:
    state: NodeState
    attempts: int
    iterations: int
    started_ms: float | None
    duration_ms: float | None
    error: str | None

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


@dataclass(slots=True)
class _Node:
    spec: NodeSpec
    cyclic: bool
    component: int
    state: NodeState = NodeState.PENDING
    fired: int = 0
    attempt: int = 0
    delivered: set[str] = field(default_factory=set)
    inbox: dict[str, list[tuple[int, int, int, Any]]] = field(default_factory=dict)
    """Per port: (edge index, frame seq, arrival number, value)."""
    task: asyncio.Task[None] | None = None
    started: float | None = None
    first_started: float | None = None
    busy_s: float = 0.0
    error: str | None = None
    stream_buffers: dict[int, list[tuple[int, Any]]] = field(default_factory=dict)
    stream_channels: dict[int, StreamChannel] = field(default_factory=dict)
    """The channels of its outgoing stream edges, by edge index."""
    reads: StreamGroup = field(default_factory=StreamGroup)
    """The channels of its incoming stream edges."""


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
        keep_blobs: bool = False,
    ) -> None:
        self.id = run_id
        self._keep_blobs = keep_blobs
        self._blobs: dict[int, Any] = {}
        self.tenant = tenant
        """Whose run this is (`NodeCall.tenant`); None: the nodes' `tenant` params, if any."""
        self._stream_capacity = stream_capacity
        self.plan = plan
        self.inputs = inputs
        self.timeout_s = timeout_s
        self.status = RunStatus.PENDING
        self.outputs: dict[str, Any] = {}
        self.error: str | None = None
        self.failed_node: str | None = None
        self.log = EventLog()
        self._dispatcher = dispatcher
        self._nodes = {
            nid: _Node(
                spec=plan.nodes[nid],
                cyclic=plan.topo.is_cyclic(nid),
                component=plan.topo.component_of[nid],
            )
            for nid in plan.order
        }
        self._active = 0
        self._arrivals = itertools.count()
        self._settled_components: set[int] = set()
        self._assume_settled: int | None = None
        self._finished = asyncio.get_running_loop().create_future()
        self._t0 = time.perf_counter()
        self._wall0 = time.time()
        self._supervisor: asyncio.Task[None] | None = None
        self._result: RunResult | None = None

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

    def _previewed(self, spec: NodeSpec, port: str) -> bool:
        """Whether a blob on `port` is kept for `take_blob`: not an input's (an upload), nor one
        that only output nodes take (it becomes the run's output: stored once, as that)."""
        if spec.kind == "input":
            return False
        targets = [e.spec.target for e in self.plan.out_edges[spec.id] if e.spec.source_port == port]
        return not targets or any(self.plan.nodes[t].kind != "output" for t in targets)

    def take_blob(self, seq: int) -> Any:
        """The byte blob a `node_output` event (by its seq) only previews, once, or None. Kept
        only for runs submitted with `keep_blobs` (a server showing every node's images and
        audio), until taken."""
        return self._blobs.pop(seq, None)

    def node_state(self, node_id: str) -> NodeState:
        return self._nodes[node_id].state

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name=f"run-{self.id}")

    async def _supervise(self) -> None:
        self.status = RunStatus.RUNNING
        self._emit(RunStarted(seq=self.log.next_seq, run_id=self.id, time=time.time(),
                              workflow=self.plan.name, nodes=list(self.plan.order)))
        for nid in self.plan.order:
            if not self.plan.topo.preds[nid]:
                self._fire(self._nodes[nid])
        self._check_quiet()
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
            if node.state in (NodeState.QUEUED, NodeState.RUNNING):
                if node.started is not None:
                    node.busy_s += now - node.started
                self._set_state(node, NodeState.CANCELLED)
            elif node.state == NodeState.PENDING and status != RunStatus.DONE:
                self._set_state(node, NodeState.CANCELLED)
            for channel in node.stream_channels.values():
                channel.close()
        self.status = status
        self.error = error
        self.failed_node = failed_node
        duration_ms = (now - self._t0) * 1e3
        self._emit(RunFinished(seq=self.log.next_seq, run_id=self.id, time=time.time(), status=status,
                               outputs={k: preview(v) for k, v in self.outputs.items()}, error=error,
                               failed_node=failed_node, duration_ms=duration_ms))
        self._result = RunResult(
            run_id=self.id,
            workflow=self.plan.name,
            status=status,
            outputs=dict(self.outputs),
            error=error,
            failed_node=failed_node,
            duration_ms=duration_ms,
            nodes={nid: self._summary(n) for nid, n in self._nodes.items()},
        )

    def _summary(self, node: _Node) -> NodeSummary:
        return NodeSummary(
            state=node.state,
            attempts=node.attempt,
            iterations=node.fired,
            started_ms=None if node.first_started is None else (node.first_started - self._t0) * 1e3,
            duration_ms=None if node.first_started is None else node.busy_s * 1e3,
            error=node.error,
        )

    def _fail(self, node: _Node, message: str) -> None:
        node.error = message
        self._set_state(node, NodeState.FAILED)
        if not self._finished.done():
            self._finished.set_result((RunStatus.FAILED, f"node {node.spec.id!r} failed: {message}", node.spec.id))

    # --------------------------------------------------------------- events
    def _emit(self, event: RunEvent) -> None:
        self.log.append(event)

    def _set_state(self, node: _Node, state: NodeState, duration_ms: float | None = None,
                   where: RanOn | None = None) -> None:
        node.state = state
        self._emit(NodeStateEvent(seq=self.log.next_seq, run_id=self.id, time=time.time(), node=node.spec.id,
                                  state=state, attempt=node.attempt, iteration=node.fired,
                                  error=node.error if state in (NodeState.FAILED, NodeState.SKIPPED) else None,
                                  duration_ms=duration_ms, worker=None if where is None else where.worker,
                                  host=None if where is None else where.host))

    def _progress(self, node_id: str, fraction: float | None, message: str) -> None:
        if self._result is None:
            self._emit(NodeProgressEvent(seq=self.log.next_seq, run_id=self.id, time=time.time(), node=node_id,
                                         progress=fraction, message=message))

    # --------------------------------------------------------------- firing
    def _settled(self, pred: str) -> bool:
        node = self._nodes[pred]
        if not node.cyclic:
            return node.state.terminal
        return node.component in self._settled_components or node.component == self._assume_settled

    def _evaluate(self, node: _Node) -> bool:
        """Fire or skip `node` if its triggers allow; True when it fired."""
        if node.state in (NodeState.QUEUED, NodeState.RUNNING, NodeState.FAILED, NodeState.CANCELLED,
                          NodeState.SKIPPED):
            return False
        if node.state == NodeState.DONE and not node.cyclic:
            return False
        delivered = node.delivered
        all_dead = True
        for group in self.plan.triggers[node.spec.id]:
            hit = False
            complete = True
            for member in group:
                if member in delivered:
                    hit = True
                elif not self._settled(member):
                    complete = False
                    break
            if complete and hit:
                self._fire(node, group)
                return True
            if not complete or hit:
                all_dead = False
        if all_dead and node.fired == 0 and self._finished_ok():
            self._skip(node, "no trigger group can be satisfied")
        return False

    def _finished_ok(self) -> bool:
        return not self._finished.done()

    def _drop_unread(self, node: _Node, kept: Iterable[Any]) -> None:
        """Detach the stream channels in `node`'s inbox that this firing does not hand on:
        nobody will read them, and their producers must not wait for it."""
        if not node.reads.channels:  # no stream was delivered to it (the common case: nothing to scan)
            return
        keep = {id(value) for value in kept}
        for arrivals in node.inbox.values():
            for arrival in arrivals:
                value = arrival[3]
                if isinstance(value, StreamChannel) and id(value) not in keep:
                    value.detach()

    def _skip(self, node: _Node, reason: str) -> None:
        self._drop_unread(node, ())
        node.error = reason
        self._set_state(node, NodeState.SKIPPED)
        for edge in self.plan.out_edges[node.spec.id]:
            channel = node.stream_channels.get(edge.index)
            if channel is not None:
                channel.close()
        self._after_settle(node)

    def _gather_inputs(self, node: _Node, group: frozenset[str] | None) -> dict[str, Any] | str:
        """Input values for a firing on trigger `group` (None: roots), or a reason to
        skip the node. Values delivered by predecessors outside the group are dropped."""
        values: dict[str, Any] = {}
        edges = self.plan.spec.edges
        for port, pspec in node.spec.inputs.items():
            arrivals = node.inbox.get(port, [])
            if group is not None:
                arrivals = [a for a in arrivals if edges[a[0]].source in group]
            if pspec.join is None:
                if not arrivals:
                    if pspec.optional:
                        continue
                    return f"input port {port!r} received nothing"
                if len(arrivals) > 1:
                    sources = ", ".join(edges[a[0]].source for a in arrivals)
                    raise NodeFailure(f"input port {port!r} received {len(arrivals)} values (from {sources});"
                                      " declare a join on it")
                values[port] = arrivals[0][3]
            elif pspec.join == "all":
                values[port] = [a[3] for a in sorted(arrivals, key=lambda a: a[0])]
            elif pspec.join == "ordered":
                values[port] = [a[3] for a in sorted(arrivals, key=lambda a: (a[0], a[1]))]
            else:
                values[port] = [a[3] for a in sorted(arrivals, key=lambda a: a[2])]
        return values

    def _fire(self, node: _Node, group: frozenset[str] | None = None) -> None:
        if self._finished.done():
            return
        spec = node.spec
        if spec.max_iterations is not None and node.fired >= spec.max_iterations:
            self._fail(node, f"reached max_iterations={spec.max_iterations} without leaving its loop")
            return
        try:
            inputs = self._gather_inputs(node, group)
        except NodeFailure as exc:
            self._fail(node, str(exc))
            return
        self._drop_unread(node, () if isinstance(inputs, str) else inputs.values())
        node.inbox = {}
        node.delivered = set()
        if isinstance(inputs, str):
            if node.fired == 0:
                self._skip(node, inputs)
            return
        node.fired += 1
        node.attempt = 0
        kind = spec.kind
        if kind == "input":
            now = time.perf_counter()
            node.first_started = node.first_started or now
            self._complete(node, NodeResult(outputs={"value": self.inputs[spec.id]}), now)
            return
        if kind == "output":
            now = time.perf_counter()
            node.first_started = node.first_started or now
            value = _output_value(spec, inputs.get("value"))
            self.outputs[spec.id] = value
            self._complete(node, NodeResult(outputs={}), now, output_value=value)
            return
        self._launch(node, inputs)

    def _launch(self, node: _Node, inputs: dict[str, Any]) -> None:
        node.attempt += 1
        self._active += 1
        self._set_state(node, NodeState.QUEUED)
        node.task = asyncio.get_running_loop().create_task(self._execute(node, inputs))

    def _started(self, node: _Node, inputs: dict[str, Any], where: RanOn) -> None:
        # Its stream inputs bound their producers only now that it runs: queued for a slot,
        # it might wait for one its own producer holds.
        for value in inputs.values():
            if isinstance(value, StreamChannel):
                value.attach()
        node.started = time.perf_counter()
        if node.first_started is None:
            node.first_started = node.started
        self._set_state(node, NodeState.RUNNING, where=where)

    async def _execute(self, node: _Node, inputs: dict[str, Any]) -> None:
        spec = node.spec
        role = self.plan.roles[spec.role] if spec.role is not None else None
        assert role is not None, "validated: dispatched nodes have a role"
        call = NodeCall(
            run_id=self.id,
            node_id=spec.id,
            op=spec.op,
            params=spec.params,
            inputs=inputs,
            output_ports=tuple(spec.outputs),
            stream=spec.stream,
            router=spec.routes is not None,
            iteration=node.fired,
            attempt=node.attempt,
            tenant=node_tenant(self.tenant, spec.params),
        )
        ctx = NodeContext(run_id=self.id, node_id=spec.id, iteration=node.fired, attempt=node.attempt,
                          report_progress=lambda f, m: self._progress(spec.id, f, m))
        started = functools.partial(self._started, node, inputs)
        try:
            async with asyncio.timeout(spec.timeout_s):
                if spec.stream:
                    frames = 0
                    async for frame in self._dispatcher.execute_stream(role, call, ctx, started):
                        await self._on_frame(node, frames, frame)
                        frames += 1
                    result = NodeResult(outputs={})
                else:
                    result = await self._dispatcher.execute(role, call, ctx, started)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            self._attempt_failed(node, inputs, "CancelledError raised by the node itself")
            return
        except TimeoutError:
            self._attempt_failed(node, inputs, f"timed out after {spec.timeout_s} s")
            return
        except Exception as exc:  # noqa: BLE001 - a node's exception is its failure, reported in the run
            self._attempt_failed(node, inputs, f"{type(exc).__name__}: {exc}", final=isinstance(exc, FinalNodeError))
            return
        finally:
            for value in inputs.values():
                if isinstance(value, StreamChannel):
                    value.detach()  # the frames it left unread must not hold their producer back
        node.task = None
        self._active -= 1
        if self._finished.done():
            return
        self._complete(node, result, time.perf_counter())
        self._check_quiet()

    def _attempt_failed(self, node: _Node, inputs: dict[str, Any], message: str, final: bool = False) -> None:
        node.task = None
        if node.started is not None:
            node.busy_s += time.perf_counter() - node.started
            node.started = None
        has_streams = bool(node.stream_channels) or any(isinstance(v, StreamChannel) for v in inputs.values())
        if not final and node.attempt <= node.spec.retries and not has_streams and self._finished_ok():
            node.error = message
            self._active -= 1
            self._set_state(node, NodeState.FAILED)
            self._launch(node, inputs)
            return
        self._active -= 1
        self._fail(node, message)

    async def _on_frame(self, node: _Node, index: int, frame: dict[str, Any]) -> None:
        nid = node.spec.id
        now = time.time()
        for port, value in frame.items():
            self._emit(NodeOutputEvent(seq=self.log.next_seq, run_id=self.id, time=now, node=nid, port=port,
                                       value=preview(value), frame=index, iteration=node.fired))
        edges = self.plan.out_edges[nid]
        if index == 0:
            # Every stream edge opens with the first frame, whichever ports it carries: a reader
            # of several ports fires with all of them (an edge's first frame may come last).
            for edge in edges:
                if edge.spec.stream:
                    channel = node.stream_channels[edge.index] = self._channel(edge.spec.target)
                    if self._past(self._nodes[edge.spec.target]):
                        channel.detach()
                    self._deliver(nid, edge.index, edge.spec.target, edge.spec.target_port, 0, channel)
        for edge in edges:
            port = edge.spec.source_port
            if port not in frame:
                continue
            if edge.spec.stream:
                await node.stream_channels[edge.index].put(frame[port])  # before the first frame, never waits
            else:
                node.stream_buffers.setdefault(edge.index, []).append((next(self._arrivals), frame[port]))
        if index == 0:
            for target in dict.fromkeys(e.spec.target for e in edges if e.spec.stream):
                self._evaluate(self._nodes[target])

    @staticmethod
    def _past(node: _Node) -> bool:
        """Whether `node` can take no more deliveries: it ran (or runs) and is not in a cycle,
        or it ended for good."""
        if node.state in (NodeState.FAILED, NodeState.CANCELLED, NodeState.SKIPPED):
            return True
        return not node.cyclic and node.state != NodeState.PENDING

    def _channel(self, target: str) -> StreamChannel:
        return StreamChannel(self._stream_capacity, self._nodes[target].reads)

    def _deliver(
        self, source: str, edge_index: int, target: str, port: str, seq: int, value: Any, arrival: int | None = None
    ) -> None:
        if arrival is None:
            arrival = next(self._arrivals)
        tnode = self._nodes[target]
        tnode.inbox.setdefault(port, []).append((edge_index, seq, arrival, value))
        tnode.delivered.add(source)

    def _complete(self, node: _Node, result: NodeResult, now: float, output_value: Any = None) -> None:
        spec = node.spec
        nid = spec.id
        if node.started is not None:
            node.busy_s += now - node.started
            node.started = None
        if result.route is not None:
            allowed = spec.routes or []
            wrong = [t for t in result.route if t not in allowed]
            if wrong:
                self._fail(node, f"chose {wrong}, which are not among its routes {allowed}")
                return
        node.error = None
        self._set_state(node, NodeState.DONE, duration_ms=node.busy_s * 1e3)
        wall = time.time()
        if spec.kind == "output":
            self._emit(NodeOutputEvent(seq=self.log.next_seq, run_id=self.id, time=wall, node=nid, port="value",
                                       value=preview(output_value), iteration=node.fired))
        elif not spec.stream:
            for port, value in result.outputs.items():
                if self._keep_blobs and is_blob(value) and self._previewed(spec, port):
                    self._blobs[self.log.next_seq] = value
                self._emit(NodeOutputEvent(seq=self.log.next_seq, run_id=self.id, time=wall, node=nid, port=port,
                                           value=preview(value), iteration=node.fired))
        targets: dict[str, None] = {}
        routed = set(result.route) if result.route is not None else None
        routable = set(spec.routes or ())
        for edge in self.plan.out_edges[nid]:
            target = edge.spec.target
            targets[target] = None
            if routed is not None and target in routable and target not in routed:
                continue
            if spec.stream:
                if edge.spec.stream:
                    channel = node.stream_channels.pop(edge.index, None)
                    if channel is None:
                        channel = self._channel(target)
                        self._deliver(nid, edge.index, target, edge.spec.target_port, 0, channel)
                    channel.close()
                else:
                    for seq, (arrival, value) in enumerate(node.stream_buffers.pop(edge.index, [])):
                        self._deliver(nid, edge.index, target, edge.spec.target_port, seq, value, arrival)
                    self._nodes[target].delivered.add(nid)
            else:
                self._deliver(nid, edge.index, target, edge.spec.target_port, 0, result.outputs[edge.spec.source_port])
        for target in targets:
            self._evaluate(self._nodes[target])
        self._after_settle(node)
        # A cyclic node may have received deliveries for its next activation while it ran.
        if node.cyclic and node.delivered:
            self._evaluate(node)

    def _after_settle(self, node: _Node) -> None:
        if node.cyclic:
            self._try_settle(node.component)
        elif node.state == NodeState.SKIPPED:
            for target in dict.fromkeys(e.spec.target for e in self.plan.out_edges[node.spec.id]):
                self._evaluate(self._nodes[target])

    def _try_settle(self, component: int) -> None:
        """Settle a cyclic component once it is quiet; fire a member that can go on instead."""
        if component in self._settled_components or not self._finished_ok():
            return
        members = self.plan.topo.components[component]
        nodes = self._nodes
        if any(nodes[m].state in (NodeState.QUEUED, NodeState.RUNNING) for m in members):
            return
        if not all(self._settled(p) for p in self.plan.external_preds[component]):
            return
        self._assume_settled = component
        try:
            for m in members:
                if self._evaluate_hypothetically(nodes[m]):
                    return
        finally:
            self._assume_settled = None
        self._settled_components.add(component)
        for m in members:
            if nodes[m].fired == 0 and nodes[m].state == NodeState.PENDING:
                nodes[m].error = "its loop ended before it was reached"
                self._set_state(nodes[m], NodeState.SKIPPED)
        downstream = dict.fromkeys(
            e.spec.target for m in members for e in self.plan.out_edges[m] if nodes[e.spec.target].component != component
        )
        for target in downstream:
            self._evaluate(nodes[target])

    def _evaluate_hypothetically(self, node: _Node) -> bool:
        """Like `_evaluate`, but only fires: skipping is decided once the component settles."""
        if node.state in (NodeState.QUEUED, NodeState.RUNNING, NodeState.FAILED, NodeState.CANCELLED):
            return False
        for group in self.plan.triggers[node.spec.id]:
            if any(m in node.delivered for m in group) and all(
                m in node.delivered or self._settled(m) for m in group
            ):
                self._assume_settled = None
                self._fire(node, group)
                return True
        return False

    def _check_quiet(self) -> None:
        """When nothing is queued or running, resolve what is left and finish the run."""
        if self._active or self._finished.done():
            return
        for comp_index, members in enumerate(self.plan.topo.components):
            if comp_index in self.plan.topo.cyclic:
                self._try_settle(comp_index)
            else:
                self._evaluate(self._nodes[members[0]])
            if self._active or self._finished.done():
                return
        leftover = [n for n in self._nodes.values() if n.state == NodeState.PENDING]
        for node in leftover:
            node.error = "never triggered"
            self._set_state(node, NodeState.SKIPPED)
        if not self._finished.done():
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
        keep_blobs: bool = False,
    ) -> Run:
        """Start a run of `workflow`. `tenant`: whose run it is (a server's user, or a sharing
        scope); every cache its nodes touch is namespaced by it, whatever the nodes' params say.
        None (the command line): a node's `tenant` param, if it has one. `keep_blobs`: keep the
        byte blobs nodes produce for `Run.take_blob`."""
        plan = workflow if isinstance(workflow, Plan) else self.plan(workflow)
        values = resolve_inputs(plan, inputs or {})
        rid = run_id or uuid.uuid4().hex[:12]
        if rid in self._runs:
            raise ValueError(f"run id {rid!r} is already in use")
        run = Run(plan, values, self._dispatcher, run_id=rid, timeout_s=timeout_s,
                  stream_capacity=self._stream_capacity, tenant=tenant, keep_blobs=keep_blobs)
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
    if problems:
        raise RunInputError("; ".join(problems))
    return values
