"""Placement: which node hosts each replica of a deployment's roles.

Pure: the nodes' free resources and labels in (`NodeOffer`), a replica -> node map out
(`Placement`), or `PlacementError` with every reason it cannot be (`Refusal`). No I/O, no
clock, deterministic: the same input always gives the same placement.

The rules, from `engine.spec.resources`:

* a replica needs its role's per-process amounts times `tp_size` on one node (its
  tensor-parallel ranks meet there), a node carrying every label the role asks for, and GPUs of
  at least the role's `gpu_memory_gb` each;
* roles of one `colocate` group are placed as bundles: replica i of each of them on one node;
* replicas of a role spread over the nodes: a node that already holds one of them is taken only
  when no other node holds the replica; after that GPU-less replicas go where they leave GPUs
  free, GPU ones where they fit tightest, and then to the node with the most CPUs and memory
  left;
* `keep` (a running deployment's placement): its replicas stay where they are while their node
  is offered and the role still has that many replicas, so only the replicas of lost nodes and
  new ones move (a node taken away, scaling); a replica that stays keeps its GPUs.

Once every replica has its node, each replica asking for GPUs gets which ones of its node
(`Slot.gpus`, by `engine.flow.gpus.assign_gpus`): out of the node's `gpu_count` less those
other deployments hold (`NodeOffer.held_gpus`) and those its kept replicas hold.

Larger bundles go first (GPUs, then memory, then CPUs), each to its best node. When that
greedy pass leaves one out, a depth-first search tries the other nodes in the same order
(at most `max_steps` steps) before giving up. Giving up names every bundle that cannot be
placed: one that no node could hold even alone, with each node's reason; otherwise those the
greedy pass left out, against what was left at that point.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.flow.gpus import GpuRequest, assign_gpus
from engine.spec.graph import RoleSpec
from engine.spec.resources import Amounts, RoleResources, role_resources

MAX_STEPS = 20_000


@dataclass(frozen=True, slots=True)
class RoleDemand:
    """A role as placement sees it: how many replicas, each of `tp_size` processes needing
    `resources` (per process)."""

    role: str
    replicas: int
    tp_size: int = 1
    resources: RoleResources = field(default_factory=RoleResources)

    @classmethod
    def of(cls, role: RoleSpec, replicas: int | None = None) -> RoleDemand:
        """From a spec's role (`replicas` overrides its count); raises `ResourcesError`."""
        return cls(role.name, role.replicas if replicas is None else replicas, role.tp_size,
                   role_resources(role.resources))

    @property
    def per_replica(self) -> Amounts:
        return self.resources.per_replica(self.tp_size)


@dataclass(frozen=True, slots=True)
class NodeOffer:
    """A node as placement sees it: what it has free for this deployment, and its labels."""

    name: str
    free: Amounts
    labels: Mapping[str, str] = field(default_factory=dict)
    gpu_memory_gb: float = 0.0
    """Memory of its smallest GPU (0 without GPUs)."""
    gpu_count: int | None = None
    """How many GPUs it has (indices 0 to `gpu_count` - 1); None: `free.gpus` + `len(held_gpus)`."""
    held_gpus: frozenset[int] = frozenset()
    """The GPU indices other deployments' replicas hold there."""

    @property
    def gpu_indices(self) -> int:
        return self.free.gpus + len(self.held_gpus) if self.gpu_count is None else self.gpu_count

    @property
    def free_gpus(self) -> int:
        """GPUs free by count and by index (they differ only for replicas placed before GPUs had indices)."""
        return max(0, min(self.free.gpus, self.gpu_indices - len(self.held_gpus)))


@dataclass(frozen=True, slots=True, order=True)
class Slot:
    """Replica `replica` (0-based) of `role` runs on `node`, on its GPUs `gpus` (none: it asks
    for none, or was placed before GPUs had indices)."""

    role: str
    replica: int
    node: str
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Move:
    role: str
    replica: int
    source: str | None
    """The node it was on (None: a new replica)."""
    target: str


