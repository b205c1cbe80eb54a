"""How a run hands a node's values on along its out-edges.

A plain edge carries one value per activation into the target's inbox (`RunNode.inbox`,
with its edge, frame seq and arrival number, which the joins order by). A streaming node's
frames go, on a stream edge, into one `StreamChannel` per edge, opened with its first frame
(whichever ports that frame carries, so a reader of several ports fires with all of them) and
closed when the node ends; on a plain edge they are buffered and delivered, in order, when
it ends. A routing node's result names the routes taken; its other routes get nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from engine.flow.firing import RunNode
from engine.flow.plan import Plan
from engine.flow.streams import StreamChannel


class Deliveries:
    def __init__(self, plan: Plan, nodes: dict[str, RunNode], stream_capacity: int) -> None:
        self._plan = plan
        self._nodes = nodes
        self._stream_capacity = stream_capacity
        self._arrivals = itertools.count()

    async def frame(self, node: RunNode, index: int, frame: dict[str, Any]) -> list[str]:
        """Hand on a streaming node's `index`-th frame; the targets its first frame opened
        stream edges to (they may fire now)."""
        nid = node.spec.id
        edges = self._plan.out_edges[nid]
        if index == 0:
            for edge in edges:
                if edge.spec.stream:
                    channel = node.stream_channels[edge.index] = self._channel(edge.spec.target)
                    if self._nodes[edge.spec.target].past:
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
        if index != 0:
            return []
        return list(dict.fromkeys(e.spec.target for e in edges if e.spec.stream))

    def result(self, node: RunNode, outputs: dict[str, Any], route: Iterable[str] | None) -> list[str]:
        """Hand on what `node` ended with (a streaming node: close its channels, deliver what
        it buffered), along the edges its `route` (None: all) allows; every target, to evaluate."""
        spec = node.spec
        nid = spec.id
        targets: dict[str, None] = {}
        routed = set(route) if route is not None else None
        routable = set(spec.routes or ()) if routed is not None else ()
        for edge in self._plan.out_edges[nid]:
            target = edge.spec.target
            targets[target] = None
            if routed is not None and target in routable and target not in routed:
                continue
            if not spec.stream:
                self._deliver(nid, edge.index, target, edge.spec.target_port, 0, outputs[edge.spec.source_port])
            elif edge.spec.stream:
                channel = node.stream_channels.pop(edge.index, None)
                if channel is None:
                    channel = self._channel(target)
                    self._deliver(nid, edge.index, target, edge.spec.target_port, 0, channel)
                channel.close()
            else:
                for seq, (arrival, value) in enumerate(node.stream_buffers.pop(edge.index, [])):
                    self._deliver(nid, edge.index, target, edge.spec.target_port, seq, value, arrival)
                self._nodes[target].delivered.add(nid)
        return list(targets)

    def _channel(self, target: str) -> StreamChannel:
        return StreamChannel(self._stream_capacity, self._nodes[target].reads)

    def _deliver(self, source: str, edge_index: int, target: str, port: str, seq: int, value: Any,
                 arrival: int | None = None) -> None:
        if arrival is None:
            arrival = next(self._arrivals)
        tnode = self._nodes[target]
        tnode.inbox.setdefault(port, []).append((edge_index, seq, arrival, value))
        tnode.delivered.add(source)
