"""The database side of deployments: status changes and the worker rows that mirror the
registry. Synchronous (ORM); the embedded service calls them from its database thread,
the node agent from its Celery task.

A worker's row follows it as it comes up: `starting_workers` once its process is spawned
(status starting, with its host and pid), `add_workers` once it registered (ready), or
`fail_starts` when it did not come up (failed, with the reason in `Worker.error`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import msgspec
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from engine.client.cluster import Placement
from engine.client.graphs import parse_spec
from engine.client.keys import PlaneKeys
from engine.client.workers import TP_RANK_SUFFIX, leader_worker_id
from engine.spec.graph import GraphSpec
from studio.workflows.apps import engine
from studio.workflows.models import Deployment, DeploymentStatus, Worker, WorkerStatus
from studio.workflows.paths import PathRefused, PathRoots, resolve_role_paths

_KEYLESS = (DeploymentStatus.STOPPED, DeploymentStatus.FAILED)
_ENDING = (DeploymentStatus.STOPPING, DeploymentStatus.STOPPED)
"""Deployments whose keys are cleared: they have no workers."""
LIVE_WORKER_STATUSES = (WorkerStatus.STARTING, WorkerStatus.READY, WorkerStatus.BUSY, WorkerStatus.DRAINING)
UP_WORKER_STATUSES = (WorkerStatus.READY, WorkerStatus.BUSY, WorkerStatus.DRAINING)
"""Live and registered: a replica whose rank 0 is in one of these serves (a starting one does not yet)."""


@dataclass(frozen=True, slots=True)
class DeploymentTicket:
    """What a process needs to start (or reconcile) a deployment's workers."""

    deployment_id: str
    status: DeploymentStatus
    spec: GraphSpec
    """The version's spec, named for the deployment, with its replica counts."""
    namespace: str
    node: str
    keys: PlaneKeys
    """The CURVE keys of the deployment's worker plane."""
    placement: Placement = field(default_factory=Placement)
    """Which node runs each replica (empty: the deployment is `node`'s alone, or the studio's)."""

    def share(self, node: str) -> dict[str, int]:
        """Role -> how many of its replicas `node` runs."""
        if not self.placement.slots:
            return {r.name: r.replicas for r in self.spec.roles} if node == self.node else {}
        return self.placement.counts(node)


@dataclass(frozen=True, slots=True)
class ReplicaStart:
    """A replica a node agent is about to start: its role, rank 0's worker id, the GPUs of its
    placement slot (none: it holds none)."""

    role: str
    worker_id: str
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StartedWorker:
    """A role worker a process started, as its READY line (or registration) described it."""

    worker_id: str
    role: str
    address: str
    host: str
    pid: int
    device: str = "cpu"
    gpus: tuple[int, ...] = ()
    """The host's GPUs this process holds (none: it holds none, or its host has none)."""


def deployment_spec(document: dict[str, Any], deployment_id: Any, replicas: dict[str, int]) -> GraphSpec:
    """The spec the workers of a deployment run: roles scaled to `replicas`, and named after
    the deployment so two deployments of one workflow never share worker ids."""
    spec = parse_spec(document)
    suffix = str(deployment_id).replace("-", "")[:8]
    roles = [msgspec.structs.replace(r, replicas=int(replicas.get(r.name, r.replicas))) for r in spec.roles]
    return msgspec.structs.replace(spec, name=f"{spec.name[:48]}-{suffix}", roles=roles)


def _keys_for_start(deployment_id: str) -> PlaneKeys:
    """The keys of a deployment about to get workers: its own, or fresh ones for a row that
    has none (one made before keys were kept, or a stopped one being started again)."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get(pk=deployment_id)
        keys = deployment.plane_keys()
        if keys is None:
            fresh = PlaneKeys.generate()
            deployment.plane_public, deployment.plane_secret = fresh.public, fresh.secret
            deployment.save(update_fields=["plane_public", "plane_secret"])
            keys = deployment.plane_keys()
            assert keys is not None
    return keys


def ticket(deployment_id: str) -> DeploymentTicket | None:
    """What starting (or stopping) the deployment needs, its spec's paths resolved for its owner;
    a path that cannot be used (a link made since it was deployed) fails the deployment."""
    deployment = Deployment.objects.select_related("version").filter(pk=deployment_id).first()
    if deployment is None:
        return None
    status = DeploymentStatus(deployment.status)
    keys = deployment.plane_keys()
    if keys is None and status not in _KEYLESS:
        keys = _keys_for_start(deployment_id)
    document = deployment.version.spec
    try:
        document = resolve_role_paths(document, deployment.owner_id, PathRoots.of(engine().config))
    except PathRefused as exc:
        if set_status(deployment_id, DeploymentStatus.FAILED, f"cannot start: {exc}",
                      unless=(DeploymentStatus.STOPPING, DeploymentStatus.STOPPED)):
            status = DeploymentStatus.FAILED
    return DeploymentTicket(
        deployment_id=str(deployment.pk),
        status=status,
        spec=deployment_spec(document, deployment.pk, deployment.replicas),
        namespace=deployment.namespace,
        node=deployment.node,
        keys=keys if keys is not None else PlaneKeys.generate(),  # an ended one starts nothing with them
        placement=Placement.from_list((deployment.placement or {}).get("slots", [])),
    )


def set_status(deployment_id: str, status: DeploymentStatus, error: str = "", *,
               unless: tuple[DeploymentStatus, ...] = ()) -> bool:
    """Move the deployment to `status` unless it is in one of `unless` (e.g. a stop that came
    first); whether it moved."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None or deployment.status in unless:
            return False
        deployment.status = status
        deployment.error = error[:4000]
        fields = ["status", "error", "updated_at"]
        if status in _KEYLESS:  # its workers are gone: nobody may use its keys again
            deployment.plane_public = deployment.plane_secret = ""
            fields += ["plane_public", "plane_secret"]
        deployment.save(update_fields=fields)
    return True


