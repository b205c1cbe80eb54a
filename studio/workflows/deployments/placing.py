"""Placement in the studio (distributed mode): the live nodes from the node directory (Redis),
what the active deployments already take of them (the database), and the engine's pure
`engine.flow.placement.place`.

* `DeploymentPlacement` — a deployment's `placement` column, typed: the replica -> node map,
  the replicas that moved (and why), the replicas waiting for a node that fits them;
* `usage` — per node, what the placed replicas of the active deployments take (their roles'
  resources, and the GPU indices their slots name) and which deployments' replicas it hosts;
* `plan` — where a deployment's replicas go (create, scale, the deploy dialog's preview), or
  `PlacementError` with every reason; `lock` serialises the planners, so two deployments
  created at once never both count on the same free resources.

A node's free resources are its announced total less what the database says its placed
replicas take, never its own (lagging) announcement of them; likewise the GPUs they hold, so a
new replica gets GPUs of the node nobody else's slot names (`engine.flow.gpus`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from django.utils import timezone

from engine.client.cluster import (
    NodeDirectory,
    NodeOffer,
    NodeRecord,
    Placement,
    PlacementError,
    RoleDemand,
    place,
)
from engine.spec.graph import GraphSpec
from engine.spec.resources import Amounts, ResourcesError, role_resources
from studio.config import StudioConfig
from studio.workflows.models import ACTIVE_DEPLOYMENT_STATUSES, Deployment

_LOCK_KEY = int.from_bytes(hashlib.blake2b(b"omniflow-placement", digest_size=8).digest(), "big", signed=True)


@dataclass(frozen=True, slots=True)
class MoveRecord:
    """A replica placed again: from `source` (None: it had no node) to `target`, and why."""

    role: str
    replica: int
    source: str | None
    target: str
    at: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "replica": self.replica, "from": self.source, "to": self.target, "at": self.at,
                "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MoveRecord:
        return cls(str(data["role"]), int(data["replica"]), data.get("from"), str(data["to"]), str(data.get("at", "")),
                   str(data.get("reason", "")))


MAX_MOVES_KEPT = 50


@dataclass(frozen=True, slots=True)
class DeploymentPlacement:
    """A deployment's `placement` column. Empty for a deployment the studio hosts itself."""

    placement: Placement = field(default_factory=Placement)
    moved: tuple[MoveRecord, ...] = ()
    """The latest replicas that moved, oldest first (at most `MAX_MOVES_KEPT`)."""
    unplaced: tuple[dict[str, Any], ...] = ()
    """Refusals (`Refusal.to_dict()`) of replicas that lost their node and fit no node left."""

    @classmethod
    def of(cls, raw: Mapping[str, Any] | None) -> DeploymentPlacement:
        if not raw:
            return cls()
        return cls(Placement.from_list(raw.get("slots", [])),
                   tuple(MoveRecord.from_dict(m) for m in raw.get("moved", [])),
                   tuple(raw.get("unplaced", [])))

    @property
    def empty(self) -> bool:
        return not self.placement.slots and not self.unplaced

    def to_json(self) -> dict[str, Any]:
        return {"slots": self.placement.to_list(), "moved": [m.to_dict() for m in self.moved[-MAX_MOVES_KEPT:]],
                "unplaced": list(self.unplaced)}

    def replaced(self, placement: Placement, reason: str, unplaced: Iterable[dict[str, Any]] = ()) -> DeploymentPlacement:
        """This placement changed to `placement`, the replicas that moved recorded with `reason`."""
        at = timezone.now().isoformat(timespec="seconds")
        moves = tuple(MoveRecord(m.role, m.replica, m.source, m.target, at, reason)
                      for m in placement.moves_from(self.placement))
        return DeploymentPlacement(placement, (*self.moved, *moves)[-MAX_MOVES_KEPT:], tuple(unplaced))


