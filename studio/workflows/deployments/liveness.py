"""Which nodes are live, lost or unknown: the node directory's word, and where Redis forgot a
node, its heartbeats kept in the database.

The node directory (Redis, `engine.flow.discovery.nodes`) knows a node as live (its lease key is
there) or lost (its lease lapsed or it withdrew; its last record is kept). Redis keeps nothing on
disk: a flush, or a restart without persistence, forgets every node, and a placed node the
directory does not know is then *unknown*, not lost: its agent announces it again within a third
of its TTL. So each announcement the directory accepted is also kept on the node's
`NodeHeartbeat` row (`heartbeat`: the time, on the database's clock, and the record), and a node
the directory does not know is lost only when

* its durable lease has lapsed: no announcement reached Redis for its TTL; and
* Redis has been up for that TTL (`NodeDirectory.up_s`): a Redis restarted less than a lease ago,
  maybe after an outage in which no announcement could land, has not given the agents their
  chance yet.

A flush keeps Redis up, so a node whose agent died is lost as soon as its lease lapses, as without
the flush: the supervision ticks that look for lost nodes come every quarter lease, so within two
TTLs of its last heartbeat. After a restart it has at least a TTL from Redis's return.

A placed node without a row has no kept lease to judge: its agent has not announced since rows
were kept (one started before they were, still running through an upgrade) or could never write
its row. Its lease counts as lapsed only once the directory has kept its memory for a TTL
(`NodeDirectory.remembered_s`; the studio's TTL stands for the node's): the directory marks when
a supervision tick first read it after a flush or a restart, so such a node has a TTL from then
to announce itself again, at every flush, not only the first after the upgrade.

The directory's own word stands: a node it knows without a live lease is lost whatever its row
says (its agent cut off from Redis, or withdrawn on purpose). For placement and failover a node
is never live for the row's sake (placement offers only what the directory lists); only the nodes
API shows one (`kept`): a forgotten node whose kept lease runs, from the record of its last
heartbeat, marked as kept rather than announced, so a flush does not empty the list meanwhile.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
from django.db.models import BooleanField, ExpressionWrapper, Q
from django.db.models.functions import Now

from engine.client.cluster import NodeRecord, NodeState
from studio.workflows.models import NodeHeartbeat


@dataclass(frozen=True, slots=True)
class Liveness:
    """The nodes as one supervision tick sees them."""

    live: Mapping[str, NodeRecord]
    """Live in the node directory, with their records (what placement may offer)."""
    lost: frozenset[str]
    """Known to the directory without a live lease, or forgotten by it with a lapsed heartbeat."""
    unknown: frozenset[str]
    """Forgotten by the directory (a flush or restart) whose heartbeat has not lapsed yet, or not for
    as long as Redis has been up, or without a row, before the directory has kept its memory for a
    TTL: neither live nor lost until their agents announce or the lease (or that grace) ends."""


def heartbeat(record: NodeRecord) -> None:
    """Record that the node directory accepted `record` now, with its lease `record.ttl_s`."""
    now = Now()
    lease = datetime.timedelta(seconds=record.ttl_s)
    fields = {"seen_at": now, "lapses_at": now + lease, "ttl_s": record.ttl_s, "record": msgspec.to_builtins(record)}
    if not NodeHeartbeat.objects.filter(name=record.name).update(**fields):
        NodeHeartbeat.objects.update_or_create(name=record.name, defaults=fields)


def judge(states: Iterable[NodeState], placed: Iterable[str], *, redis_up_s: float, remembered_s: float,
          default_ttl_s: float) -> Liveness:
    """The verdict on every node the directory knows (`states`) and every node of `placed` (the
    nodes the watched deployments' placements name), given that Redis has been up `redis_up_s` and
    the directory has kept its memory `remembered_s`; `default_ttl_s` stands for the lease of a node
    without a row (see the module docstring)."""
    known = {s.record.name: s for s in states}
    live = {name: s.record for name, s in known.items() if s.live}
    lost = {name for name, s in known.items() if not s.live}
    forgotten = set(placed) - set(known)
    rows = {name: (ttl_s, lapsed) for name, ttl_s, lapsed in _leases(forgotten)}
    unknown = set()
    for name in forgotten:
        if name in rows:
            ttl_s, lapsed = rows[name]
        else:
            ttl_s, lapsed = default_ttl_s, remembered_s >= default_ttl_s
        (lost if lapsed and redis_up_s >= ttl_s else unknown).add(name)
    return Liveness(live, frozenset(lost), frozenset(unknown))


@dataclass(frozen=True, slots=True)
class NodePaths:
    """The folders the nodes announced (their last records', lapsed or not: a run's nodes may have
    run on a node lost since)."""

    users: dict[str, Path]
    """Node name -> its users root."""
    models: tuple[Path, ...]
    """Every model root (model directories, model cache), each once: folders the errors of a
    node's processes may name, which users read without them."""


def node_paths() -> NodePaths:
    """What the nodes announced of their folders, in one read of the kept heartbeats."""
    users: dict[str, Path] = {}
    models: dict[Path, None] = {}
    for raw in NodeHeartbeat.objects.filter(record__isnull=False).values_list("record", flat=True):
        record = msgspec.convert(raw, NodeRecord)
        if record.users_root:
            users[record.name] = Path(record.users_root)
        models.update(dict.fromkeys(Path(root) for root in record.model_roots))
    return NodePaths(users, tuple(models))


def model_roots() -> tuple[Path, ...]:
    """The model roots every node announced (`NodePaths.models`)."""
    return node_paths().models


def kept(known: Collection[str]) -> list[NodeRecord]:
    """The records of the last heartbeats of the nodes not in `known` (the names the directory
    knows) whose kept lease has not lapsed, by name: what the nodes API lists while Redis has
    forgotten them. A row kept before records were has none to show and is left out."""
    rows = (NodeHeartbeat.objects.filter(lapses_at__gte=Now(), record__isnull=False).exclude(name__in=list(known))
            .values_list("record", flat=True))
    return [msgspec.convert(raw, NodeRecord) for raw in rows]


def _leases(names: set[str]) -> list[tuple[str, float, bool]]:
    """(name, ttl_s, whether its lease has lapsed by the database's clock) of the rows of `names`."""
    if not names:
        return []
    lapsed = ExpressionWrapper(Q(lapses_at__lt=Now()), output_field=BooleanField())
    return list(NodeHeartbeat.objects.filter(name__in=names).annotate(lapsed=lapsed).values_list("name", "ttl_s", "lapsed"))