@dataclass(frozen=True, slots=True)
class StartingWorker:
    """A role worker whose process is spawned but which has not registered yet."""

    worker_id: str
    role: str
    host: str
    pid: int | None
    device: str = "cpu"
    gpus: tuple[int, ...] = ()
    """The host's GPU indices it holds."""


def starting_workers(deployment_id: str, workers: list[StartingWorker]) -> None:
    """Rows, status starting, for workers whose processes were just spawned."""
    now = timezone.now()
    for w in workers:
        Worker.objects.update_or_create(
            worker_id=w.worker_id,
            defaults={"deployment_id": deployment_id, "role": w.role, "host": w.host, "address": "", "pid": w.pid,
                      "device": w.device, "gpus": list(w.gpus), "status": WorkerStatus.STARTING, "error": "",
                      "last_seen_at": now},
        )


def add_workers(deployment_id: str, workers: list[StartedWorker]) -> None:
    """The rows of workers that came up (ready), made or moved on from starting."""
    now = timezone.now()
    for w in workers:
        Worker.objects.update_or_create(
            worker_id=w.worker_id,
            defaults={"deployment_id": deployment_id, "role": w.role, "host": w.host, "address": w.address,
                      "pid": w.pid, "device": w.device, "gpus": list(w.gpus), "status": WorkerStatus.READY,
                      "error": "",
                      "last_seen_at": now},
        )


def set_worker_status(worker_ids: list[str], status: WorkerStatus) -> None:
    Worker.objects.filter(worker_id__in=worker_ids).update(status=status, last_seen_at=timezone.now())


def stop_all_workers(deployment_id: str, host: str | None = None) -> None:
    """Mark the deployment's live workers (on `host`, when given) stopped."""
    qs = Worker.objects.filter(deployment_id=deployment_id, status__in=LIVE_WORKER_STATUSES)
    if host is not None:
        qs = qs.filter(host=host)
    qs.update(status=WorkerStatus.STOPPED, last_seen_at=timezone.now())


def live_workers(deployment_id: str, host: str | None = None) -> list[Worker]:
    qs = Worker.objects.filter(deployment_id=deployment_id, status__in=LIVE_WORKER_STATUSES)
    if host is not None:
        qs = qs.filter(host=host)
    return list(qs.order_by("role", "worker_id"))


def unowned_workers(host: str) -> list[Worker]:
    """Rows of workers on `host` marked lost, stopped or failed recently (within a day) whose pid was
    recorded: a process may still run for them (its node was away when it was marked)."""
    since = timezone.now() - datetime.timedelta(days=1)
    return list(Worker.objects.filter(host=host, status__in=(WorkerStatus.LOST, WorkerStatus.STOPPED,
                                                             WorkerStatus.FAILED),
                                      pid__isnull=False, last_seen_at__gte=since))


@dataclass(frozen=True, slots=True)
class FailedStart:
    """A replica that did not come up: its role, rank 0's worker id, why, and the GPUs its
    placement slot gave it."""

    role: str
    worker_id: str
    error: str
    gpus: tuple[int, ...] = ()


def fail_starts(deployment_id: str, host: str, failed: list[FailedStart]) -> None:
    """Mark replicas that did not come up failed, with their reasons: rank 0's row (made if its
    process never got one) and its follower ranks' rows. Rows failed together share their time
    (`loss_streak` counts them as one failed start)."""
    now = timezone.now()
    for start in failed:
        error = start.error[:4000]
        Worker.objects.update_or_create(worker_id=start.worker_id, defaults={
            "deployment_id": deployment_id, "role": start.role, "host": host, "gpus": list(start.gpus),
            "status": WorkerStatus.FAILED, "error": error, "last_seen_at": now})
        (Worker.objects.filter(deployment_id=deployment_id, worker_id__startswith=f"{start.worker_id}{TP_RANK_SUFFIX}")
         .update(status=WorkerStatus.FAILED, error=error, last_seen_at=now))


