"""The static plan: a validated GraphSpec indexed for the executor.

It resolves default triggers, groups edges by target port, and records the strongly
connected components (bounded cycles) in topological order.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.flow.topology import Topology, topology
from engine.flow.validate import validate
from engine.spec.graph import EdgeSpec, GraphSpec, NodeSpec, RoleSpec
from engine.spec.kinds import KindRegistry, NodeKind
from engine.spec.ops import OpConfig


@dataclass(frozen=True, slots=True)
class PlanEdge:
    index: int
    """Position in the spec's edge list: the order `join: all` gathers in."""
    spec: EdgeSpec


@dataclass(frozen=True, slots=True)
class Plan:
    spec: GraphSpec
    nodes: dict[str, NodeSpec]
    kinds: dict[str, NodeKind]
    roles: dict[str, RoleSpec]
    topo: Topology
    order: tuple[str, ...]
    in_edges: dict[str, dict[str, tuple[PlanEdge, ...]]]
    out_edges: dict[str, tuple[PlanEdge, ...]]
    triggers: dict[str, tuple[frozenset[str], ...]]
    external_preds: dict[int, frozenset[str]]
    """Per cyclic component: predecessors of its members outside it."""
    input_nodes: tuple[str, ...]
    output_nodes: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.spec.name


def build_plan(spec: GraphSpec, kinds: KindRegistry, ops: OpConfig | None = None) -> Plan:
    """Validate `spec` (raising GraphValidationError; its ops too, given `ops`) and index it for execution."""
    validate(spec, kinds, ops)
    topo = topology(spec)
    nodes = {n.id: n for n in spec.nodes}
    in_edges: dict[str, dict[str, list[PlanEdge]]] = {n: {p: [] for p in nodes[n].inputs} for n in nodes}
    out_edges: dict[str, list[PlanEdge]] = {n: [] for n in nodes}
    for i, edge in enumerate(spec.edges):
        pe = PlanEdge(i, edge)
        in_edges[edge.target][edge.target_port].append(pe)
        out_edges[edge.source].append(pe)
    triggers: dict[str, tuple[frozenset[str], ...]] = {}
    for node_id, node in nodes.items():
        preds = topo.preds[node_id]
        if node.trigger is not None:
            triggers[node_id] = tuple(frozenset(g) for g in node.trigger)
            continue
        comp = topo.component_of[node_id]
        outside = frozenset(p for p in preds if topo.component_of[p] != comp)
        inside = [frozenset([p]) for p in preds if topo.component_of[p] == comp]
        triggers[node_id] = ((outside,) if outside else ()) + tuple(inside)
    external = {
        c: frozenset(p for m in topo.components[c] for p in topo.preds[m] if topo.component_of[p] != c)
        for c in topo.cyclic
    }
    order = tuple(n for comp in topo.components for n in comp)
    return Plan(
        spec=spec,
        nodes=nodes,
        kinds={n: kinds.node_kind(nodes[n].kind) for n in nodes},
        roles={r.name: r for r in spec.roles},
        topo=topo,
        order=order,
        in_edges={n: {p: tuple(v) for p, v in ports.items()} for n, ports in in_edges.items()},
        out_edges={n: tuple(v) for n, v in out_edges.items()},
        triggers=triggers,
        external_preds=external,
        input_nodes=tuple(n.id for n in spec.nodes if n.kind == "input"),
        output_nodes=tuple(n.id for n in spec.nodes if n.kind == "output"),
    )