@dataclass(frozen=True, slots=True)
class Placement:
    """Every replica's node, sorted by role and replica."""

    slots: tuple[Slot, ...] = ()

    def node_of(self, role: str, replica: int) -> str | None:
        slot = self.slot_of(role, replica)
        return None if slot is None else slot.node

    def slot_of(self, role: str, replica: int) -> Slot | None:
        for slot in self.slots:
            if slot.role == role and slot.replica == replica:
                return slot
        return None

    def on(self, node: str) -> list[Slot]:
        """The slots of `node`, by role and replica."""
        return [s for s in self.slots if s.node == node]

    def nodes(self) -> list[str]:
        return sorted({s.node for s in self.slots})

    def counts(self, node: str) -> dict[str, int]:
        """Role -> how many of its replicas run on `node`."""
        out: dict[str, int] = {}
        for slot in self.slots:
            if slot.node == node:
                out[slot.role] = out.get(slot.role, 0) + 1
        return out

    def without(self, nodes: Iterable[str]) -> Placement:
        gone = set(nodes)
        return Placement(tuple(s for s in self.slots if s.node not in gone))

    def moves_from(self, old: Placement) -> list[Move]:
        """The replicas whose node differs in `old` (or that `old` did not have)."""
        return [Move(s.role, s.replica, old.node_of(s.role, s.replica), s.node) for s in self.slots
                if old.node_of(s.role, s.replica) != s.node]

    def to_list(self) -> list[dict[str, Any]]:
        return [{"role": s.role, "replica": s.replica, "node": s.node, "gpus": list(s.gpus)} for s in self.slots]

    @classmethod
    def from_list(cls, data: Iterable[Mapping[str, Any]]) -> Placement:
        """From `to_list` (an entry without `gpus`, written before GPUs had indices, has none);
        raises ValueError on a malformed entry."""
        slots = []
        for entry in data:
            role, replica, node = entry.get("role"), entry.get("replica"), entry.get("node")
            gpus = entry.get("gpus", [])
            if not isinstance(role, str) or not isinstance(node, str) or not _index(replica) \
                    or not isinstance(gpus, list) or not all(_index(g) for g in gpus) or len(set(gpus)) != len(gpus):
                raise ValueError(f"not a placement slot: {entry!r}")
            slots.append(Slot(role, replica, node, tuple(gpus)))
        return cls(tuple(sorted(slots)))


def _index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True, slots=True)
class NodeProblem:
    node: str
    problems: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why some replicas cannot be placed: the roles (several for a colocate group), which
    replicas, what each replica (bundle) needs, the best node and its free resources, and every
    node's problems."""

    roles: tuple[str, ...]
    replicas: tuple[int, ...]
    need: Amounts
    labels: Mapping[str, str]
    gpu_memory_gb: float
    colocate: str | None
    best_node: str | None
    best_free: Amounts | None
    nodes: tuple[NodeProblem, ...]
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.roles[0] if len(self.roles) == 1 else list(self.roles),
            "roles": list(self.roles),
            "replicas": list(self.replicas),
            "need": self.need.to_dict(),
            "labels": dict(self.labels),
            "gpu_memory_gb": self.gpu_memory_gb,
            "colocate": self.colocate,
            "best_node": self.best_node,
            "best_free": None if self.best_free is None else self.best_free.to_dict(),
            "nodes": [{"node": n.node, "problems": list(n.problems)} for n in self.nodes],
            "message": self.message,
        }


class PlacementError(Exception):
    """No placement exists (or none was found within the search's steps); `refusals` name every
    bundle of replicas that could not be placed and why."""

    def __init__(self, refusals: Sequence[Refusal]) -> None:
        self.refusals = tuple(refusals)
        super().__init__("; ".join(r.message for r in self.refusals))


