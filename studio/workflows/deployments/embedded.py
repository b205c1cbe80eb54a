"""Deployments hosted by the studio process itself (the embedded mode).

`EmbeddedDeployments` keeps, per deployment, a `LocalCluster` of role workers spawned
from this process (they exit with it) and a `WorkerPlane` over its registry, whose
`Executor` sends the deployment's runs to them. Workers register in Redis under the deployment's
namespace when REDIS_URL is set (so their heartbeats carry metrics, other processes reach
them, and workers on other machines can join); otherwise in an in-process registry
filled from their READY lines (no load metrics then: nothing heartbeats into it).

The hosted deployments' clusters seat their replicas on one `GpuPool`, the GPUs of this machine
as a node agent here would announce them (`announce.machine`: `nvidia-smi`, or
`OMNIFLOW_NODE_GPUS`), so two deployments never get the same GPU (`engine.flow.gpus`).

A hosted deployment's cluster supervises its workers (unless OMNIFLOW_WORKER_RESTART=0): a
worker that ends unasked is marked lost and a replacement takes its place, with its own row.

The worker rows follow each replica as it comes up (the cluster's `WorkerLaunch` steps): starting
once its process is spawned (with host and pid), ready once registered (with its follower ranks),
failed with the reason when it did not come up, stopped when its start was abandoned: a stop
that comes while a deployment's workers first start cancels that start (`undeploy`) rather than
waiting for it.

Every coroutine runs on the engine loop of the process's `RunService`, which owns this
object (`RunService.call`); `deploy`/`undeploy` also write the deployment's status and
worker rows. It is the `ExecutorSource` of runs submitted against a deployment: its own
deployments first, then any other reachable through the shared registry.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django.db import close_old_connections, connections

from engine.client.cluster import RegistryError, WorkerSnapshot
from engine.client.plane import PromptTokenizer, WorkerPlane
from engine.client.runs import Executor
from engine.client.workers import (
    GpuPool,
    LaunchedWorker,
    LaunchError,
    LaunchState,
    LocalCluster,
    ReplicaEvent,
    ReplicaEventKind,
    WorkerLaunch,
)
from engine.spec.kinds import KindRegistry
from studio.config import StudioConfig
from studio.workflows.deployments import records
from studio.workflows.deployments.announce import machine
from studio.workflows.deployments.reach import NamespaceExecutors
from studio.workflows.deployments.records import DeploymentTicket, FailedStart, StartedWorker, StartingWorker
from studio.workflows.models import DeploymentStatus, WorkerStatus
from studio.workflows.runs.execution import DeploymentUnavailable
from studio.workflows.runs.store import RunTicket

log = logging.getLogger(__name__)

_T = TypeVar("_T")
STOP_TIMEOUT_S = 10.0
_ENDED = (DeploymentStatus.STOPPING, DeploymentStatus.STOPPED)


@dataclass(slots=True)
class _Hosted:
    deployment_id: str
    namespace: str
    cluster: LocalCluster
    plane: WorkerPlane
    """Over the cluster's registry (which the cluster closes), with this process's seat on the
    deployment's worker plane (its keys)."""
    next_index: dict[str, int] = field(default_factory=dict)


def _started(worker: LaunchedWorker, device: str) -> list[StartedWorker]:
    """The rows of one replica: its worker and, for a tensor-parallel role, its follower ranks
    (which have no endpoint: the executor reaches the replica through rank 0)."""
    return [StartedWorker(worker_id=w.worker_id, role=w.role, address=w.details["address"] if w.tp_rank == 0 else "",
                          host=w.details["host"], pid=w.details["pid"], device=device, gpus=w.gpus)
            for w in worker.processes]


