"""The node agent of the distributed mode: a node's Celery worker (queue `node.<name>`)
starts and stops the role workers of the deployments placed on that node. It runs one task at a
time (`-P solo`); what the studio only reads on the node it asks the agent's query threads instead,
which answer beside those tasks (`deployments.queries`).

Role workers are `python -m engine.worker` processes in a session of their own, so they
outlive the task that started them (and a restart of the Celery worker): each registers
in Redis under the deployment's namespace and heartbeats there; its output goes to a log
file under `<data dir>/deployments/<id>/`, and it reads the deployment's CURVE keys from
`<data dir>/deployments/<id>/keys/` (written there from the deployment's row, private to
this user, removed when the deployment stops here). A worker row records its pid and the node
(`Worker.host`), so `reconcile` and `stop` find them again: a row whose process is gone
(or whose pid now runs something else) is marked lost. Readiness is the registration
seen in Redis, never a sleep. The rows follow the workers as they come up: starting once
their processes are spawned, ready once registered, failed (with the reason) when a start
did not come up.

Both operations are idempotent: `reconcile` starts what is missing and stops what is
beyond this node's share of the replicas (the deployment's placement: `DeploymentTicket.share`);
`stop` ends whatever is left. `reap` ends workers whose rows were marked lost or stopped while
the node was away (a node that comes back stops what it no longer owns): those lost ones that
still reached Redis were fenced there and have stopped themselves already
(`studio.workflows.deployments.failover`); it ends those that could not.

Its workers get the node's host identity (`OMNIFLOW_HOST_ID`, default `node:<name>`): they use
shared memory and local streams among themselves, TCP with every other peer.

A replica of a role with `tp_size` N > 1 is N processes, its tensor-parallel ranks: rank 0
registers (it does so only once every other rank has joined it), ranks 1.. are rows whose
ids are `rank_worker_id(rank 0's id, rank)`. A replica with a rank gone is lost as a whole
(what is left of it is stopped, and reconcile starts a fresh one).

GPUs: each slot of the placement names the node's GPUs its replica gets (`engine.flow.gpus`).
A replica is started on a slot no live replica of its role holds, its processes with
`CUDA_VISIBLE_DEVICES` (and `CUDA_DEVICE_ORDER=PCI_BUS_ID`) naming those GPUs; each row records
the GPUs of its rank (`Worker.gpus`). A live replica whose GPUs no slot names any more is
stopped (and one started on the slot's). A replica holding no GPUs (its role asks for none)
gets no `CUDA_VISIBLE_DEVICES`: it inherits the agent's environment, since a CPU role may still
open a GPU peer's tensors over CUDA IPC. A deployment placed before placements were kept gets
no GPUs named.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from engine.client.cluster import RegistryError, deregister_workers, make_registry
from engine.client.workers import (
    HOST_ID_ENV,
    LaunchError,
    WorkerOptions,
    leader_worker_id,
    replica_processes,
    start_failure,
)
from engine.spec.graph import encode_spec
from studio.config import StudioConfig
from studio.workflows.deployments import records
from studio.workflows.deployments.records import (
    DeploymentTicket,
    FailedStart,
    ReplicaStart,
    StartedWorker,
    StartingWorker,
)
from studio.workflows.models import Worker, WorkerStatus

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
REGISTRY_TTL_S = 2.0
STOP_TIMEOUT_S = 15.0
_READY_POLL_S = 0.05
_LOG_READ_BYTES = 64 << 10
"""How much of a worker's log end is searched for why it could not start."""


def node_queue(node: str) -> str:
    """The Celery queue a node's worker consumes for its deployments."""
    return f"node.{node}"


@dataclass(frozen=True, slots=True)
class _Replica:
    """One replica's live rows and processes: rank 0 first, then its follower ranks."""

    members: list[tuple[Worker, psutil.Process]]

    @property
    def gpus(self) -> tuple[int, ...]:
        """Every GPU its ranks hold, in index order."""
        return tuple(sorted(g for row, _ in self.members for g in row.gpus))


