"""Graph structure of a GraphSpec: adjacency, strongly connected components, order."""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec.graph import GraphSpec


@dataclass(frozen=True, slots=True)
class Topology:
    """Adjacency over known nodes (edges naming unknown nodes are left out).

    `components` lists strongly connected components in topological order of the
    condensation (upstream first); members keep their declaration order.
    """

    nodes: tuple[str, ...]
    preds: dict[str, tuple[str, ...]]
    succs: dict[str, tuple[str, ...]]
    component_of: dict[str, int]
    components: tuple[tuple[str, ...], ...]
    cyclic: frozenset[int]

    def is_cyclic(self, node: str) -> bool:
        return self.component_of[node] in self.cyclic


def topology(spec: GraphSpec) -> Topology:
    nodes = tuple(dict.fromkeys(n.id for n in spec.nodes))
    known = set(nodes)
    preds: dict[str, list[str]] = {n: [] for n in nodes}
    succs: dict[str, list[str]] = {n: [] for n in nodes}
    self_loops: set[str] = set()
    for e in spec.edges:
        if e.source not in known or e.target not in known:
            continue
        if e.source == e.target:
            self_loops.add(e.source)
        if e.source not in preds[e.target]:
            preds[e.target].append(e.source)
            succs[e.source].append(e.target)
    comps = _tarjan(nodes, succs)
    # Tarjan emits components downstream-first; reverse for a topological order.
    comps.reverse()
    position = {n: i for i, n in enumerate(nodes)}
    ordered = tuple(tuple(sorted(c, key=position.__getitem__)) for c in comps)
    component_of = {n: i for i, comp in enumerate(ordered) for n in comp}
    cyclic = frozenset(
        i for i, comp in enumerate(ordered) if len(comp) > 1 or comp[0] in self_loops
    )
    return Topology(
        nodes=nodes,
        preds={n: tuple(v) for n, v in preds.items()},
        succs={n: tuple(v) for n, v in succs.items()},
        component_of=component_of,
        components=ordered,
        cyclic=cyclic,
    )


def _tarjan(nodes: tuple[str, ...], succs: dict[str, list[str]]) -> list[list[str]]:
    """Iterative Tarjan: components in reverse topological order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    result: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work: list[tuple[str, int]] = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            children = succs[node]
            if i < len(children):
                work.append((node, i + 1))
                child = children[i]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            for child in children:
                if child in on_stack:
                    low[node] = min(low[node], low[child])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                result.append(comp)
    return result


def reachable_from_roots(topo: Topology) -> set[str]:
    """Nodes reachable from a node with no predecessors."""
    seen: set[str] = set()
    frontier = [n for n in topo.nodes if not topo.preds[n]]
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        frontier.extend(topo.succs[node])
    return seen