# ----------------------------------------------------------------------------------- bundles
@dataclass(frozen=True, slots=True)
class _Bundle:
    members: tuple[tuple[str, int], ...]
    """(role, replica) placed together."""
    need: Amounts
    labels: Mapping[str, str]
    gpu_memory_gb: float
    colocate: str | None
    conflict: str | None = None
    """Labels the members ask for that no node can carry at once."""

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(role for role, _ in self.members))

    @property
    def index(self) -> int:
        return self.members[0][1]


def _bundle(parts: Sequence[tuple[RoleDemand, int]], colocate: str | None) -> _Bundle:
    need = Amounts()
    labels: dict[str, str] = {}
    asked: dict[str, str] = {}
    conflict = None
    for demand, _ in parts:
        need = need + demand.per_replica
        for name, value in demand.resources.labels.items():
            if name in labels and labels[name] != value:
                conflict = (f"role {demand.role!r} asks for label {name}={value}, role {asked[name]!r} for"
                            f" {name}={labels[name]}")
            labels.setdefault(name, value)
            asked.setdefault(name, demand.role)
    gpu_memory = max((d.resources.gpu_memory_gb for d, _ in parts), default=0.0)
    return _Bundle(tuple((d.role, i) for d, i in parts), need, labels, gpu_memory, colocate, conflict)


def _bundles(demands: Sequence[RoleDemand]) -> list[_Bundle]:
    groups: dict[str, list[RoleDemand]] = {}
    bundles = []
    for demand in demands:
        if demand.resources.colocate is None:
            bundles += [_bundle([(demand, i)], None) for i in range(demand.replicas)]
        else:
            groups.setdefault(demand.resources.colocate, []).append(demand)
    for group, members in sorted(groups.items()):
        members.sort(key=lambda d: d.role)
        for i in range(max(d.replicas for d in members)):
            bundles.append(_bundle([(d, i) for d in members if i < d.replicas], group))
    return bundles


def _size(bundle: _Bundle) -> tuple[Any, ...]:
    n = bundle.need
    return (-n.gpus, -n.memory_gb, -n.cpus, -len(bundle.members), bundle.roles, bundle.index)


def _label_problems(bundle: _Bundle, node: NodeOffer) -> list[str]:
    out = []
    if bundle.conflict is not None:
        out.append(bundle.conflict)
    for name, value in bundle.labels.items():
        have = node.labels.get(name)
        if have is None:
            out.append(f"no label {name} (needs {name}={value})")
        elif have != value:
            out.append(f"label {name}={have}, needs {name}={value}")
    if bundle.need.gpus and bundle.gpu_memory_gb > node.gpu_memory_gb + 1e-9:
        out.append(f"GPUs of {node.gpu_memory_gb:g} GB, needs {bundle.gpu_memory_gb:g} GB each")
    return out


def _problems(bundle: _Bundle, node: NodeOffer, free: Amounts) -> list[str]:
    return _label_problems(bundle, node) + bundle.need.shortfalls(free)


# ----------------------------------------------------------------------------------- search
class _State:
    """Free resources per node and replicas of each role per node, as bundles are placed."""

    def __init__(self, nodes: Sequence[NodeOffer]) -> None:
        self.free = {n.name: Amounts(n.free_gpus, n.free.cpus, n.free.memory_gb) for n in nodes}
        self.count: dict[tuple[str, str], int] = {}

    def put(self, bundle: _Bundle, node: str) -> None:
        self.free[node] = self.free[node] - bundle.need
        for role in bundle.roles:
            self.count[(role, node)] = self.count.get((role, node), 0) + 1

    def take(self, bundle: _Bundle, node: str) -> None:
        self.free[node] = self.free[node] + bundle.need
        for role in bundle.roles:
            self.count[(role, node)] -= 1


