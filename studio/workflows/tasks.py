"""Celery tasks of the distributed mode (`OMNIFLOW_DISPATCH=celery`).

All take ids, are idempotent, and retry only on transient errors (the database or Redis
unreachable for a moment); anything else is recorded on the row and not retried.

* `execute_run(run_id)` executes one stored run in the worker through the same seam as
  the embedded mode (`runs.execution.execute_run`), storing events in the database and
  publishing them on the channel layer; a run of a deployment goes to the deployment's
  role workers through its registry namespace in Redis. Claiming makes it idempotent: a
  redelivered task finds the run no longer pending and does nothing.
* `deploy(deployment_id)` and `stop_deployment(deployment_id)` are sent to the queue
  `node.<node>` of the node the deployment is placed on; that node's Celery worker
  (`celery -A studio worker -Q node.<OMNIFLOW_NODE>`) starts or stops the role workers
  there (`NodeAgent`). Deploying reconciles the workers with the replica counts, so a
  redelivered or repeated task changes nothing, and scaling is deploying again.
"""

from __future__ import annotations

import asyncio
import logging

import redis.exceptions
from celery import shared_task
from django.db import InterfaceError, OperationalError

from engine.flow.discovery import RegistryUnavailableError
from engine.worker.launcher import LaunchError
from studio.workflows.apps import engine
from studio.workflows.deployments import records
from studio.workflows.deployments.node import NodeAgent
from studio.workflows.deployments.reach import NamespaceExecutors
from studio.workflows.models import DeploymentStatus
from studio.workflows.runs.bus import ChannelLayerRunEventBus
from studio.workflows.runs.execution import execute_standalone
from studio.workflows.runs.metrics import RunMetrics
from studio.workflows.runs.store import ThreadedRunStore

log = logging.getLogger(__name__)

TRANSIENT = (OperationalError, InterfaceError, RegistryUnavailableError, redis.exceptions.ConnectionError,
             redis.exceptions.TimeoutError)
_ENDED = (DeploymentStatus.STOPPING, DeploymentStatus.STOPPED)


async def _execute(run_id: str) -> str | None:
    eng = engine()
    executors = NamespaceExecutors(eng.kinds, eng.config.redis_url, max_namespaces=1)
    try:
        status = await execute_standalone(run_id, kinds=eng.kinds, store=ThreadedRunStore(None),
                                          bus=ChannelLayerRunEventBus(), metrics=RunMetrics(), executors=executors)
    finally:
        await executors.aclose()
    return None if status is None else str(status)


@shared_task(name="omniflow.execute_run", bind=True, acks_late=True,
             autoretry_for=(OperationalError, InterfaceError), retry_backoff=True, max_retries=5)
def execute_run(self, run_id: str) -> str | None:
    return asyncio.run(_execute(run_id))


@shared_task(name="omniflow.deploy", bind=True, acks_late=True, autoretry_for=TRANSIENT, retry_backoff=True,
             max_retries=5)
def deploy(self, deployment_id: str) -> dict | None:
    """Reconcile the deployment's workers on this node; None when there is nothing to do."""
    ticket = records.ticket(deployment_id)
    if ticket is None or ticket.status in (*_ENDED, DeploymentStatus.FAILED):
        return None
    records.set_status(deployment_id, DeploymentStatus.STARTING, unless=(*_ENDED, DeploymentStatus.RUNNING))
    agent = NodeAgent(engine().config)
    try:
        done = agent.reconcile(ticket)
    except LaunchError as exc:
        log.warning("deployment %s: workers failed to start on %s: %s", deployment_id, agent.node, exc)
        if ticket.status == DeploymentStatus.RUNNING:  # scaling up failed: what runs keeps serving
            records.set_status(deployment_id, DeploymentStatus.RUNNING, f"scaling failed: {exc}", unless=_ENDED)
        else:
            agent.stop(deployment_id)
            records.set_status(deployment_id, DeploymentStatus.FAILED, str(exc), unless=_ENDED)
        return {"failed": str(exc)}
    if not records.set_status(deployment_id, DeploymentStatus.RUNNING, unless=_ENDED):
        agent.stop(deployment_id)  # a stop came while the workers started
    return {"started": done.started, "stopped": done.stopped, "lost": done.lost}


@shared_task(name="omniflow.stop_deployment", bind=True, acks_late=True, autoretry_for=TRANSIENT,
             retry_backoff=True, max_retries=5)
def stop_deployment(self, deployment_id: str) -> list[str]:
    """Stop the deployment's workers on this node and mark it stopped."""
    stopped = NodeAgent(engine().config).stop(deployment_id)
    records.set_status(deployment_id, DeploymentStatus.STOPPED)
    return stopped
