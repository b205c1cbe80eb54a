"""The node agent of the distributed mode: a node's Celery worker (queue `node.<name>`)
starts and stops the role workers of the deployments placed on that node.

Role workers are `python -m engine.worker` processes in a session of their own, so they
outlive the task that started them (and a restart of the Celery worker): each registers
in Redis under the deployment's namespace and heartbeats there; its output goes to a log
file under `<data dir>/deployments/<id>/`. A worker row records its pid and the node
(`Worker.host`), so `reconcile` and `stop` find them again: a row whose process is gone
(or whose pid now runs something else) is marked lost. Readiness is the registration
seen in Redis, never a sleep.

Both operations are idempotent: `reconcile` starts what is missing and stops what is
beyond the replica counts; `stop` ends whatever is left.
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

from engine.flow.discovery import RegistryError, make_registry
from engine.spec.graph import encode_spec
from engine.worker.launcher import LaunchError
from studio.config import StudioConfig
from studio.workflows.deployments import records
from studio.workflows.deployments.records import DeploymentTicket, StartedWorker
from studio.workflows.models import Worker, WorkerStatus

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
REGISTRY_TTL_S = 2.0
STOP_TIMEOUT_S = 15.0
_READY_POLL_S = 0.05


def node_queue(node: str) -> str:
    """The Celery queue a node's worker consumes for its deployments."""
    return f"node.{node}"


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


class NodeAgent:
    """Role workers of deployments on this node (`config.node_name`)."""

    def __init__(self, config: StudioConfig) -> None:
        if config.redis_url is None:
            raise RuntimeError("the node agent needs REDIS_URL: its workers register there")
        self.config = config
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

    def reconcile(self, ticket: DeploymentTicket) -> Reconciled:
        """Run exactly the replicas `ticket.spec` asks for on this node; raises LaunchError
        (after stopping what it started) when a worker does not come up."""
        live, lost = self._live(ticket.deployment_id)
        stop: list[tuple[Worker, psutil.Process]] = []
        wanted: list[tuple[str, str]] = []  # (role, worker id)
        for role in ticket.spec.roles:
            mine = [(row, p) for row, p in live if row.role == role.name]
            stop += mine[role.replicas:]
            wanted += [(role.name, f"{role.name}-{self.node}-{uuid.uuid4().hex[:8]}")
                       for _ in range(role.replicas - len(mine))]
        stopped = [row.worker_id for row, _ in stop]
        if stop:
            _terminate([p for _, p in stop])
            records.set_worker_status(stopped, WorkerStatus.STOPPED)
        if wanted:
            records.add_workers(ticket.deployment_id, self._start(ticket, wanted))
        return Reconciled(started=[w for _, w in wanted], stopped=stopped, lost=lost)

    def stop(self, deployment_id: str) -> list[str]:
        """End every worker of the deployment on this node; their ids."""
        live, _ = self._live(deployment_id)
        _terminate([p for _, p in live])
        ids = [row.worker_id for row, _ in live]
        records.set_worker_status(ids, WorkerStatus.STOPPED)
        shutil.rmtree(self._dir(deployment_id), ignore_errors=True)
        return ids

    # ---------------------------------------------------------------- spawning
    def _start(self, ticket: DeploymentTicket, wanted: list[tuple[str, str]]) -> list[StartedWorker]:
        folder = self._dir(ticket.deployment_id)
        folder.mkdir(parents=True, exist_ok=True)
        spec_path = folder / "workflow.json"
        spec_path.write_bytes(encode_spec(ticket.spec))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
        processes: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for role, worker_id in wanted:
                with (folder / f"{worker_id}.log").open("ab") as out:
                    processes[worker_id] = subprocess.Popen(
                        [sys.executable, "-m", "engine.worker", "--role", role, "--workflow", str(spec_path),
                         "--worker-id", worker_id, "--registry", str(self.config.redis_url),
                         "--namespace", ticket.namespace, "--listen", self.config.worker_listen,
                         "--heartbeat", str(HEARTBEAT_S), "--registry-ttl", str(REGISTRY_TTL_S)],
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                        start_new_session=True,
                    )
            registered = asyncio.run(self._registered(ticket.namespace, processes, folder))
        except BaseException:
            _terminate([psutil.Process(p.pid) for p in processes.values() if p.poll() is None])
            raise
        devices = {r.name: r.device for r in ticket.spec.roles}
        return [StartedWorker(worker_id=s.info.worker_id, role=s.info.role, address=s.info.address, host=self.node,
                              pid=s.info.pid, device=devices.get(s.info.role, s.info.device))
                for s in registered]

    async def _registered(self, namespace: str, processes: dict[str, subprocess.Popen[bytes]], folder: Path):
        """Wait until every process has registered (readiness) or one has exited (failure)."""
        registry = make_registry(self.config.redis_url, namespace=namespace)
        deadline = time.monotonic() + self.config.worker_ready_timeout_s
        try:
            while True:
                for worker_id, process in processes.items():
                    if process.poll() is not None:
                        tail = (folder / f"{worker_id}.log").read_text(errors="replace")[-2000:]
                        raise LaunchError(f"worker {worker_id} exited with status {process.returncode} before it"
                                          f" registered:\n{tail}")
                try:
                    listed = {s.info.worker_id: s for s in await registry.workers()}
                except RegistryError as exc:
                    log.warning("reading the registry while workers start: %s", exc)
                    listed = {}
                if all(w in listed for w in processes):
                    return [listed[w] for w in processes]
                if time.monotonic() > deadline:
                    missing = sorted(set(processes) - set(listed))
                    raise LaunchError(f"workers {missing} did not register within"
                                      f" {self.config.worker_ready_timeout_s} s")
                await asyncio.sleep(_READY_POLL_S)  # polling Redis for the registrations
        finally:
            await registry.close()
