"""What the API does to deployments: create from a version, scale a role, stop.

Each writes the deployment's row first and, once the transaction commits, hands the
work to whatever hosts role workers in this configuration:

* `OMNIFLOW_DISPATCH=local` (embedded): this process's `EmbeddedDeployments`, on the
  engine loop (`LocalCluster`s of worker subprocesses);
* `OMNIFLOW_DISPATCH=celery` (distributed): the deployment is placed first (`placing`: each
  replica on a live node whose free resources and labels fit its role, or a 409 naming every
  role that fits nowhere, what it needs and the best node's free resources), then the Celery
  tasks `deploy` and `stop_deployment` go to the queue `node.<node>` of every node involved,
  whose Celery worker starts (or stops) its share of the role workers there (`NodeAgent`).

Scaling is "set the replica count (and place the new count, keeping the replicas that run),
then deploy again": deploying reconciles the workers with the counts, so every step is
idempotent; a node that no longer has a share stops what it had.

A deployment's `cache_scope` says whose runs share its caches: `user` (the default: each user's
runs are their own tenant) or `shared` (every user's runs of it are one tenant, e.g. for a public
system prompt). Only staff may make a deployment's users share a cache.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from engine.client.cluster import NodeDirectoryError, NodeRecord, Placement, PlacementError
from engine.client.keys import PlaneKeys
from engine.spec.graph import GraphSpec
from studio.config import Dispatch
from studio.errors import BadRequest, Conflict, Forbidden, Unavailable, Unprocessable
from studio.workflows import quotas
from studio.workflows.apps import engine
from studio.workflows.deployments import placing
from studio.workflows.deployments.node import node_queue
from studio.workflows.deployments.placing import DeploymentPlacement, NodeNotLive
from studio.workflows.deployments.records import LIVE_WORKER_STATUSES
from studio.workflows.models import (
    ACTIVE_DEPLOYMENT_STATUSES,
    MAX_DEPLOYMENT_NAME,
    CacheScope,
    Deployment,
    DeploymentStatus,
    Worker,
    WorkerStatus,
    WorkflowVersion,
    deployment_namespace,
)
from studio.workflows.operations import check_paths, check_spec_for_studio, read_spec

log = logging.getLogger(__name__)


def _checked_replicas(version: WorkflowVersion, given: dict[str, Any] | None) -> dict[str, int]:
    """Replica counts for every role: the spec's, overridden by `given` (checked)."""
    roles = {r["name"]: int(r.get("replicas", 1)) for r in version.spec.get("roles", [])}
    limit = engine().config.max_replicas
    problems = []
    for role, count in (given or {}).items():
        if role not in roles:
            problems.append({"field": f"replicas.{role}", "message": f"the workflow has no role {role!r}"
                             f" (roles: {sorted(roles) or 'none'})"})
        elif isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= limit:
            problems.append({"field": f"replicas.{role}",
                             "message": f"a replica count is an integer from 1 to {limit}, not {count!r}"})
    for role, count in roles.items():  # the spec is the user's too: its own counts meet the same cap
        if count > limit:
            problems.append({"field": f"roles.{role}.replicas", "role": role,
                             "message": f"the spec asks for {count} replicas of role {role!r}; this studio allows"
                             f" at most {limit} (OMNIFLOW_MAX_REPLICAS)"})
    if problems:
        raise BadRequest("invalid replicas", problems)
    return {**roles, **(given or {})}


def _checked_cache_scope(user: Any, scope: CacheScope) -> CacheScope:
    """Forbidden unless `user` may give a deployment `scope` (a shared one: staff only)."""
    if scope == CacheScope.SHARED and not user.is_staff:
        raise Forbidden("only staff may share a deployment's cache between its users",
                        [{"field": "cache_scope", "message": f"{scope.value!r} needs a staff account;"
                                                             f" yours may use {CacheScope.USER.value!r}"}])
    return scope


