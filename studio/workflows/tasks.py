"""Celery tasks of the distributed mode (`OMNIFLOW_DISPATCH=celery`).

All take ids, are idempotent, and retry only on transient errors (the database or Redis
unreachable for a moment); anything else is recorded on the row and not retried.

* `execute_run(run_id)` executes one stored run in the worker through the same seam as
  the embedded mode (`runs.execution.execute_run`), storing events in the database and
  publishing them on the channel layer; a run of a deployment goes to the deployment's
  role workers through its registry namespace in Redis. Claiming makes it idempotent: a
  redelivered task finds the run no longer pending and does nothing. The task holds the
  run's lease while it executes (`runs.lease`) and cancels the run when asked to.
* Every Celery worker consuming the run queue sweeps the runs every half lease period (a
  thread in each process that executes tasks: the solo worker, or each child of a prefork
  pool): a run whose lease lapsed (its worker was killed) is executed again once or failed
  (`runs.recovery.sweep_expired`). No beat process is needed: the run workers a deployment
  has anyway do it, and any one of them is enough.
* `deploy(deployment_id)` and `stop_deployment(deployment_id)` are sent to the queue
  `node.<node>` of the node the deployment is placed on; that node's Celery worker
  (`celery -A studio worker -Q node.<OMNIFLOW_NODE>`) starts or stops the role workers
  there (`NodeAgent`). Deploying reconciles the workers with the replica counts, so a
  redelivered or repeated task changes nothing, and scaling is deploying again.
* A node's Celery worker announces its node (resources, labels, free capacity) in the node
  directory from `worker_ready` on (`deployments.announce`); deployments are placed over the
  live nodes, and `deploy`/`stop_deployment` go to each node with a share.
* `supervise_node(node)`: a node's Celery worker sends it to its own queue every
  OMNIFLOW_NODE_SUPERVISE_S (from `worker_ready` on, unless OMNIFLOW_WORKER_RESTART=0); it
  places the replicas of lost nodes again (`deployments.failover`; lost: heartbeat lapsed, never
  merely absent from a flushed Redis, `deployments.liveness`), fences again the lost workers
  whose fences a Redis flush or restart took (`failover.restore_fences`), stops workers this node
  ran while it was lost (`NodeAgent.reap`), and
  reconciles the node's running deployments, so a worker that died is marked lost, taken off
  the registry and replaced (a tensor-parallel replica whole), as the embedded mode's
  supervising `LocalCluster` does, with the same `RestartPolicy`: replicas lost in a row
  before staying up a minute (or never up) double the wait before the next replacement, and
  more than OMNIFLOW_WORKER_MAX_RESTARTS of them stop the replacing, said on the deployment,
  until a replica lasts (deploying again still reconciles at once).
* `remove_run_folders(node, run_ids)`: sent to `node.<node>` when runs that node ran are
  deleted; it removes their output folders from the node's data dir (`runs.folders`). A node
  also removes whatever it was owed while lost: at its start (`worker_ready` sends it the task
  for everything) and on the `supervise_node` ticks that look for lost nodes.

Short read-only requests to a node (a file a run wrote there, `runs.nodefiles`) are no tasks: a
solo worker would run them only after whatever deploy it is running. From `worker_ready` on, a
node's Celery worker answers them on threads of its own (`deployments.queries.QueryServer`).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import itertools
import logging
import threading
from typing import Any

import kombu.exceptions
import redis.exceptions
from asgiref.sync import async_to_sync
from celery import current_app, shared_task
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool
from celery.signals import worker_process_init, worker_process_shutdown, worker_ready, worker_shutdown
from django.db import DatabaseError, InterfaceError, OperationalError, connections
from django.utils import timezone

from engine.client.cluster import RegistryUnavailableError
from engine.client.workers import LaunchError, RestartPolicy
from engine.spec.userfiles import UsersRoot
from studio.config import Dispatch
from studio.workflows.apps import engine
from studio.workflows.deployments import failover, records
from studio.workflows.deployments.announce import NodeAnnouncer
from studio.workflows.deployments.node import NodeAgent, node_queue
from studio.workflows.deployments.queries import QueryServer
from studio.workflows.deployments.reach import NamespaceExecutors
from studio.workflows.models import DeploymentStatus
from studio.workflows.runs import folders, nodefiles, recovery
from studio.workflows.runs.bus import ChannelLayerRunEventBus
from studio.workflows.runs.execution import execute_standalone
from studio.workflows.runs.lease import LeaseKeeper, LeaseLost, LeaseTerms, executor_id
from studio.workflows.runs.metrics import RunMetrics
from studio.workflows.runs.recovery import Swept
from studio.workflows.runs.store import ThreadedRunStore

log = logging.getLogger(__name__)

TRANSIENT = (OperationalError, InterfaceError, RegistryUnavailableError, redis.exceptions.ConnectionError,
             redis.exceptions.TimeoutError)
_ENDED = (DeploymentStatus.STOPPING, DeploymentStatus.STOPPED)
_GAVE_UP = "no longer replaces them"
_REPLACING_FAILED = "replacing lost workers failed"


LEASE_LOST = "lease-lost"
"""What `execute_run` returns when the run's lease was taken over while it executed here."""