def _candidates(bundle: _Bundle, nodes: Sequence[NodeOffer], state: _State, prefer: str | None) -> list[str]:
    """The nodes that hold `bundle` now, best first."""
    scored = []
    need = bundle.need
    for node in nodes:
        free = state.free[node.name]
        if _label_problems(bundle, node) or not need.fits_in(free):
            continue
        after = free - need
        gpu_fit = free.gpus if need.gpus == 0 else free.gpus - need.gpus
        spread = max((state.count.get((role, node.name), 0) for role in bundle.roles), default=0)
        scored.append(((node.name != prefer, spread, gpu_fit, -after.cpus, -after.memory_gb, node.name), node.name))
    return [name for _, name in sorted(scored)]


def _search(bundles: Sequence[_Bundle], nodes: Sequence[NodeOffer], state: _State,
            prefer: Mapping[int, str], max_steps: int) -> dict[int, str] | None:
    """Depth-first over `bundles` in order; a node per bundle index, or None (none found)."""
    chosen: dict[int, str] = {}
    steps = 0

    def step(i: int) -> bool:
        nonlocal steps
        if i == len(bundles):
            return True
        for name in _candidates(bundles[i], nodes, state, prefer.get(i)):
            steps += 1
            if steps > max_steps:
                return False
            state.put(bundles[i], name)
            chosen[i] = name
            if step(i + 1):
                return True
            state.take(bundles[i], name)
            del chosen[i]
        return False

    return dict(chosen) if step(0) else None


def place(demands: Sequence[RoleDemand], nodes: Sequence[NodeOffer], *, keep: Placement | None = None,
          max_steps: int = MAX_STEPS) -> Placement:
    """Place every replica of `demands` on `nodes`; raises `PlacementError` (see the module
    docstring). `nodes`' free resources must not count this deployment's own replicas:
    those `keep` holds are taken from them here."""
    nodes = sorted(nodes, key=lambda n: n.name)
    by_name = {n.name: n for n in nodes}
    keep = keep or Placement()
    state = _State(nodes)
    placed: dict[tuple[str, int], str] = {}
    stayed: set[tuple[str, int]] = set()
    todo: list[_Bundle] = []
    prefer: dict[int, str] = {}
    for bundle in _bundles(demands):
        kept = {keep.node_of(role, i) for role, i in bundle.members}
        kept_on = sorted(n for n in kept if n is not None and n in by_name)
        if len(kept) == 1 and kept_on and not _label_problems(bundle, by_name[kept_on[0]]):
            state.put(bundle, kept_on[0])  # stays: whatever it takes is its own already
            placed.update(dict.fromkeys(bundle.members, kept_on[0]))
            stayed.update(bundle.members)
        else:
            if kept_on:
                prefer[len(todo)] = kept_on[0]
            todo.append(bundle)
    order = sorted(range(len(todo)), key=lambda i: _size(todo[i]))
    bundles = [todo[i] for i in order]
    preferred = {new: prefer[old] for new, old in enumerate(order) if old in prefer}
    start = {name: state.free[name] for name in state.free}
    counts = dict(state.count)

    chosen = _search(bundles, nodes, state, preferred, max_steps)
    if chosen is None:
        state.free, state.count = dict(start), dict(counts)
        raise PlacementError(_refusals(bundles, nodes, state, preferred))
    for i, name in chosen.items():
        placed.update(dict.fromkeys(bundles[i].members, name))
    return Placement(tuple(sorted(_seated(demands, by_name, placed, stayed, keep))))


def _seated(demands: Sequence[RoleDemand], nodes: Mapping[str, NodeOffer], placed: Mapping[tuple[str, int], str],
            stayed: set[tuple[str, int]], keep: Placement) -> list[Slot]:
    """The slots of `placed`, each with its GPUs: a replica that `stayed` keeps those `keep`
    gave it while they are still its node's and nobody else's, every other one gets some by
    `assign_gpus`. The counts placement checked guarantee there are enough."""
    by_role = {d.role: d for d in demands}
    out = []
    for name in sorted(set(placed.values())):
        node = nodes[name]
        held = set(node.held_gpus)
        gpus: dict[tuple[str, int], tuple[int, ...]] = {}
        requests = []
        for (role, i), at in sorted(placed.items()):
            if at != name:
                continue
            demand = by_role[role]
            old = keep.slot_of(role, i)
            need = demand.per_replica.gpus
            if (role, i) in stayed and old is not None and len(old.gpus) == need \
                    and all(0 <= g < node.gpu_indices and g not in held for g in old.gpus):
                gpus[(role, i)] = old.gpus
                held.update(old.gpus)
            else:
                requests.append(GpuRequest(role, i, demand.resources.per_process.gpus, demand.tp_size))
        for grant in assign_gpus(node.gpu_indices, held, requests):
            gpus[(grant.role, grant.replica)] = grant.gpus
        out += [Slot(role, i, name, seat) for (role, i), seat in gpus.items()]
    return out


