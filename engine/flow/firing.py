"""When a run's nodes fire: trigger groups, joins, and the settling of cycles.

A node fires when one of its trigger groups is satisfied: every member has delivered in this
activation or is *settled* (can never deliver again), and at least one delivered. A node that
never fired is skipped once all its groups are dead (every member settled without delivering).
A predecessor outside any cycle is settled when it reaches a terminal state; one inside a cycle
is settled when its whole cycle is quiet (nothing in it queued or running, nothing outside
feeding it still active, and no member able to fire).

`Firing` decides; the run (`engine.flow.executor.Run`) acts, through the `RunActions` it
passes in: firing a node, skipping it, or marking it skipped where nothing else needs doing.
`gather_inputs` is what a firing hands the node: one value per port, or a join's list.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.flow.events import NodeState
from engine.flow.plan import Plan
from engine.flow.streams import StreamChannel, StreamGroup
from engine.spec.graph import NodeSpec


class NodeFailure(RuntimeError):
    """Raised into a run's result: which node failed and why."""


@dataclass(slots=True)
class RunNode:
    """One node's state within a run."""

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

    @property
    def past(self) -> bool:
        """Whether it can take no more deliveries: it ran (or runs) and is not in a cycle, or it
        ended for good."""
        if self.state in (NodeState.FAILED, NodeState.CANCELLED, NodeState.SKIPPED):
            return True
        return not self.cyclic and self.state != NodeState.PENDING

    def stop_clock(self, now: float) -> None:
        """An attempt that ran is over at `now`: its time counts in `busy_s`."""
        if self.started is not None:
            self.busy_s += now - self.started
            self.started = None

    def drop_unread(self, kept: Iterable[Any]) -> None:
        """Detach the stream channels in its inbox that this firing does not hand on (`kept`):
        nobody will read them, and their producers must not wait for it."""
        if not self.reads.channels:  # no stream was delivered to it (the common case: nothing to scan)
            return
        keep = {id(value) for value in kept}
        for arrivals in self.inbox.values():
            for arrival in arrivals:
                value = arrival[3]
                if isinstance(value, StreamChannel) and id(value) not in keep:
                    value.detach()


@dataclass(frozen=True, slots=True)
class RunActions:
    """What `Firing` asks of the run."""

    fire: Callable[[RunNode, frozenset[str] | None], None]
    """Start a node's next activation on a trigger group (None: a root)."""
    skip: Callable[[RunNode, str], None]
    """Skip a node and what hangs on it (its streams, its dependants), for a reason."""
    mark_skipped: Callable[[RunNode, str], None]
    """Record a node as skipped, for a reason, where nothing depends on it any more."""
    ended: Callable[[], bool]
    """Whether the run already has its outcome (then nothing is skipped any more)."""


_ENDED = RunActions(fire=lambda node, group: None, skip=lambda node, reason: None,
                    mark_skipped=lambda node, reason: None, ended=lambda: True)
"""What an ended run asks of nothing: nothing fires or is skipped any more."""

_NOT_FIRABLE = (NodeState.QUEUED, NodeState.RUNNING, NodeState.FAILED, NodeState.CANCELLED)