class EmbeddedDeployments:
    def __init__(self, config: StudioConfig, kinds: KindRegistry, prompt_tokenizer: PromptTokenizer | None = None) -> None:
        self.config = config
        self.kinds = kinds
        self.prompt_tokenizer = prompt_tokenizer
        self.reach = NamespaceExecutors(kinds, config.redis_url, prompt_tokenizer=prompt_tokenizer)
        self._hosted: dict[str, _Hosted] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._starting: dict[str, asyncio.Task[Any]] = {}
        """Deployment id -> the deploy whose workers are first starting (`undeploy` cancels it)."""
        self._db: concurrent.futures.ThreadPoolExecutor | None = None
        self._gpus: GpuPool | None = None
        """This machine's GPUs, every hosted deployment's replicas seated on them."""

    # ------------------------------------------------------------------ database
    async def _orm(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        if self._db is None:
            self._db = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omniflow-deploy-db")

        def call() -> _T:
            close_old_connections()
            return fn(*args, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(self._db, call)

    def _lock(self, deployment_id: str) -> asyncio.Lock:
        return self._locks.setdefault(deployment_id, asyncio.Lock())

    def hosts(self, deployment_id: str) -> bool:
        return deployment_id in self._hosted

    async def settled(self, deployment_id: str) -> None:
        """Return once the deploy/undeploy of `deployment_id` handed to the loop before this
        call has finished (they hold the deployment's lock throughout)."""
        async with self._lock(deployment_id):
            pass

    # ------------------------------------------------------------ lifecycle (DB)
    async def deploy(self, deployment_id: str) -> None:
        """Bring the deployment's workers to its replica counts (start, or scale): idempotent.
        A stopping or stopped deployment is left alone; a failed start marks it failed."""
        async with self._lock(deployment_id):
            ticket = await self._orm(records.ticket, deployment_id)
            if ticket is None or ticket.status in (*_ENDED, DeploymentStatus.FAILED):
                return
            scaling = deployment_id in self._hosted
            if not scaling:
                await self._orm(records.set_status, deployment_id, DeploymentStatus.STARTING, unless=_ENDED)
            try:
                stopped = await self._reconcile(ticket, cancellable=not scaling)
            except LaunchError as exc:
                log.warning("deployment %s: workers failed to start: %s", deployment_id, exc)
                if scaling:  # what runs keeps serving
                    await self._orm(records.set_status, deployment_id, DeploymentStatus.RUNNING,
                                    f"scaling failed: {exc}", unless=_ENDED)
                    return
                await self._stop_hosted(deployment_id)
                await self._orm(records.stop_all_workers, deployment_id)
                await self._orm(records.set_status, deployment_id, DeploymentStatus.FAILED, str(exc), unless=_ENDED)
                return
            # The started workers' rows were written as they came up (`_launch`).
            await self._orm(records.set_worker_status, stopped, WorkerStatus.STOPPED)
            if not await self._orm(records.set_status, deployment_id, DeploymentStatus.RUNNING, unless=_ENDED):
                stopped = await self._stop_hosted(deployment_id)  # a stop came while the workers started
                await self._orm(records.set_worker_status, stopped, WorkerStatus.STOPPED)

    async def undeploy(self, deployment_id: str) -> None:
        """Stop the deployment's workers here and mark it stopped: idempotent. Workers still
        starting for its first start are abandoned (their rows say stopped)."""
        starting = self._starting.get(deployment_id)
        if starting is not None:
            starting.cancel()  # the deploy ends what it started and lets go of the lock
        async with self._lock(deployment_id):
            ticket = await self._orm(records.ticket, deployment_id)
            stopped = await self._stop_hosted(deployment_id)
            await self._orm(records.set_worker_status, stopped, WorkerStatus.STOPPED)
            if ticket is not None:
                await self._orm(records.stop_all_workers, deployment_id)
                await self.reach.forget(ticket.namespace)
                await self._orm(records.set_status, deployment_id, DeploymentStatus.STOPPED)
        self._locks.pop(deployment_id, None)

    # ---------------------------------------------------------------- processes
    async def _reconcile(self, ticket: DeploymentTicket, *, cancellable: bool) -> list[str]:
        """Start or retire replicas to the ticket's counts; the worker ids it stopped.
        `cancellable`: a first start, which `undeploy` may cancel meanwhile."""
        if not cancellable:
            return await self._reconcile_now(ticket)
        task = asyncio.current_task()
        assert task is not None  # on the engine loop
        self._starting[ticket.deployment_id] = task
        try:
            return await self._reconcile_now(ticket)
        finally:
            self._starting.pop(ticket.deployment_id, None)

    async def _reconcile_now(self, ticket: DeploymentTicket) -> list[str]:
        hosted = self._hosted.get(ticket.deployment_id)
        if hosted is None:
            if self._gpus is None:  # read once, when the first deployment starts (nvidia-smi, off the loop)
                _, gpus = await asyncio.to_thread(machine, self.config.node)
                self._gpus = GpuPool(len(gpus))
            cluster = LocalCluster(
                ticket.spec,
                allow_module_ops=self.config.allow_module_ops,
                users_root=self.config.users_root,
                registry_url=self.config.redis_url,
                namespace=ticket.namespace,
                keys=ticket.keys,
                ready_timeout_s=self.config.worker_ready_timeout_s,
                stop_timeout_s=STOP_TIMEOUT_S,
                restart=self.config.restart_policy if self.config.worker_restart else None,
                on_event=functools.partial(self._replica_event, ticket),
                on_launch=functools.partial(self._launch, ticket),
                listen=self.config.worker_listen,
                gpus=self._gpus,
            )
            try:
                await cluster.start()  # stops what it started when one worker fails, or when cancelled
            except asyncio.CancelledError:
                await cluster.stop()  # cancelled just as it finished starting: nothing may be left running
                raise
            plane = WorkerPlane.over(cluster.registry, ticket.keys, self.kinds, prompt_tokenizer=self.prompt_tokenizer)
            hosted = _Hosted(ticket.deployment_id, ticket.namespace, cluster, plane,
                             next_index={r.name: r.replicas for r in ticket.spec.roles})
            self._hosted[ticket.deployment_id] = hosted
            return []
        stopped: list[str] = []
        for role in ticket.spec.roles:
            mine = [w for w in hosted.cluster.workers if w.role == role.name]
            # A lost replica waiting for its replacement counts: the replacement is on its way.
            excess = len(mine) + hosted.cluster.restarting(role.name) - role.replicas
            for _ in range(-excess):
                index = hosted.next_index.get(role.name, 0)
                hosted.next_index[role.name] = index + 1
                await hosted.cluster.spawn(role.name, index)
            if excess > 0:
                excess -= await hosted.cluster.cancel_restarts(role.name, excess)
            for worker in mine[len(mine) - excess:] if excess > 0 else []:
                await hosted.cluster.retire(worker)  # it drains and deregisters; then its ranks stop
                stopped += [w.worker_id for w in worker.processes]
        return stopped

    async def _launch(self, ticket: DeploymentTicket, launch: WorkerLaunch) -> None:
        """A replica's row follows it as it comes up (a replacement's too, under its own id)."""
        device = ticket.spec.role(launch.role).device
        if launch.state is LaunchState.STARTING:
            await self._orm(records.starting_workers, ticket.deployment_id, [StartingWorker(
                worker_id=launch.worker_id, role=launch.role, host=launch.host, pid=launch.pid, device=device,
                gpus=launch.gpus)])
        elif launch.state is LaunchState.READY and launch.worker is not None:
            await self._orm(records.add_workers, ticket.deployment_id, _started(launch.worker, device))
        elif launch.state is LaunchState.FAILED:
            await self._orm(records.fail_starts, ticket.deployment_id, launch.host,
                            [FailedStart(launch.role, launch.worker_id, launch.error, launch.gpus)])
        elif launch.state is LaunchState.ABANDONED:
            await self._orm(records.set_worker_status, [launch.worker_id], WorkerStatus.STOPPED)

    async def _replica_event(self, ticket: DeploymentTicket, event: ReplicaEvent) -> None:
        """The worker rows follow the cluster's supervision: a lost replica's rows are marked
        lost (a replacement's rows follow its launch, `_launch`); a slot given up is said on the
        deployment."""
        if event.kind is ReplicaEventKind.LOST and event.worker is not None:
            await self._orm(records.set_worker_status, [w.worker_id for w in event.worker.processes],
                            WorkerStatus.LOST)
        elif event.kind is ReplicaEventKind.GAVE_UP:
            await self._orm(records.set_status, ticket.deployment_id, DeploymentStatus.RUNNING,
                            f"role {event.role!r} runs one replica short: worker {event.replaces} was lost and"
                            f" not replaced ({event.reason})", unless=(*_ENDED, DeploymentStatus.FAILED))

    async def _stop_hosted(self, deployment_id: str) -> list[str]:
        hosted = self._hosted.pop(deployment_id, None)
        if hosted is None:
            return []
        ids = [w.worker_id for worker in hosted.cluster.workers for w in worker.processes]
        await hosted.plane.aclose()
        await hosted.cluster.stop()
        return ids

    # ----------------------------------------------------------- ExecutorSource
    async def executor_for(self, ticket: RunTicket) -> Executor:
        assert ticket.deployment_id is not None
        hosted = self._hosted.get(ticket.deployment_id)
        if hosted is not None:
            return hosted.plane.executor
        if not self.reach.available:
            raise DeploymentUnavailable(f"deployment {ticket.deployment_id} is not running in this process")
        return await self.reach.executor_for(ticket)

    async def materialize(self, ticket: RunTicket, outputs: dict[str, Any]) -> dict[str, Any]:
        assert ticket.deployment_id is not None
        hosted = self._hosted.get(ticket.deployment_id)
        if hosted is not None:
            return await hosted.plane.pull_outputs(outputs)
        return await self.reach.materialize(ticket, outputs)

    # ------------------------------------------------------------------ workers
    async def snapshots(self, namespaces: dict[str, str]) -> dict[str, list[WorkerSnapshot]]:
        """Live workers per deployment (deployment id -> namespace given)."""
        out: dict[str, list[WorkerSnapshot]] = {}
        for deployment_id, namespace in namespaces.items():
            hosted = self._hosted.get(deployment_id)
            if hosted is not None:
                try:
                    out[deployment_id] = await hosted.cluster.registry.workers()
                except RegistryError as exc:
                    log.warning("listing the workers of deployment %s failed: %s", deployment_id, exc)
                    out[deployment_id] = []
            else:
                out[deployment_id] = await self.reach.snapshots(namespace)
        return out

    async def aclose(self) -> None:
        """Stop every hosted deployment's workers (their rows stay as they are: a restarted
        studio re-deploys them, see `studio.workflows.deployments.service`)."""
        for deployment_id in list(self._hosted):
            await self._stop_hosted(deployment_id)
        await self.reach.aclose()
        if self._db is not None:
            db, self._db = self._db, None
            await asyncio.get_running_loop().run_in_executor(db, connections.close_all)
            db.shutdown(wait=True)