async def _execute(run_id: str, owner: str) -> str | None:
    eng = engine()
    executors = NamespaceExecutors(eng.kinds, eng.config.redis_url, max_namespaces=1,
                                   prompt_tokenizer=eng.prompt_tokenizer)
    store = ThreadedRunStore(None, LeaseTerms(owner, eng.config.run_lease_s))
    keeper = LeaseKeeper(store, store.lease)
    try:
        status = await execute_standalone(run_id, kinds=eng.kinds, ops=eng.ops, store=store, bus=ChannelLayerRunEventBus(),
                                          metrics=RunMetrics(), executors=executors, keeper=keeper,
                                          users=UsersRoot(eng.config.users_root))
    except (LeaseLost, asyncio.CancelledError):  # the lease lapsed and the run was taken over: stop here
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            task.uncancel()  # the keeper's cancel of this task is handled: the clean-up below may await
        log.warning("run %s: no longer held by %s; stopped without finishing it", run_id, owner)
        return LEASE_LOST
    finally:
        await keeper.aclose()
        await executors.aclose()
    return None if status is None else str(status)


@shared_task(name="omniflow.execute_run", bind=True, acks_late=True,
             autoretry_for=(OperationalError, InterfaceError), retry_backoff=True, max_retries=5)
def execute_run(self, run_id: str) -> str | None:
    return asyncio.run(_execute(run_id, executor_id(f"celery-{self.request.id}")))


def sweep_runs() -> list[Swept]:
    """Restart or end the runs whose executor stopped (`recovery.sweep_expired`), publish what
    that stored, and dispatch the restarted ones again."""
    config = engine().config
    swept = recovery.sweep_expired(config.run_lease_retries)
    bus = ChannelLayerRunEventBus()
    for one in swept:
        async_to_sync(bus.publish)(one.run_id, one.events)
        if one.restarted:
            execute_run.apply_async(args=[one.run_id], queue=config.run_queue)
    return swept


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
            records.set_status(deployment_id, DeploymentStatus.RUNNING, f"scaling failed on node {agent.node}: {exc}",
                               unless=_ENDED)
        else:
            agent.stop(deployment_id)
            if records.set_status(deployment_id, DeploymentStatus.FAILED, f"node {agent.node}: {exc}", unless=_ENDED):
                _stop_elsewhere(deployment_id, agent.node)  # the other nodes' shares end with it
        return {"failed": str(exc)}
    # Running once every node's share is up; a stop (or another node's failure) meanwhile ends ours.
    if not records.settle_started(deployment_id):
        agent.stop(deployment_id)
    return {"started": done.started, "stopped": done.stopped, "lost": done.lost}


def _stop_elsewhere(deployment_id: str, here: str) -> None:
    from studio.workflows.deployments.service import involved_nodes

    for node in involved_nodes(deployment_id):
        if node != here:
            stop_deployment.apply_async(args=[deployment_id], queue=node_queue(node))


@shared_task(name="omniflow.stop_deployment", bind=True, acks_late=True, autoretry_for=TRANSIENT,
             retry_backoff=True, max_retries=5)
def stop_deployment(self, deployment_id: str) -> list[str]:
    """Stop the deployment's workers on this node; the last node to stop its share marks it
    stopped (`records.settle_stopped`)."""
    stopped = NodeAgent(engine().config).stop(deployment_id)
    records.settle_stopped(deployment_id)
    return stopped


@shared_task(name="omniflow.remove_run_folders", ignore_result=True, acks_late=True,
             autoretry_for=(OperationalError, InterfaceError), retry_backoff=True, max_retries=5)
def remove_run_folders(node: str, run_ids: list[str] | None = None) -> list[str]:
    """Remove the output folders this node owes of the deleted runs `run_ids` (None: of every run it
    owes); `folders.BadRunIds` (not retried) when any id is not a run id. The ids of the runs done."""
    config = engine().config
    if node != config.node_name:  # a message for another node's queue: not ours to act on
        log.warning("remove_run_folders(%r) reached node %r; ignored", node, config.node_name)
        return []
    checked = None if run_ids is None else folders.parse_run_ids(run_ids)
    return folders.remove_owed(config.users_root, node, checked)