def _deployable(user: Any, version: WorkflowVersion) -> GraphSpec:
    """The version's spec, checked for deploying by `user`; Unprocessable when it cannot run here."""
    try:
        spec = read_spec(spec=version.spec)
    except BadRequest as exc:
        raise Unprocessable(f"version {version.number} of {version.workflow.name!r} is not a valid workflow",
                            exc.details) from None
    checked = check_spec_for_studio(spec)
    if not checked.valid:
        raise Unprocessable(f"version {version.number} of {version.workflow.name!r} cannot be deployed",
                            checked.issue_dicts())
    check_paths(user, checked.document, f"version {version.number} of {version.workflow.name!r} cannot be deployed")
    return spec


def _pin(node: str | None) -> str | None:
    """The node a deployment is pinned to: the one it names, else OMNIFLOW_DEPLOY_NODE (distributed
    mode); the embedded mode takes none."""
    eng = engine()
    if eng.config.dispatch is Dispatch.CELERY:
        return node or eng.config.deploy_node
    if node:
        raise BadRequest("this studio hosts deployments itself (OMNIFLOW_DISPATCH=local): give no node")
    return None


def _live_nodes() -> list[NodeRecord]:
    nodes = placing.directory(engine().config)
    try:
        return nodes.live()
    except NodeDirectoryError as exc:
        raise Unavailable(f"the node directory cannot be read: {exc}") from None
    finally:
        nodes.close()


def _place(spec: GraphSpec, counts: dict[str, int], *, only: str | None = None, exclude: Any = None,
           keep: Placement | None = None) -> Placement:
    """Where the replicas go (under the placement lock, until the transaction ends); Conflict
    naming every role that fits no live node."""
    placing.lock()
    try:
        return placing.plan(_live_nodes(), spec, counts, only=only, exclude=exclude, keep=keep)
    except PlacementError as exc:
        raise Conflict(placing.summary(exc), placing.refusal_details(exc)) from None
    except NodeNotLive as exc:
        raise Conflict(str(exc), [{"field": "node", "message": str(exc)}]) from None


def preview_placement(user: Any, version: WorkflowVersion, *, replicas: dict[str, Any] | None = None,
                      node: str | None = None) -> dict[str, Any]:
    """Where deploying `version` would put its replicas now (the deploy dialog shows it before
    the user confirms): `{"distributed", "placement", "refusals", "error", "nodes"}`. Nothing is
    reserved: a deployment created later is placed afresh."""
    spec = _deployable(user, version)
    counts = _checked_replicas(version, replicas)
    pin = _pin(node)
    if engine().config.dispatch is not Dispatch.CELERY:
        return {"distributed": False, "placement": [], "refusals": [], "error": "", "nodes": []}
    records = _live_nodes()
    body: dict[str, Any] = {"distributed": True, "placement": [], "refusals": [], "error": "",
                            "nodes": [r.name for r in records]}
    try:
        body["placement"] = placing.plan(records, spec, counts, only=pin).to_list()
    except PlacementError as exc:
        body["error"], body["refusals"] = placing.summary(exc), placing.refusal_details(exc)
    except NodeNotLive as exc:
        body["error"] = str(exc)
    return body


def _checked_name(name: str) -> str:
    """A deployment's name as given, or BadRequest naming what is wrong with it: it is the OpenAI
    model id of a chat deployment, so never one that reads as another deployment's id."""
    name = name.strip()
    try:
        uuid.UUID(name)
    except ValueError:
        return name
    raise BadRequest("a deployment's name must not read as a deployment id (a UUID)", [{"field": "name"}])


def _unique_name(user: Any, wanted: str, default: str) -> str:
    """The name a new deployment of `user` takes: `wanted`, which no live deployment of theirs may
    hold already (Conflict), or else `default` (the workflow's name), numbered `-2`, `-3` ... past
    the names their live deployments hold. Called with the user's row locked."""
    taken = _live_names(user)
    if wanted:
        if wanted in taken:
            raise Conflict(f"you have a live deployment named {wanted!r} already: choose another name or stop it",
                           [{"field": "name", "name": wanted}])
        return wanted
    return _next_free(default, taken)


def proposed_name(user: Any, default: str) -> str:
    """The name a deployment of `user` left unnamed would take now (what the deploy dialog proposes):
    only `user`'s own live deployments count, whoever else's a staff user sees."""
    return _next_free(default, _live_names(user))