class Firing:
    """Decides, for a run's nodes, which fire, which are skipped, and when a cycle settles."""

    def __init__(self, plan: Plan, nodes: dict[str, RunNode], actions: RunActions) -> None:
        self._plan = plan
        self._nodes = nodes
        self._actions = actions
        self._ended = actions.ended
        self._settled_components: set[int] = set()
        self._assume_settled: int | None = None

    def end(self) -> None:
        """The run is over: drop its actions. They are the run's methods and the run holds this
        `Firing`; without the cycle the run and its nodes and events are freed as soon as they
        are dropped, not at the cycle collector's next pass (whose work grows with each run)."""
        self._actions = _ENDED
        self._ended = _ENDED.ended

    def settled(self, pred: str) -> bool:
        node = self._nodes[pred]
        if not node.cyclic:
            return node.state.terminal
        return node.component in self._settled_components or node.component == self._assume_settled

    def evaluate(self, node: RunNode) -> bool:
        """Fire or skip `node` if its triggers allow; True when it fired."""
        if node.state in _NOT_FIRABLE or node.state == NodeState.SKIPPED:
            return False
        if node.state == NodeState.DONE and not node.cyclic:
            return False
        delivered = node.delivered
        all_dead = True
        for group in self._plan.triggers[node.spec.id]:
            hit = False
            complete = True
            for member in group:
                if member in delivered:
                    hit = True
                elif not self.settled(member):
                    complete = False
                    break
            if complete and hit:
                self._actions.fire(node, group)
                return True
            if not complete or hit:
                all_dead = False
        if all_dead and node.fired == 0 and not self._ended():
            self._actions.skip(node, "no trigger group can be satisfied")
        return False

    def evaluate_targets(self, node: RunNode) -> None:
        """Evaluate each node `node` has an edge to, once."""
        for target in dict.fromkeys(e.spec.target for e in self._plan.out_edges[node.spec.id]):
            self.evaluate(self._nodes[target])

    def after_settle(self, node: RunNode) -> None:
        """`node` reached a state it may stay in: what waited on it may go on."""
        if node.cyclic:
            self.try_settle(node.component)
        elif node.state == NodeState.SKIPPED:
            self.evaluate_targets(node)

    def try_settle(self, component: int) -> None:
        """Settle a cyclic component once it is quiet; fire a member that can go on instead."""
        if component in self._settled_components or self._ended():
            return
        members = self._plan.topo.components[component]
        nodes = self._nodes
        if any(nodes[m].state in (NodeState.QUEUED, NodeState.RUNNING) for m in members):
            return
        if not all(self.settled(p) for p in self._plan.external_preds[component]):
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
                self._actions.mark_skipped(nodes[m], "its loop ended before it was reached")
        downstream = dict.fromkeys(
            e.spec.target for m in members for e in self._plan.out_edges[m] if nodes[e.spec.target].component != component
        )
        for target in downstream:
            self.evaluate(nodes[target])

    def _evaluate_hypothetically(self, node: RunNode) -> bool:
        """Like `evaluate`, but only fires: skipping is decided once the component settles."""
        if node.state in _NOT_FIRABLE:
            return False
        for group in self._plan.triggers[node.spec.id]:
            if any(m in node.delivered for m in group) and all(
                m in node.delivered or self.settled(m) for m in group
            ):
                self._assume_settled = None
                self._actions.fire(node, group)
                return True
        return False

    def resolve_quiet(self, busy: Callable[[], bool]) -> bool:
        """Nothing is queued or running: settle the cycles and evaluate what is left, in order.
        False as soon as that set something going (`busy()`) or ended the run; True when the run
        is over, the nodes that never fired marked skipped."""
        for comp_index, members in enumerate(self._plan.topo.components):
            if comp_index in self._plan.topo.cyclic:
                self.try_settle(comp_index)
            else:
                self.evaluate(self._nodes[members[0]])
            if busy() or self._ended():
                return False
        for node in self._nodes.values():
            if node.state == NodeState.PENDING:
                self._actions.mark_skipped(node, "never triggered")
        return True


def gather_inputs(plan: Plan, node: RunNode, group: frozenset[str] | None) -> dict[str, Any] | str:
    """Input values for a firing of `node` on trigger `group` (None: a root), or a reason to skip
    the node. Values delivered by predecessors outside the group are dropped. NodeFailure when a
    port without a join received more than one value."""
    values: dict[str, Any] = {}
    edges = plan.spec.edges
    # Only a firing on a group that some delivering predecessor is not part of has values to drop.
    others = group is not None and not node.delivered.issubset(group)
    for port, pspec in node.spec.inputs.items():
        arrivals = node.inbox.get(port, ())
        if others:
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