def directory(config: StudioConfig) -> NodeDirectory:
    if config.redis_url is None:
        raise RuntimeError("the node directory needs REDIS_URL")
    return NodeDirectory(config.redis_url, config.nodes_namespace)


def demands(spec: GraphSpec, replicas: Mapping[str, int]) -> list[RoleDemand]:
    """What placing `spec` with these replica counts asks for; raises `ResourcesError`."""
    return [RoleDemand.of(role, int(replicas.get(role.name, role.replicas))) for role in spec.roles]


@dataclass(slots=True)
class NodeUse:
    """What the active deployments' placed replicas take of one node."""

    taken: Amounts = field(default_factory=Amounts)
    hosting: dict[str, dict[str, int]] = field(default_factory=dict)
    """Deployment id -> role -> replicas on the node."""
    gpus: set[int] = field(default_factory=set)
    """The GPU indices their slots name."""


def _per_replica(spec_roles: Iterable[Mapping[str, Any]]) -> dict[str, Amounts]:
    out = {}
    for role in spec_roles:
        try:
            wanted = role_resources(role.get("resources") or {})
        except ResourcesError:
            wanted = None  # a stored version from before resources were read: it asks for nothing
        tp = int(role.get("tp_size", 1))
        out[str(role.get("name"))] = Amounts() if wanted is None else wanted.per_replica(tp)
    return out


def usage(exclude: Any = None) -> dict[str, NodeUse]:
    """Node -> what the placed replicas of the active deployments (but `exclude`) take of it."""
    qs = (Deployment.objects.filter(status__in=ACTIVE_DEPLOYMENT_STATUSES).exclude(placement={})
          .select_related("version").only("id", "placement", "version__spec"))
    if exclude is not None:
        qs = qs.exclude(pk=exclude)
    out: dict[str, NodeUse] = {}
    for deployment in qs:
        needs = _per_replica(deployment.version.spec.get("roles", []))
        for slot in DeploymentPlacement.of(deployment.placement).placement.slots:
            use = out.setdefault(slot.node, NodeUse())
            use.taken = use.taken + needs.get(slot.role, Amounts())
            use.gpus.update(slot.gpus)
            roles = use.hosting.setdefault(str(deployment.pk), {})
            roles[slot.role] = roles.get(slot.role, 0) + 1
    return out


def offers(records: Iterable[NodeRecord], used: Mapping[str, NodeUse]) -> list[NodeOffer]:
    out = []
    for r in records:
        use = used.get(r.name, NodeUse())
        held = frozenset(g for g in use.gpus if g < r.total.gpus)  # a node that now offers fewer: those are gone
        out.append(NodeOffer(r.name, r.total - use.taken, dict(r.labels), r.gpu_memory_gb, gpu_count=r.total.gpus,
                             held_gpus=held))
    return out


class NodeNotLive(Exception):
    """A deployment was pinned to a node no agent announces."""


def plan(records: Iterable[NodeRecord], spec: GraphSpec, replicas: Mapping[str, int], *, only: str | None = None,
         exclude: Any = None, keep: Placement | None = None) -> Placement:
    """Where the replicas of `spec` go on the nodes of `records` (only `only`, when given),
    besides the active deployments (but `exclude`, the one being placed again). Raises
    `PlacementError`, `ResourcesError`, or `NodeNotLive`."""
    records = list(records)
    if only is not None:
        records = [r for r in records if r.name == only]
        if not records:
            raise NodeNotLive(f"node {only!r} is not live: no node agent announces it (is its Celery worker, consuming"
                              f" node.{only}, running?)")
    return place(demands(spec, replicas), offers(records, usage(exclude)), keep=keep)


def lock() -> None:
    """Serialise placements until the transaction ends (PostgreSQL; SQLite's writers are serial)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK_KEY])


def summary(error: PlacementError) -> str:
    return f"cannot place the deployment: {error}"


def refusal_details(error: PlacementError) -> list[dict[str, Any]]:
    return [r.to_dict() for r in error.refusals]