@shared_task(name="omniflow.supervise_node", ignore_result=True)
def supervise_node(node: str, nodes: bool = True) -> dict[str, Any]:
    """Replace the lost workers of the running deployments on this node (see the module docstring);
    with `nodes`, first place the replicas of lost nodes again and stop what this node runs but no
    longer owns. What it did, by deployment."""
    config = engine().config
    if node != config.node_name:  # a message for another node's queue: not ours to act on
        log.warning("supervise_node(%r) reached node %r; ignored", node, config.node_name)
        return {}
    agent = NodeAgent(config)
    policy = config.restart_policy
    done: dict[str, Any] = {}
    if nodes:
        try:
            for rehomed in failover.sweep(config):  # replicas of lost nodes, placed again
                done[rehomed.deployment_id] = failover.describe(rehomed)
            restored = failover.restore_fences(config)  # tombstones a Redis flush took, from the rows
            reaped = agent.reap()  # what this node ran while it was lost, and no longer owns
        except (DatabaseError, redis.exceptions.RedisError, OSError) as exc:
            log.warning("node %s: placing the replicas of lost nodes failed (next tick retries): %s", node, exc)
            restored, reaped = {}, []
        if restored:
            done["fences_restored"] = restored
        if reaped:
            done["reaped"] = reaped
        try:
            removed = folders.remove_owed(config.users_root, node)  # deleted runs' folders, owed while lost
        except DatabaseError as exc:
            log.warning("node %s: removing the folders of deleted runs failed (next tick retries): %s", node, exc)
            removed = []
        if removed:
            done["removed_run_folders"] = removed
    for deployment_id in records.running_on(node):
        try:
            result = _supervise_deployment(agent, policy, deployment_id)
        except Exception:  # one deployment's trouble (Redis away, say) must not stop the others'
            log.exception("supervising deployment %s on %s failed; trying again next time", deployment_id, node)
            continue
        if result is not None:
            done[deployment_id] = result
    return done


def _supervise_deployment(agent: NodeAgent, policy: RestartPolicy, deployment_id: str) -> dict[str, Any] | None:
    ticket = records.ticket(deployment_id)
    if ticket is None or ticket.status != DeploymentStatus.RUNNING:
        return None
    scan = agent.sweep(ticket)
    error = records.error_of(deployment_id)
    if policy.max_restarts == 0:
        if scan.lost:
            records.set_status(deployment_id, DeploymentStatus.RUNNING, f"{len(scan.lost)} workers lost: node {agent.node}"
                               f" {_GAVE_UP} (OMNIFLOW_WORKER_MAX_RESTARTS=0)", unless=_ENDED)
        return None
    # Each role on its own, as each replica place of the embedded mode: one role's crash loop
    # neither holds back nor gives up another's replacements.
    start: set[str] = set()
    gave_up: list[str] = []
    now = timezone.now()
    for role in ticket.spec.roles:
        streak, latest = records.loss_streak(deployment_id, agent.node, role.name, policy.healthy_after_s)
        if policy.max_restarts is not None and streak > policy.max_restarts:
            gave_up.append(f"role {role.name!r}: {streak} replicas in a row were lost within"
                           f" {policy.healthy_after_s:g} s of starting")
        elif latest is None or now - latest >= datetime.timedelta(seconds=policy.delay_s(streak - 1)):
            start.add(role.name)  # else backing off
    if gave_up:
        given_up = f"{'; '.join(gave_up)}: node {agent.node} {_GAVE_UP} (deploy again to retry)"
        if error != given_up:
            records.set_status(deployment_id, DeploymentStatus.RUNNING, given_up, unless=_ENDED)
    try:
        # From this sweep: a worker lost after it is counted (and replaced, or not) next time.
        result = agent.reconcile(ticket, start_roles=start, scan=scan)
    except LaunchError as exc:
        log.warning("deployment %s: replacing lost workers on %s failed: %s", deployment_id, agent.node, exc)
        records.set_status(deployment_id, DeploymentStatus.RUNNING, f"{_REPLACING_FAILED}: {exc}", unless=_ENDED)
        return {"failed": str(exc)}
    if not result.started and not result.lost:
        return None
    log.warning("deployment %s: lost %s on %s; started %s", deployment_id, result.lost, agent.node, result.started)
    if not gave_up and (error.startswith(_REPLACING_FAILED) or _GAVE_UP in error):
        records.set_status(deployment_id, DeploymentStatus.RUNNING, "", unless=_ENDED)  # replacing works again
    return {"started": result.started, "stopped": result.stopped, "lost": result.lost}