def _live_names(user: Any) -> set[str]:
    return set(Deployment.objects.filter(owner=user, status__in=ACTIVE_DEPLOYMENT_STATUSES)
               .values_list("name", flat=True))


def _next_free(default: str, taken: set[str]) -> str:
    base = default[:MAX_DEPLOYMENT_NAME - 4]
    number = 1
    name = base
    while name in taken:
        number += 1
        name = f"{base}-{number}"
    return name


def create_deployment(user: Any, version: WorkflowVersion, *, replicas: dict[str, Any] | None = None,
                      name: str = "", node: str | None = None,
                      cache_scope: CacheScope = CacheScope.USER, start_workers: bool = True) -> Deployment:
    """Deploy a valid version; Unprocessable when it cannot run here, Forbidden when `user`
    may not give it `cache_scope`, Conflict when its replicas fit no live node (distributed).
    `start_workers=False` (embedded mode) only records it, pending: a process that is not the
    studio's (`manage.py setup_demo`) leaves the workers to the studio, which starts the pending
    deployments it hosts as it starts (`resume_embedded`)."""
    eng = engine()
    _checked_cache_scope(user, cache_scope)
    name = _checked_name(name)
    spec = _deployable(user, version)
    counts = _checked_replicas(version, replicas)
    pin = _pin(node)
    with transaction.atomic():
        quotas.lock_user(user)
        quotas.deployment_check(user, spec, counts, eng.config.quotas, model_dirs=eng.config.model_dirs).enforce()
        name = _unique_name(user, name, version.workflow.name)
        placed = DeploymentPlacement()
        if eng.config.dispatch is Dispatch.CELERY:
            placed = DeploymentPlacement(_place(spec, counts, only=pin))
        keys = PlaneKeys.generate()  # the deployment's worker plane: its workers and its dispatchers only
        nodes = placed.placement.nodes()
        deployment = Deployment.objects.create(owner=user, version=version, name=name, replicas=counts,
                                               node=nodes[0] if nodes else "", placement=placed.to_json(),
                                               cache_scope=cache_scope,
                                               plane_public=keys.public, plane_secret=keys.secret)
        deployment.namespace = deployment_namespace(eng.config.redis_prefix, deployment.pk)
        deployment.save(update_fields=["namespace"])
        if start_workers or eng.config.dispatch is Dispatch.CELERY:  # a node's agent hosts them
            transaction.on_commit(lambda: start(str(deployment.pk)))
    return deployment


def scale_deployment(deployment: Deployment, role: str, replicas: Any) -> Deployment:
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().select_related("version", "owner").get(pk=deployment.pk)
        if locked.status not in (DeploymentStatus.PENDING, DeploymentStatus.STARTING, DeploymentStatus.RUNNING):
            raise Conflict(f"deployment {locked.pk} is {locked.status}; only a running deployment scales")
        counts = _checked_replicas(locked.version, {**locked.replicas, role: replicas})
        quotas.lock_user(locked.owner)
        spec = read_spec(spec=locked.version.spec)
        config = engine().config
        quotas.deployment_check(locked.owner, spec, counts, config.quotas, model_dirs=config.model_dirs,
                                deployment=locked).enforce()
        fields = ["replicas", "updated_at"]
        current = DeploymentPlacement.of(locked.placement)
        if not current.empty:  # placed (distributed): the new count too, keeping the replicas that run
            placement = _place(spec, counts, exclude=locked.pk, keep=current.placement)
            locked.placement = DeploymentPlacement(placement, current.moved).to_json()
            locked.node = placement.nodes()[0] if placement.slots else locked.node
            fields += ["placement", "node"]
        locked.replicas = counts
        locked.save(update_fields=fields)
        transaction.on_commit(lambda: start(str(locked.pk)))
    return locked


def set_cache_scope(user: Any, deployment: Deployment, scope: CacheScope) -> Deployment:
    """Change whose runs share the deployment's caches (from the next run on; pages cached so far
    stay under the old scope's keys, so nothing cached before becomes visible to anyone new)."""
    _checked_cache_scope(user, scope)
    if deployment.cache_scope != scope:
        deployment.cache_scope = scope
        deployment.save(update_fields=["cache_scope", "updated_at"])
    return deployment