# ----------------------------------------------------------------------------------- reasons
def _refusals(bundles: Sequence[_Bundle], nodes: Sequence[NodeOffer], state: _State,
              prefer: Mapping[int, str]) -> list[Refusal]:
    """Bundles no node holds even alone; when there are none, those a greedy pass leaves out."""
    alone = [(b, dict(state.free)) for b in bundles
             if not any(not _problems(b, n, state.free[n.name]) for n in nodes)]
    if not alone:
        for i, bundle in enumerate(bundles):
            names = _candidates(bundle, nodes, state, prefer.get(i))
            if names:
                state.put(bundle, names[0])
            else:
                alone.append((bundle, dict(state.free)))
        together = True
    else:
        together = False
    merged: dict[tuple[Any, ...], list[tuple[_Bundle, dict[str, Amounts]]]] = {}
    for bundle, free in alone:
        merged.setdefault((bundle.roles, bundle.need, tuple(sorted(bundle.labels.items()))), []).append((bundle, free))
    return [_refusal([b for b, _ in group], nodes, group[0][1], together) for group in merged.values()]


def _refusal(bundles: list[_Bundle], nodes: Sequence[NodeOffer], free: Mapping[str, Amounts],
             together: bool) -> Refusal:
    bundle = bundles[0]
    per_node = [NodeProblem(n.name, tuple(_problems(bundle, n, free[n.name]))) for n in nodes]

    def badness(problem: NodeProblem) -> tuple[Any, ...]:
        short = bundle.need - free[problem.node]
        labels = len(_label_problems(bundle, next(n for n in nodes if n.name == problem.node)))
        return (labels, len(problem.problems), max(short.gpus, 0), max(short.memory_gb, 0.0),
                max(short.cpus, 0.0), problem.node)

    best = min(per_node, key=badness, default=None)
    roles = bundle.roles
    who = (f"role {roles[0]!r}" if len(roles) == 1
           else f"roles {', '.join(map(repr, roles))} (colocate group {bundle.colocate!r})")
    replicas = tuple(sorted(b.index for b in bundles))
    asks = [f"each replica needs {bundle.need.describe()}"]
    if bundle.labels:
        asks.append("labels " + ",".join(f"{k}={v}" for k, v in sorted(bundle.labels.items())))
    if bundle.gpu_memory_gb and bundle.need.gpus:
        asks.append(f"GPUs of {bundle.gpu_memory_gb:g} GB each")
    which = f"replica {replicas[0]}" if len(replicas) == 1 else f"replicas {', '.join(map(str, replicas))}"
    message = f"{who}, {which}: cannot be placed: {'; '.join(asks)}"
    if best is None:
        message += "; there is no live node"
    else:
        context = " once the other roles are placed" if together else ""
        message += (f"; the best node, {best.node!r}, has {free[best.node].describe()} free{context}"
                    f" ({'; '.join(best.problems)})")
    return Refusal(roles=roles, replicas=replicas, need=bundle.need, labels=dict(bundle.labels),
                   gpu_memory_gb=bundle.gpu_memory_gb, colocate=bundle.colocate,
                   best_node=None if best is None else best.node,
                   best_free=None if best is None else free[best.node],
                   nodes=tuple(per_node), message=message)