def _sweep_every_half_lease(stopping: Any) -> None:
    """Start the thread that calls `sweep_runs` every half lease period; `stopping` (a Celery
    signal) ends it."""
    interval = engine().config.run_lease_s / 2
    stopped = threading.Event()

    def tick() -> None:
        try:
            while not stopped.wait(interval):
                try:
                    sweep_runs()
                except (DatabaseError, redis.exceptions.RedisError, OSError) as exc:
                    log.warning("sweeping runs with lapsed leases failed (next try in %.1f s): %s", interval, exc)
        finally:
            connections.close_all()

    threading.Thread(target=tick, name="omniflow-run-sweep", daemon=True).start()
    stopping.connect(lambda **_: stopped.set(), weak=False)
    log.info("sweeping runs with lapsed leases every %.1f s", interval)


def _sweeps(queues: Any) -> bool:
    config = engine().config
    return config.dispatch is Dispatch.CELERY and config.run_queue in queues


@worker_ready.connect
def _sweep_runs(sender: Any, **_: Any) -> None:
    """A Celery worker of the run queue sweeps (see the module docstring). A forking pool's
    children do it (`_sweep_runs_in_child`), never its parent: a database connection pool the
    parent opened would be inherited, sockets and all, by every child it forks later."""
    if isinstance(sender.pool, PreforkPool | SoloPool) or not _sweeps({q.name for q in sender.task_consumer.queues}):
        return  # those pools start the sweep in `_sweep_runs_in_child`
    _sweep_every_half_lease(worker_shutdown)


@worker_process_init.connect
def _sweep_runs_in_child(**_: Any) -> None:
    """Each process that executes tasks: a prefork child, or the solo pool's one process."""
    if _sweeps(set(current_app.amqp.queues.consume_from)):
        _sweep_every_half_lease(worker_process_shutdown)


@worker_ready.connect
def _supervise_this_node(sender: Any, **_: Any) -> None:
    """In a node's Celery worker (one that consumes `node.<OMNIFLOW_NODE>`): send `supervise_node`
    to that queue every OMNIFLOW_NODE_SUPERVISE_S until the worker shuts down. Each message
    expires after one interval, so a backlog behind a long deploy does not pile up."""
    config = engine().config
    queue = node_queue(config.node_name)
    consumed = {q.name for q in sender.task_consumer.queues}
    if config.dispatch is not Dispatch.CELERY or queue not in consumed:
        return
    # Its queries answered beside the tasks (a solo pool runs one at a time), from before the node
    # is announced: a file a run writes on it can be fetched as soon as a run can be placed there.
    assert config.redis_url is not None, "the distributed mode has REDIS_URL (studio.config)"
    queries = QueryServer(config.redis_url, config.redis_prefix, config.node_name,
                          {nodefiles.UserFileQuery: functools.partial(nodefiles.serve, config)})
    queries.start()
    worker_shutdown.connect(lambda **_: queries.stop(), weak=False)
    # The node in the node directory, with its resources and labels, until the worker shuts down.
    announcer = NodeAnnouncer(config)
    announcer.start()
    worker_shutdown.connect(lambda **_: announcer.stop(), weak=False)
    try:  # what it was owed while it was away: the folders of runs deleted meanwhile
        remove_run_folders.apply_async(args=[config.node_name], queue=queue)
    except (kombu.exceptions.OperationalError, OSError) as exc:  # the broker away: the supervise ticks do it
        log.warning("sending remove_run_folders to %s failed: %s", queue, exc)
    if not config.worker_restart:
        return
    stopped = threading.Event()
    interval = config.node_supervise_s

    # Lost nodes are looked for every quarter of their lease (and at least every tick): often
    # enough to act within two leases, without reading the node directory many times a second.
    every = max(1, int(config.node.ttl_s / 4 / interval))
    ticks = itertools.count()

    def tick() -> None:
        while not stopped.wait(interval):
            try:
                supervise_node.apply_async(args=[config.node_name, next(ticks) % every == 0], queue=queue,
                                           expires=interval)
            except (kombu.exceptions.OperationalError, OSError) as exc:  # the broker is away: the next tick retries
                log.warning("sending supervise_node to %s failed: %s", queue, exc)

    threading.Thread(target=tick, name="omniflow-node-supervise", daemon=True).start()
    worker_shutdown.connect(lambda **_: stopped.set(), weak=False)
    log.info("node %s: replacing lost workers every %.1f s", config.node_name, interval)
