"""Workers as the API and `/ws/metrics/` show them: registry snapshots of the deployments a
user can see, with the gauge names the frontend's charts read (`frontend/src/api/cluster.ts`).

A worker reports its KV store's metrics as `kv.<tier>.<name>` and its GPU memory as
`gpu_memory_allocated_bytes` (`engine.worker.process`); `with_chart_gauges` adds the
chart names beside them: `<tier>.hit_rate`, `<tier>.pages_used`, `<tier>.capacity_pages`,
`<tier>.bytes_used` for tier in device/host/disk, `gpu.memory_used_bytes`,
`gpu.memory_reserved_bytes`, `gpu.memory_total_bytes`. `llm.*` gauges pass through.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet

from engine.client.cluster import WorkerSnapshot
from engine.client.workers import TP_RANK_SUFFIX, leader_worker_id
from studio.workflows.apps import StudioEngine
from studio.workflows.models import ACTIVE_DEPLOYMENT_STATUSES, Deployment, Worker, WorkerStatus

TIERS = ("device", "host", "disk")
_GPU_ALIASES = {
    "gpu_memory_allocated_bytes": "gpu.memory_used_bytes",
    "gpu_memory_reserved_bytes": "gpu.memory_reserved_bytes",
    "gpu_memory_total_bytes": "gpu.memory_total_bytes",
}
SNAPSHOT_TIMEOUT_S = 5.0


def with_chart_gauges(metrics: dict[str, float]) -> dict[str, float]:
    out = dict(metrics)
    for key, value in metrics.items():
        if key.startswith("kv.") and key.split(".", 2)[1] in TIERS:
            out.setdefault(key[3:], value)
        elif key in _GPU_ALIASES:
            out.setdefault(_GPU_ALIASES[key], value)
    return out


def worker_status(snapshot: WorkerSnapshot, recorded: str | None) -> str:
    if recorded == WorkerStatus.DRAINING:
        return recorded
    return WorkerStatus.BUSY if snapshot.load.busy else WorkerStatus.READY


def worker_dict(snapshot: WorkerSnapshot, deployment_id: str, deployment_name: str,
                recorded: str | None = None) -> dict[str, Any]:
    """`WorkerSnapshot.to_dict()` plus the studio's `status`, `deployment` (its id) and
    `deployment_name` (what the cluster page names it by)."""
    body = snapshot.to_dict()
    body["load"]["metrics"] = with_chart_gauges(body["load"]["metrics"])
    body["status"] = worker_status(snapshot, recorded)
    body["deployment"] = deployment_id
    body["deployment_name"] = deployment_name
    return body


@dataclass(frozen=True, slots=True)
class WorkerListing:
    time: float
    workers: list[dict[str, Any]]


def active_deployments(qs: QuerySet[Deployment]) -> dict[str, str]:
    """Deployment id -> registry namespace, for the active deployments of `qs`."""
    return {str(pk): ns for pk, ns in qs.filter(status__in=ACTIVE_DEPLOYMENT_STATUSES)
            .values_list("pk", "namespace")}


def deployment_names(deployment_ids: list[str]) -> dict[str, str]:
    """Deployment id -> its name."""
    return {str(pk): name for pk, name in Deployment.objects.filter(pk__in=deployment_ids).values_list("pk", "name")}


def recorded_statuses(deployment_ids: list[str]) -> dict[str, str]:
    return dict(Worker.objects.filter(deployment_id__in=deployment_ids).values_list("worker_id", "status"))


async def snapshots(eng: StudioEngine, namespaces: dict[str, str]) -> dict[str, list[WorkerSnapshot]]:
    """Live workers per deployment, read on the engine loop (which owns the registries)."""
    if not namespaces:
        return {}
    future = eng.runs.call(eng.deployments.snapshots(namespaces))
    async with asyncio.timeout(SNAPSHOT_TIMEOUT_S):
        return await asyncio.wrap_future(future)


def snapshots_sync(eng: StudioEngine, namespaces: dict[str, str]) -> dict[str, list[WorkerSnapshot]]:
    if not namespaces:
        return {}
    return eng.runs.call(eng.deployments.snapshots(namespaces)).result(SNAPSHOT_TIMEOUT_S)


def listing(live: dict[str, list[WorkerSnapshot]], recorded: dict[str, str], names: dict[str, str], *,
            role: str | None = None) -> WorkerListing:
    """`names`: deployment id -> name (`deployment_names`), for every deployment in `live`."""
    workers = [worker_dict(s, deployment_id, names[deployment_id], recorded.get(s.worker_id))
               for deployment_id, snaps in live.items() for s in snaps if role is None or s.role == role]
    workers.sort(key=lambda w: (w["info"]["role"], w["info"]["worker_id"]))
    return WorkerListing(time=time.time(), workers=workers)


@dataclass(frozen=True, slots=True)
class ReplicaSeat:
    """Which replica of its role a worker row is, and which tensor-parallel rank of it."""

    replica: int | None
    """0, 1, ... among the role's replicas still up (oldest first); None once the row ended."""
    rank: int


ENDED_WORKER_STATUSES = frozenset({WorkerStatus.STOPPED, WorkerStatus.LOST, WorkerStatus.FAILED})


def replica_seats(rows: list[Worker]) -> dict[str, ReplicaSeat]:
    """Worker id -> its seat. A replica is numbered by its rank 0's start among the role's live
    replicas (a replacement takes the number of the one it replaced only by coming up in its
    place), and its follower ranks share its number."""
    leaders = sorted((r for r in rows if leader_worker_id(r.worker_id) is None), key=lambda r: (r.started_at, r.worker_id))
    numbers: dict[str, int | None] = {}
    counts: dict[str, int] = {}
    for row in leaders:
        if row.status in ENDED_WORKER_STATUSES:
            numbers[row.worker_id] = None
        else:
            numbers[row.worker_id] = counts.get(row.role, 0)
            counts[row.role] = numbers[row.worker_id] + 1
    seats = {}
    for row in rows:
        leader = leader_worker_id(row.worker_id)
        rank = 0 if leader is None else int(row.worker_id.rpartition(TP_RANK_SUFFIX)[2])
        replica = numbers.get(leader or row.worker_id)
        seats[row.worker_id] = ReplicaSeat(None if row.status in ENDED_WORKER_STATUSES else replica, rank)
    return seats
