"""What a run tells those who watch it: its events, in order, in one `EventLog`.

A `RunRecorder` stamps each event with the run id, the next sequence number and the server's
clock, and keeps a node's state (`RunNode.state`) and its state events in step. Node outputs go
out as previews (`engine.flow.events.preview`); for a run that keeps blobs (a server showing
every node's images and audio) the byte blobs a preview stands for (the value itself, or the
blobs in its lists and dicts: `blobs_in`), streamed frames' too, are kept by the event's sequence
number until `take_blobs` takes them, up to `keep_blobs` of them per run.
"""

from __future__ import annotations

import time
from typing import Any

from engine.flow.events import (
    EventLog,
    HeldBlob,
    NodeOutputEvent,
    NodeProgressEvent,
    NodeState,
    NodeStateEvent,
    RunFinished,
    RunStarted,
    RunStatus,
    blobs_in,
    preview,
)
from engine.flow.firing import RunNode
from engine.flow.plan import Plan
from engine.spec.calls import RanOn

_WITH_ERROR = frozenset({NodeState.FAILED, NodeState.SKIPPED})
_TERMINAL = frozenset(state for state in NodeState if state.terminal)


class RunRecorder:
    def __init__(self, run_id: str, plan: Plan, *, keep_blobs: int) -> None:
        """`keep_blobs`: how many byte blobs this run keeps in all (0: none); past it, the
        previews alone go out (a loop making an image per iteration keeps its first ones)."""
        self.run_id = run_id
        self.log = EventLog()
        self._plan = plan
        self._room = keep_blobs
        self._blobs: dict[int, list[HeldBlob]] = {}

    def started(self) -> None:
        self.log.append(RunStarted(seq=self.log.next_seq, run_id=self.run_id, time=time.time(),
                                   workflow=self._plan.name, nodes=list(self._plan.order)))

    def state(self, node: RunNode, state: NodeState, where: RanOn | None = None) -> None:
        """`node` is now in `state` (where it runs, for a running one). Its times come from
        `node.busy_s`, which the executor brings up to date before it calls this: the time it ran
        before, with `running`; the time it ran in all, once it ends (or an attempt fails)."""
        node.state = state
        busy_ms = node.busy_s * 1e3
        log = self.log
        log.append(NodeStateEvent(
            seq=len(log), run_id=self.run_id, time=time.time(), node=node.spec.id, state=state,
            attempt=node.attempt, iteration=node.fired,
            error=node.error if state in _WITH_ERROR else None,
            duration_ms=busy_ms if state in _TERMINAL and node.first_started is not None else None,
            busy_ms=busy_ms if state == NodeState.RUNNING else None,
            worker=None if where is None else where.worker, host=None if where is None else where.host))

    def progress(self, node_id: str, fraction: float | None, message: str) -> None:
        self.log.append(NodeProgressEvent(seq=self.log.next_seq, run_id=self.run_id, time=time.time(),
                                          node=node_id, progress=fraction, message=message))

    def frame(self, node: RunNode, index: int, frame: dict[str, Any]) -> None:
        """A streaming node's `index`-th frame."""
        now = time.time()
        for port, value in frame.items():
            self._keep(node.spec.id, port, value)
            self.log.append(NodeOutputEvent(seq=self.log.next_seq, run_id=self.run_id, time=now, node=node.spec.id,
                                            port=port, value=preview(value), frame=index, iteration=node.fired))

    def outputs(self, node: RunNode, outputs: dict[str, Any]) -> None:
        """What a node that finished produced (an output node: the value it gives the run, as
        `value`)."""
        now = time.time()
        spec = node.spec
        for port, value in outputs.items():
            if spec.kind != "output":
                self._keep(spec.id, port, value)
            self.log.append(NodeOutputEvent(seq=self.log.next_seq, run_id=self.run_id, time=now, node=spec.id,
                                            port=port, value=preview(value), iteration=node.fired))

    def finished(self, status: RunStatus, outputs: dict[str, Any], error: str | None, failed_node: str | None,
                 duration_ms: float) -> None:
        self.log.append(RunFinished(seq=self.log.next_seq, run_id=self.run_id, time=time.time(), status=status,
                                    outputs={k: preview(v) for k, v in outputs.items()}, error=error,
                                    failed_node=failed_node, duration_ms=duration_ms))

    def take_blobs(self, seq: int) -> list[HeldBlob]:
        """The byte blobs a `node_output` event (by its seq) only previews, once (else none)."""
        return self._blobs.pop(seq, [])

    def _keep(self, node_id: str, port: str, value: Any) -> None:
        """Keep the blobs of the `node_output` event about to be logged, while there is room."""
        if self._room <= 0 or not self._previewed(node_id, port):
            return
        held = blobs_in(value)[:self._room]
        if held:
            self._blobs[self.log.next_seq] = held
            self._room -= len(held)

    def _previewed(self, node_id: str, port: str) -> bool:
        """Whether a blob on `port` is kept: not an input's (an upload), nor one that only output
        nodes take (it becomes the run's output: stored once, as that)."""
        if self._plan.nodes[node_id].kind == "input":
            return False
        targets = [e.spec.target for e in self._plan.out_edges[node_id] if e.spec.source_port == port]
        return not targets or any(self._plan.nodes[t].kind != "output" for t in targets)
