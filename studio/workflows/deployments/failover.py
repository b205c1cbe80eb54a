"""Nodes that fail: their replicas placed again on the nodes left.

Every node agent's supervision tick (`studio.workflows.tasks.supervise_node`, every
OMNIFLOW_NODE_SUPERVISE_S) calls `sweep`. A node is lost once its heartbeat lapsed: its agent
stopped announcing it (killed, cut off from Redis, or stopped and not back) for
OMNIFLOW_NODE_TTL_S. With a tick shorter than the TTL, a node is acted on within two TTLs. A node
the node directory forgot (a Redis flush or restart) is not lost for that: it is judged by its
heartbeats kept in the database (`liveness`; a node without any has a TTL from when a tick first
found the directory emptied), and a deployment with a node in that doubt is left as it is until
the node announces itself again or its lease lapses.

For each deployment with replicas on a lost node (under the placement lock and the row's lock,
so one agent does it, once):

* the node's live worker rows are marked lost, and taken off the deployment's registry and
  fenced there (`deregister_workers`): a worker of theirs that still runs -- the node was cut
  off, not dead -- cannot register again beside its replacement, and stops itself;
* a starting or running deployment's replicas there are placed again on the live nodes,
  keeping every other replica where it is (`engine.flow.placement.place` with `keep`); those
  that fit no node left stay unplaced, said in the deployment's `error` and its placement's
  `unplaced`, and are tried again at every tick (a node that comes back, or frees room);
  `placement.moved` says which replicas moved where and why;
* the nodes involved get `deploy` (starting what moved to them);
* a stopping deployment is settled (stopped once no worker of it is live).

Runs in flight on a lost worker are the dispatcher's: retried on another replica, or failed
naming the worker, never left waiting. A lost node that comes back finds its rows lost and
stops those processes (`NodeAgent.reap`): the fenced workers that could not reach Redis either
(and so have not stopped themselves).

The fences live in Redis, which keeps nothing on disk: a flush or restart forgets them, and a
lost worker that still runs would register again. The rows are the durable record, so each tick
also fences again the workers marked lost within `FENCE_TTL_S` whose tombstones are gone
(`restore_fences`, from the engine's `restore_fences`): such a worker is taken off the registry and stops itself at its next
heartbeat, whether or not its node's agent is there to end it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from django.db import transaction
from django.utils import timezone

from engine.client.cluster import (
    FENCE_TTL_S,
    NodeDirectoryError,
    NodeOffer,
    NodeRecord,
    Placement,
    PlacementError,
    Refusal,
    RoleDemand,
    deregister_workers,
    place,
)
from engine.client.cluster import restore_fences as fence_again
from engine.client.graphs import parse_spec
from engine.spec.resources import ResourcesError
from studio.config import StudioConfig
from studio.workflows.deployments import liveness, placing, records
from studio.workflows.deployments.placing import DeploymentPlacement
from studio.workflows.models import Deployment, DeploymentStatus, Worker, WorkerStatus

log = logging.getLogger(__name__)

_WATCHED = (DeploymentStatus.STARTING, DeploymentStatus.RUNNING, DeploymentStatus.STOPPING)
UNPLACED = "replicas lost with their node fit no node left"


@dataclass(frozen=True, slots=True)
class Rehomed:
    deployment_id: str
    lost_nodes: tuple[str, ...]
    lost_workers: tuple[str, ...]
    placement: Placement
    unplaced: tuple[Refusal, ...]


def sweep(config: StudioConfig) -> list[Rehomed]:
    """Place again the replicas of lost nodes, for every deployment that has some (see the module
    docstring); what it changed."""
    directory = placing.directory(config)
    try:
        states, redis_up_s, remembered_s = directory.known(), directory.up_s(), directory.remembered_s()
    except NodeDirectoryError as exc:
        log.warning("cannot read the node directory (%s): no node is declared lost meanwhile", exc)
        return []
    finally:
        directory.close()
    watched = {str(pk): DeploymentPlacement.of(raw) for pk, raw in Deployment.objects.filter(status__in=_WATCHED)
               .exclude(placement={}).values_list("pk", "placement")}
    placed = {node for current in watched.values() for node in current.placement.nodes()}
    nodes = liveness.judge(states, placed, redis_up_s=redis_up_s, remembered_s=remembered_s,
                           default_ttl_s=config.node.ttl_s)
    if nodes.unknown:
        log.warning("nodes %s are not in the node directory (Redis flushed or restarted?) but their kept leases"
                    " have not lapsed: not lost; their deployments wait for them", ", ".join(sorted(nodes.unknown)))
    done = []
    for pk, current in watched.items():
        on = set(current.placement.nodes())
        if on & nodes.unknown or (on <= set(nodes.live) and not current.unplaced):
            continue
        result = _rehome(config, pk, nodes)
        if result is not None:
            done.append(result)
    return done


def restore_fences(config: StudioConfig) -> dict[str, list[str]]:
    """Fence again, in each watched deployment's namespace, the workers its rows say were lost
    within `FENCE_TTL_S` whose tombstones Redis no longer has (flushed or restarted); the ids, by
    namespace (those it fenced again only)."""
    if not config.redis_url:
        return {}
    since = timezone.now() - datetime.timedelta(seconds=FENCE_TTL_S)
    lost: dict[str, list[str]] = {}
    for namespace, worker_id in (Worker.objects.filter(deployment__status__in=_WATCHED, status=WorkerStatus.LOST,
                                                       last_seen_at__gte=since)
                                 .exclude(deployment__namespace="").order_by("worker_id")
                                 .values_list("deployment__namespace", "worker_id")):
        lost.setdefault(namespace, []).append(worker_id)
    restored = {}
    for namespace, ids in lost.items():
        fenced = asyncio.run(fence_again(config.redis_url, namespace, ids))
        if fenced:
            restored[namespace] = fenced
    return restored


def _partial(demands: Sequence[RoleDemand], offers: Sequence[NodeOffer], keep: Placement,
             missing: Sequence[tuple[str, int]]) -> tuple[Placement, list[Refusal]]:
    """Place the `missing` replicas one at a time (lowest replica first), keeping each that fits."""
    counts = {d.role: 0 for d in demands}
    for slot in keep.slots:
        counts[slot.role] = max(counts.get(slot.role, 0), slot.replica + 1)
    by_role = {d.role: d for d in demands}
    current, refused = keep, []
    for role, index in sorted(missing, key=lambda m: (m[1], m[0])):
        trial = {**counts, role: max(counts[role], index + 1)}
        try:
            current = place([replace(by_role[r], replicas=n) for r, n in trial.items()], offers, keep=current)
        except PlacementError as exc:
            refused += [r for r in exc.refusals if role in r.roles]
            continue
        counts = trial
    return current, refused


def _rehome(config: StudioConfig, deployment_id: str, nodes: liveness.Liveness) -> Rehomed | None:
    live = nodes.live
    with transaction.atomic():
        placing.lock()
        deployment = Deployment.objects.select_for_update().select_related("version").filter(pk=deployment_id).first()
        if deployment is None or deployment.status not in _WATCHED:
            return None
        current = DeploymentPlacement.of(deployment.placement)
        on = set(current.placement.nodes())
        if on - set(live) - nodes.lost:  # placed meanwhile on a node this tick did not judge: the next one will
            return None
        lost = sorted(on & nodes.lost)
        if not lost and not current.unplaced:
            return None
        lost_rows = list(Worker.objects.filter(deployment=deployment, host__in=lost,
                                               status__in=records.LIVE_WORKER_STATUSES)
                         .values_list("worker_id", flat=True))
        records.set_worker_status(lost_rows, WorkerStatus.LOST)
        stopping = deployment.status == DeploymentStatus.STOPPING
        placement, refused = current.placement, []
        if not stopping:
            placement, refused = _placed_again(deployment, current, lost, live)
            unplaced = tuple(r.to_dict() for r in refused)
            if placement == current.placement and unplaced == current.unplaced and not lost_rows:
                return None  # still no room for what waits: nothing to record, nothing to start
            reason = f"node {', '.join(lost)} lost" if lost else "a node has room for it again"
            deployment.placement = current.replaced(placement, reason, unplaced).to_json()
            if placement.slots:
                deployment.node = placement.nodes()[0]
            if refused:
                deployment.error = f"{UNPLACED}: {'; '.join(r.message for r in refused)}"
            elif deployment.error.startswith(UNPLACED):
                deployment.error = ""
            deployment.save(update_fields=["placement", "node", "error", "updated_at"])
        namespace = deployment.namespace
        transaction.on_commit(lambda: _after(config, deployment_id, namespace, lost_rows, stopping))
    if lost:
        log.warning("deployment %s: node %s lost; workers %s lost; placement now %s%s", deployment_id,
                    ", ".join(lost), lost_rows, placement.to_list(),
                    f"; unplaced: {[r.message for r in refused]}" if refused else "")
    return Rehomed(deployment_id, tuple(lost), tuple(lost_rows), placement, tuple(refused))


def _placed_again(deployment: Deployment, current: DeploymentPlacement, lost: Sequence[str],
                  live: Mapping[str, NodeRecord]) -> tuple[Placement, list[Refusal]]:
    try:
        wanted = placing.demands(parse_spec(deployment.version.spec), deployment.replicas)
    except ResourcesError as exc:  # validated when deployed; a stored spec from before is placed as it was
        log.warning("deployment %s: cannot read its roles' resources (%s); its replicas stay unplaced",
                    deployment.pk, exc)
        return current.placement.without(lost), []
    offers = placing.offers(live.values(), placing.usage(exclude=deployment.pk))
    keep = current.placement.without(lost)
    try:
        return place(wanted, offers, keep=keep), []
    except PlacementError:
        placed = {(s.role, s.replica) for s in keep.slots}
        missing = [(d.role, i) for d in wanted for i in range(d.replicas) if (d.role, i) not in placed]
        return _partial(wanted, offers, keep, missing)


def _after(config: StudioConfig, deployment_id: str, namespace: str, lost_rows: list[str], stopping: bool) -> None:
    if lost_rows and namespace and config.redis_url:
        asyncio.run(deregister_workers(config.redis_url, namespace, lost_rows))
    if stopping:
        records.settle_stopped(deployment_id)
        return
    from studio.workflows.deployments.service import start

    start(deployment_id)


def describe(rehomed: Rehomed) -> dict[str, Any]:
    return {"lost_nodes": list(rehomed.lost_nodes), "lost_workers": list(rehomed.lost_workers),
            "placement": rehomed.placement.to_list(), "unplaced": [r.message for r in rehomed.unplaced]}