def running_on(node: str) -> list[str]:
    """The running deployments with a share on `node`: replicas placed there, or live workers
    there (a share that moved away, to be stopped)."""
    ids = set()
    for pk, placed_on, placement in (Deployment.objects.filter(status=DeploymentStatus.RUNNING)
                                     .values_list("pk", "node", "placement")):
        slots = (placement or {}).get("slots", [])
        if any(slot.get("node") == node for slot in slots) or (not slots and placed_on == node):
            ids.add(str(pk))
    ids |= {str(pk) for pk in Worker.objects.filter(host=node, status__in=LIVE_WORKER_STATUSES,
                                                     deployment__status=DeploymentStatus.RUNNING)
            .values_list("deployment_id", flat=True)}
    return sorted(ids)


def placed_replicas_live(deployment: Deployment) -> bool:
    """Whether every replica of the deployment's placement has a worker up on its node (registered:
    a starting one is not yet; rank 0 of each replica: followers of a tensor-parallel one are not
    endpoints)."""
    placement = Placement.from_list((deployment.placement or {}).get("slots", []))
    live: dict[tuple[str, str], int] = {}
    for role, host, worker_id in (Worker.objects.filter(deployment=deployment, status__in=UP_WORKER_STATUSES)
                                  .values_list("role", "host", "worker_id")):
        if leader_worker_id(worker_id) is None:
            live[(role, host)] = live.get((role, host), 0) + 1
    return all(live.get((role, node), 0) >= count for node in placement.nodes()
               for role, count in placement.counts(node).items())


def settle_started(deployment_id: str) -> bool:
    """After a node started its share: the deployment is running once every placed replica is
    live (one placed on a single node: at once). False when it ended meanwhile (stopping,
    stopped or failed): the caller stops what it started."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None or deployment.status in (*_ENDING, DeploymentStatus.FAILED):
            return False
        if deployment.status != DeploymentStatus.RUNNING and (
                not (deployment.placement or {}).get("slots") or placed_replicas_live(deployment)):
            deployment.status = DeploymentStatus.RUNNING
            deployment.error = ""
            deployment.save(update_fields=["status", "error", "updated_at"])
    return True


def settle_stopped(deployment_id: str) -> bool:
    """After a node stopped its share: a stopping deployment is stopped once no worker of it is
    live on any node (each node marks its own rows before it takes the row lock, so the last
    one to get here sees every other's). Whether it is stopped now."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if deployment is None:
            return True
        if deployment.status not in (DeploymentStatus.STOPPING, DeploymentStatus.STOPPED):
            return False  # failed (its keys are gone already), or started again meanwhile
        if Worker.objects.filter(deployment=deployment, status__in=LIVE_WORKER_STATUSES).exists():
            return False
        if deployment.status != DeploymentStatus.STOPPED:
            deployment.status = DeploymentStatus.STOPPED
            deployment.plane_public = deployment.plane_secret = ""
            deployment.save(update_fields=["status", "plane_public", "plane_secret", "updated_at"])
    return True


def loss_streak(deployment_id: str, host: str, role: str, healthy_s: float) -> tuple[int, datetime.datetime | None]:
    """How many replicas of `role` of the deployment on `host` were lost in a row, latest loss
    first, each before it had stayed up `healthy_s`, and when the latest was lost. A replica
    lost after staying up that long ends the row. A tensor-parallel replica counts once (its
    rank 0's row), and so does one failed start (`fail_starts`), however many replicas it was
    to bring up."""
    rows = (Worker.objects.filter(deployment_id=deployment_id, host=host, role=role,
                                  status__in=(WorkerStatus.LOST, WorkerStatus.FAILED))
            .order_by(F("last_seen_at").desc(nulls_last=True))
            .values_list("worker_id", "status", "started_at", "last_seen_at"))
    streak, latest = 0, None
    failed_starts: set[datetime.datetime] = set()
    for worker_id, status, started, lost_at in rows:
        if leader_worker_id(worker_id) is not None or lost_at is None:
            continue  # a follower rank (its rank 0 counts), or a row with no time of loss
        if status == WorkerStatus.FAILED:  # a failed start, however long it took: its rows share their time
            if lost_at in failed_starts:
                continue
            failed_starts.add(lost_at)
        elif (lost_at - started).total_seconds() >= healthy_s:
            break
        streak += 1
        latest = latest or lost_at
    return streak, latest


def error_of(deployment_id: str) -> str:
    return Deployment.objects.filter(pk=deployment_id).values_list("error", flat=True).first() or ""