@dataclass(frozen=True, slots=True)
class Scan:
    """A deployment's workers on this node as `NodeAgent.sweep` found them."""

    replicas: dict[str, list[_Replica]]
    """The live replicas per role."""
    lost: list[str]
    """The ids of the rows it marked lost."""


@dataclass(frozen=True, slots=True)
class Reconciled:
    started: list[str]
    stopped: list[str]
    lost: list[str]


def _process_of(row: Worker) -> psutil.Process | None:
    """The live process of a worker row, if its pid still runs that worker."""
    if row.pid is None:
        return None
    try:
        process = psutil.Process(row.pid)
        # The worker retitles itself (`omniflow-worker ... id=<worker id> ...`); its id is in there either way.
        if process.status() == psutil.STATUS_ZOMBIE or row.worker_id not in " ".join(process.cmdline()):
            return None
        return process
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _terminate(processes: list[psutil.Process], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM (the worker drains and deregisters), then SIGKILL what is left."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=5)


def _exited(worker_id: str, code: int, log_path: Path) -> str:
    """Why a worker exited before it registered: its FAILED line's reason first, when it printed
    one, then the end of its log (its traceback)."""
    with log_path.open("rb") as f:
        f.seek(max(0, log_path.stat().st_size - _LOG_READ_BYTES))
        output = f.read().decode(errors="replace")
    reason = start_failure(output)
    return (f"worker {worker_id} exited with status {code} before it registered"
            f"{f': {reason}' if reason else ''}:\n{output[-2000:]}")


class NodeAgent:
    """Role workers of deployments on this node (`config.node_name`)."""

    def __init__(self, config: StudioConfig) -> None:
        if config.redis_url is None:
            raise RuntimeError("the node agent needs REDIS_URL: its workers register there")
        self.config = config
        self.registry_url: str = config.redis_url
        self.node = config.node_name

    def _dir(self, deployment_id: str) -> Path:
        return self.config.data_dir / "deployments" / deployment_id

    def _live(self, deployment_id: str) -> tuple[list[tuple[Worker, psutil.Process]], list[str]]:
        live, lost = [], []
        for row in records.live_workers(deployment_id, host=self.node):
            process = _process_of(row)
            if process is None:
                lost.append(row.worker_id)
            else:
                live.append((row, process))
        if lost:
            records.set_worker_status(lost, WorkerStatus.LOST)
        return live, lost

    def sweep(self, ticket: DeploymentTicket) -> Scan:
        """The live replicas per role (rank 0 first in each), and the rows it marked lost: those
        whose process is gone, and a tensor-parallel replica missing a rank, whole (its remaining
        ranks are ended). Lost workers leave the registry at once (else runs could go to them
        until their TTL ends)."""
        deployment_id, spec = ticket.deployment_id, ticket.spec
        live, lost = self._live(deployment_id)
        if lost:  # dead: off the registry before anything else (ending broken replicas may take a while)
            asyncio.run(deregister_workers(self.registry_url, ticket.namespace, lost))
        ranks: dict[str, list[tuple[Worker, psutil.Process]]] = {}
        for row, process in live:
            ranks.setdefault(leader_worker_id(row.worker_id) or row.worker_id, []).append((row, process))
        sizes = {r.name: r.tp_size for r in spec.roles}
        replicas: dict[str, list[_Replica]] = {}
        broken: list[tuple[Worker, psutil.Process]] = []
        for leader, members in ranks.items():
            members.sort(key=lambda m: m[0].worker_id != leader)
            role = members[0][0].role
            if members[0][0].worker_id != leader or len(members) != sizes.get(role, 1):
                broken += members
                continue
            replicas.setdefault(role, []).append(_Replica(members))
        if broken:
            ids = [row.worker_id for row, _ in broken]
            asyncio.run(deregister_workers(self.registry_url, ticket.namespace, ids))
            _terminate([p for _, p in broken])
            records.set_worker_status(ids, WorkerStatus.LOST)
            lost += ids
        return Scan(replicas, lost)

    def reconcile(self, ticket: DeploymentTicket, *, start_roles: set[str] | None = None,
                  scan: Scan | None = None) -> Reconciled:
        """Run exactly this node's share of the replicas (`ticket.share`) (starting missing ones
        only for `start_roles`, when given), from `scan` when given (one the caller decided
        `start_roles` on: a worker lost since is left for the next sweep), else from a fresh
        sweep; raises LaunchError (after stopping what it started) when a worker does not come up."""
        if scan is None:
            scan = self.sweep(ticket)
        replicas, lost = scan.replicas, scan.lost
        seats = self._seats(ticket)
        stop: list[_Replica] = []
        wanted: list[ReplicaStart] = []
        for role in ticket.spec.roles:
            free = list(seats.get(role.name, []))
            for replica in replicas.get(role.name, []):
                if replica.gpus in free:
                    free.remove(replica.gpus)
                else:  # beyond this node's share, or on GPUs no slot names any more
                    stop.append(replica)
            if start_roles is None or role.name in start_roles:
                wanted += [ReplicaStart(role.name, f"{role.name}-{self.node}-{uuid.uuid4().hex[:8]}", gpus)
                           for gpus in free]
        stopped = [row.worker_id for replica in stop for row, _ in replica.members]
        if stop:
            # Rank 0 first: it drains (and tells its followers to stop); then whatever is left.
            _terminate([replica.members[0][1] for replica in stop])
            _terminate([p for replica in stop for _, p in replica.members[1:]])
            records.set_worker_status(stopped, WorkerStatus.STOPPED)
        if wanted:
            try:
                started = self._start(ticket, wanted)
            except LaunchError as exc:
                # On record as failed at once, with why: supervision counts a replica that never came
                # up as a failed replacement, and backs off (`studio.workflows.tasks.supervise_node`).
                records.fail_starts(ticket.deployment_id, self.node,
                                    [FailedStart(w.role, w.worker_id, str(exc), w.gpus) for w in wanted])
                raise
            records.add_workers(ticket.deployment_id, started)
        return Reconciled(started=[w.worker_id for w in wanted], stopped=stopped, lost=lost)

    def _seats(self, ticket: DeploymentTicket) -> dict[str, list[tuple[int, ...]]]:
        """Role -> the GPUs of each of its replicas this node runs (sorted; none for a replica
        holding none, and for every replica of a deployment placed before slots were kept)."""
        if not ticket.placement.slots:
            return {role: [()] * count for role, count in ticket.share(self.node).items()}
        seats: dict[str, list[tuple[int, ...]]] = {}
        for slot in ticket.placement.on(self.node):
            seats.setdefault(slot.role, []).append(tuple(sorted(slot.gpus)))
        return seats

    def reap(self) -> list[str]:
        """End the workers on this node whose rows say they should not run (marked lost while the
        node was away, or stopped) but whose process still does: what a node that comes back no
        longer owns. Their ids."""
        ended = []
        for row in records.unowned_workers(self.node):
            process = _process_of(row)
            if process is not None:
                log.warning("node %s: worker %s (%s) is %s here but still runs; stopping it", self.node,
                            row.worker_id, row.role, row.status)
                _terminate([process])
                ended.append(row.worker_id)
        return ended

    def stop(self, deployment_id: str) -> list[str]:
        """End every worker of the deployment on this node; their ids."""
        live, _ = self._live(deployment_id)
        _terminate([p for row, p in live if leader_worker_id(row.worker_id) is None])
        _terminate([p for row, p in live if leader_worker_id(row.worker_id) is not None])
        ids = [row.worker_id for row, _ in live]
        records.set_worker_status(ids, WorkerStatus.STOPPED)
        shutil.rmtree(self._dir(deployment_id), ignore_errors=True)
        return ids

    # ---------------------------------------------------------------- spawning
    def _start(self, ticket: DeploymentTicket, wanted: list[ReplicaStart]) -> list[StartedWorker]:
        folder = self._dir(ticket.deployment_id)
        folder.mkdir(parents=True, exist_ok=True)
        spec_path = folder / "workflow.json"
        spec_path.write_bytes(encode_spec(ticket.spec))
        keys_dir = ticket.keys.write(folder / "keys")  # 0700, files 0600; removed with the folder on stop
        # The node's host identity: its workers use shared memory and local streams among themselves
        # and TCP with everyone else, even other nodes sharing this machine's /dev/shm and hostname.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)),
               HOST_ID_ENV: self.config.node.worker_host_id(self.node)}
        processes: dict[str, subprocess.Popen[bytes]] = {}
        gpus: dict[str, tuple[int, ...]] = {}  # each rank's own
        followers: dict[str, str] = {}  # follower rank's worker id -> role
        with contextlib.ExitStack() as undo:
            # A start that fails (or is cancelled) leaves none of its processes running.
            undo.callback(lambda: _terminate([psutil.Process(p.pid) for p in processes.values() if p.poll() is None]))
            options = WorkerOptions(workflow=spec_path, registry_url=self.registry_url, namespace=ticket.namespace,
                                    listen=self.config.worker_listen, heartbeat_s=HEARTBEAT_S,
                                    registry_ttl_s=REGISTRY_TTL_S, keys_dir=keys_dir,
                                    allow_module_ops=self.config.allow_module_ops,
                                    users_root=self.config.users_root)
            devices = {r.name: r.device for r in ticket.spec.roles}
            for want in wanted:
                with replica_processes(want.role, want.worker_id, ticket.spec.role(want.role).tp_size, options,
                                       gpus=want.gpus) as ranks:
                    for rank in ranks:
                        if rank.worker_id != want.worker_id:
                            followers[rank.worker_id] = want.role
                        gpus[rank.worker_id] = rank.gpus
                        with (folder / f"{rank.worker_id}.log").open("ab") as out:
                            processes[rank.worker_id] = subprocess.Popen(
                                rank.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**env, **rank.env}, start_new_session=True, pass_fds=rank.pass_fds,
                            )
                # Seen starting at once (every rank: a sweep meanwhile finds the replica whole).
                records.starting_workers(ticket.deployment_id, [
                    StartingWorker(worker_id=rank.worker_id, role=want.role, host=self.node,
                                   pid=processes[rank.worker_id].pid, device=devices[want.role], gpus=rank.gpus)
                    for rank in ranks])
            registered = asyncio.run(self._registered(ticket.namespace, processes, folder,
                                                      [w.worker_id for w in wanted]))
            undo.pop_all()
        rows = [StartedWorker(worker_id=s.info.worker_id, role=s.info.role, address=s.info.address, host=self.node,
                              pid=s.info.pid, device=devices.get(s.info.role, s.info.device),
                              gpus=gpus[s.info.worker_id])
                for s in registered]
        # Follower ranks have no endpoint; rank 0 registered only once they had all joined it.
        rows += [StartedWorker(worker_id=rank_id, role=role, address="", host=self.node,
                               pid=processes[rank_id].pid, device=devices[role], gpus=gpus[rank_id])
                 for rank_id, role in followers.items()]
        return rows

    async def _registered(self, namespace: str, processes: dict[str, subprocess.Popen[bytes]], folder: Path,
                          endpoints: list[str]):
        """Wait until every worker of `endpoints` has registered (readiness) or one of `processes`
        has exited (failure)."""
        registry = make_registry(self.config.redis_url, namespace=namespace)
        deadline = time.monotonic() + self.config.worker_ready_timeout_s
        try:
            while True:
                for worker_id, process in processes.items():
                    if process.poll() is not None:
                        raise LaunchError(_exited(worker_id, process.returncode, folder / f"{worker_id}.log"))
                try:
                    listed = {s.info.worker_id: s for s in await registry.workers()}
                except RegistryError as exc:
                    log.warning("reading the registry while workers start: %s", exc)
                    listed = {}
                if all(w in listed for w in endpoints):
                    return [listed[w] for w in endpoints]
                if time.monotonic() > deadline:
                    missing = sorted(set(endpoints) - set(listed))
                    raise LaunchError(f"workers {missing} did not register within"
                                      f" {self.config.worker_ready_timeout_s} s")
                await asyncio.sleep(_READY_POLL_S)  # polling Redis for the registrations
        finally:
            await registry.close()