def stop_deployment(deployment: Deployment) -> Deployment:
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if locked.status == DeploymentStatus.STOPPED:
            return locked  # stopping twice is harmless
        if locked.status != DeploymentStatus.FAILED:
            locked.status = DeploymentStatus.STOPPING
            locked.save(update_fields=["status", "updated_at"])
        transaction.on_commit(lambda: stop(str(locked.pk), locked.node))
    return locked


def involved_nodes(deployment_id: Any) -> list[str]:
    """The nodes a deployment's tasks go to: those its placement names, those with its live
    workers (a share that went away), or its `node` (one placed before placements were kept)."""
    row = Deployment.objects.filter(pk=deployment_id).values_list("node", "placement").first()
    if row is None:
        return []
    node, raw = row
    nodes = set(DeploymentPlacement.of(raw).placement.nodes())
    nodes |= set(Worker.objects.filter(deployment_id=deployment_id, status__in=LIVE_WORKER_STATUSES)
                 .exclude(host="").values_list("host", flat=True))
    if not nodes and node:
        nodes.add(node)
    return sorted(nodes)


# ----------------------------------------------------------------------- hand-off
def _log_failure(what: str) -> Any:
    def done(future: Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.error("%s failed", what, exc_info=future.exception())

    return done


def start(deployment_id: str) -> None:
    """Start (or reconcile) a committed deployment's workers; returns at once."""
    eng = engine()
    if eng.config.dispatch is Dispatch.CELERY:
        from studio.workflows.tasks import deploy

        for node in involved_nodes(deployment_id):
            deploy.apply_async(args=[deployment_id], queue=node_queue(node))
        return
    eng.runs.call(eng.deployments.deploy(deployment_id)).add_done_callback(_log_failure(f"deploy {deployment_id}"))


def stop(deployment_id: str, node: str) -> None:
    eng = engine()
    if node and eng.config.dispatch is Dispatch.CELERY:
        from studio.workflows.tasks import stop_deployment as stop_task

        for each in involved_nodes(deployment_id):
            stop_task.apply_async(args=[deployment_id], queue=node_queue(each))
        return
    eng.runs.call(eng.deployments.undeploy(deployment_id)).add_done_callback(_log_failure(f"stop {deployment_id}"))


@dataclass(frozen=True, slots=True)
class Resumed:
    """The embedded deployments a process start took up (`resume_embedded`), by where they stood."""

    started: list[str]
    """Recorded but never started: pending, no worker of theirs ever recorded (`manage.py setup_demo`
    records the demo's chat deployment so, before the server starts). Starting them is the plan."""
    redeployed: list[str]
    """Deployments a previous studio process hosted (their workers exited with it), deployed again;
    those it was stopping, stopped."""


def resume_embedded() -> Resumed:
    """On a process start: start the embedded deployments recorded to start, and deploy again
    what a previous studio process hosted (its workers exited with it)."""
    if engine().config.dispatch is not Dispatch.LOCAL:
        return Resumed([], [])
    rows = list(Deployment.objects.filter(node="", status__in=ACTIVE_DEPLOYMENT_STATUSES).values_list("pk", "status"))
    hosted = set(Worker.objects.filter(deployment_id__in=[pk for pk, _ in rows]).values_list("deployment_id", flat=True))
    resumed = Resumed([], [])
    for pk, status in rows:
        deployment_id = str(pk)
        if status == DeploymentStatus.PENDING and pk not in hosted:
            resumed.started.append(deployment_id)
        else:
            resumed.redeployed.append(deployment_id)
        Worker.objects.filter(deployment_id=deployment_id).exclude(status__in=(WorkerStatus.STOPPED, WorkerStatus.FAILED)).update(
            status=WorkerStatus.LOST)
        if Deployment.objects.filter(pk=deployment_id, status=DeploymentStatus.STOPPING).exists():
            stop(deployment_id, "")
        else:
            Deployment.objects.filter(pk=deployment_id).update(status=DeploymentStatus.PENDING)
            start(deployment_id)
    return resumed
