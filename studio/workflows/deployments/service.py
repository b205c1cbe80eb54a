"""What the API does to deployments: create from a version, scale a role, stop.

Each writes the deployment's row first and, once the transaction commits, hands the
work to whatever hosts role workers in this configuration:

* `OMNIFLOW_DISPATCH=local` (embedded): this process's `EmbeddedDeployments`, on the
  engine loop (`LocalCluster`s of worker subprocesses);
* `OMNIFLOW_DISPATCH=celery` (distributed): the Celery tasks `deploy` and
  `stop_deployment`, routed to the queue `node.<node>` of the node the deployment was
  placed on, whose Celery worker starts the role workers there (`NodeAgent`).

Scaling is "set the replica count, then deploy again": deploying reconciles the
workers with the counts, so every step is idempotent.

A deployment's `cache_scope` says whose runs share its caches: `user` (the default: each user's
runs are their own tenant) or `shared` (every user's runs of it are one tenant, e.g. for a public
system prompt). Only staff may make a deployment's users share a cache.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from django.db import transaction

from engine.data.curve import PlaneKeys
from studio.config import Dispatch
from studio.errors import BadRequest, Conflict, Forbidden, Unprocessable
from studio.workflows import quotas
from studio.workflows.apps import engine
from studio.workflows.deployments.node import node_queue
from studio.workflows.models import (
    ACTIVE_DEPLOYMENT_STATUSES,
    CacheScope,
    Deployment,
    DeploymentStatus,
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


def create_deployment(user: Any, version: WorkflowVersion, *, replicas: dict[str, Any] | None = None,
                      name: str = "", node: str | None = None,
                      cache_scope: CacheScope = CacheScope.USER) -> Deployment:
    """Deploy a valid version; Unprocessable when it cannot run here, Forbidden when `user`
    may not give it `cache_scope`."""
    eng = engine()
    _checked_cache_scope(user, cache_scope)
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
    counts = _checked_replicas(version, replicas)
    if eng.config.dispatch is Dispatch.CELERY:
        node = node or eng.config.deploy_node
    elif node:
        raise BadRequest("this studio hosts deployments itself (OMNIFLOW_DISPATCH=local): give no node")
    with transaction.atomic():
        quotas.lock_user(user)
        quotas.deployment_check(user, spec, counts, eng.config.quotas).enforce()
        keys = PlaneKeys.generate()  # the deployment's worker plane: its workers and its dispatchers only
        deployment = Deployment.objects.create(owner=user, version=version, name=name, replicas=counts,
                                               node=node or "", cache_scope=cache_scope,
                                               plane_public=keys.public, plane_secret=keys.secret)
        deployment.namespace = deployment_namespace(eng.config.redis_prefix, deployment.pk)
        deployment.save(update_fields=["namespace"])
        transaction.on_commit(lambda: start(str(deployment.pk)))
    return deployment


def scale_deployment(deployment: Deployment, role: str, replicas: Any) -> Deployment:
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().select_related("version", "owner").get(pk=deployment.pk)
        if locked.status not in (DeploymentStatus.PENDING, DeploymentStatus.STARTING, DeploymentStatus.RUNNING):
            raise Conflict(f"deployment {locked.pk} is {locked.status}; only a running deployment scales")
        counts = _checked_replicas(locked.version, {**locked.replicas, role: replicas})
        quotas.lock_user(locked.owner)
        quotas.deployment_check(locked.owner, read_spec(spec=locked.version.spec), counts, engine().config.quotas,
                                deployment=locked).enforce()
        locked.replicas = counts
        locked.save(update_fields=["replicas", "updated_at"])
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

        node = Deployment.objects.filter(pk=deployment_id).values_list("node", flat=True).first()
        if node is not None:
            deploy.apply_async(args=[deployment_id], queue=node_queue(node))
        return
    eng.runs.call(eng.deployments.deploy(deployment_id)).add_done_callback(_log_failure(f"deploy {deployment_id}"))


def stop(deployment_id: str, node: str) -> None:
    eng = engine()
    if node and eng.config.dispatch is Dispatch.CELERY:
        from studio.workflows.tasks import stop_deployment as stop_task

        stop_task.apply_async(args=[deployment_id], queue=node_queue(node))
        return
    eng.runs.call(eng.deployments.undeploy(deployment_id)).add_done_callback(_log_failure(f"stop {deployment_id}"))


def resume_embedded() -> list[str]:
    """On a process start: deploy again what a previous studio process hosted (its workers
    exited with it). Returns the deployment ids."""
    if engine().config.dispatch is not Dispatch.LOCAL:
        return []
    from studio.workflows.models import Worker, WorkerStatus

    ids = [str(pk) for pk in Deployment.objects.filter(node="", status__in=ACTIVE_DEPLOYMENT_STATUSES)
           .values_list("pk", flat=True)]
    for deployment_id in ids:
        Worker.objects.filter(deployment_id=deployment_id).exclude(status=WorkerStatus.STOPPED).update(
            status=WorkerStatus.LOST)
        if Deployment.objects.filter(pk=deployment_id, status=DeploymentStatus.STOPPING).exists():
            stop(deployment_id, "")
        else:
            Deployment.objects.filter(pk=deployment_id).update(status=DeploymentStatus.PENDING)
            start(deployment_id)
    return ids
