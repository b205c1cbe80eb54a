"""A node agent's announcements in the node directory (`engine.flow.discovery.nodes`).

From `worker_ready` on, a node's Celery worker announces its `NodeRecord` every third of
`OMNIFLOW_NODE_TTL_S`: its name and address, its resources (CPUs this process may run on, the
machine's memory, the GPUs `nvidia-smi` lists (`engine.client.cluster.detect_gpus`), each overridden by `OMNIFLOW_NODE_GPUS`,
`_GPU_MODEL`, `_GPU_MEMORY_GB`, `_CPUS`, `_MEMORY_GB`), its labels (`OMNIFLOW_NODE_LABELS`),
and what the deployments placed on it take (read from the database; when the database cannot
be read it keeps announcing the last it knew). Each announcement the directory accepted is also
the node's heartbeat on its `NodeHeartbeat` row, with the record (`liveness.heartbeat`): what
tells a node whose agent is alive from a dead one after a Redis flush or restart took the
directory, and what `/api/nodes/` shows of the node meanwhile. On shutdown it
stops announcing but does not withdraw the record: role workers outlive their agent, so an agent
restarted within the lease keeps its node (and its replicas where they are); one that stays away
is lost when the lease lapses.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import psutil
from django.db import DatabaseError, connections

from engine.client.cluster import GpuInfo, NodeDirectoryError, NodeRecord, detect_gpus
from engine.spec.resources import Amounts
from studio.config import NodeSettings, StudioConfig
from studio.workflows.deployments import liveness, placing
from studio.workflows.paths import PathRoots

log = logging.getLogger(__name__)


def machine(settings: NodeSettings, detected: tuple[GpuInfo, ...] | None = None) -> tuple[Amounts, tuple[GpuInfo, ...]]:
    """The node's total resources and GPUs: what is detected, overridden by `settings`."""
    gpus = detect_gpus() if detected is None else detected
    if settings.gpus is not None:
        gpus = tuple(GpuInfo(i, settings.gpu_model or (gpus[i].model if i < len(gpus) else "unknown"),
                             settings.gpu_memory_gb if settings.gpu_memory_gb is not None
                             else (gpus[i].memory_gb if i < len(gpus) else 0.0))
                     for i in range(settings.gpus))
    elif settings.gpu_memory_gb is not None or settings.gpu_model is not None:
        gpus = tuple(GpuInfo(g.index, settings.gpu_model or g.model,
                             g.memory_gb if settings.gpu_memory_gb is None else settings.gpu_memory_gb) for g in gpus)
    cpus = settings.cpus if settings.cpus is not None else float(len(os.sched_getaffinity(0)))
    memory = settings.memory_gb if settings.memory_gb is not None else psutil.virtual_memory().total / 2**30
    return Amounts(len(gpus), cpus, round(memory, 2)), gpus


def node_address(config: StudioConfig) -> str:
    if config.node.address:
        return config.node.address
    return config.worker_listen.removeprefix("tcp://").rsplit(":", 1)[0]


class NodeAnnouncer:
    """Announces this process's node until `stop()`."""

    def __init__(self, config: StudioConfig) -> None:
        self.config = config
        self.directory = placing.directory(config)
        self.total, self.gpus = machine(config.node)
        self.started_at = time.time()
        self._hosting: dict[str, dict[str, int]] = {}
        self._taken = Amounts()
        self._stopped = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omniflow-node-announce", daemon=True)

    def record(self) -> NodeRecord:
        """The record to announce now (what the placed deployments take, from the database)."""
        try:
            use = placing.usage().get(self.config.node_name, placing.NodeUse())
            self._hosting, self._taken = use.hosting, use.taken
        except DatabaseError as exc:
            log.warning("node %s: reading what its deployments take failed (%s); announcing the last known",
                        self.config.node_name, exc)
        return NodeRecord(name=self.config.node_name, address=node_address(self.config), total=self.total,
                          free=self.total - self._taken, gpus=self.gpus, labels=dict(self.config.node.labels),
                          hosting=self._hosting, agent_pid=os.getpid(), started_at=self.started_at,
                          seen_at=time.time(), ttl_s=self.config.node.ttl_s,
                          users_root=str(self.config.users_root),
                          model_roots=tuple(str(root) for root in PathRoots.of(self.config).hidden_in_errors))

    def announce(self) -> None:
        """Announce the node once, and keep the heartbeat on its row (the thread of `start` does
        this every third of the TTL); a failure is logged and left to the next announcement."""
        record = self.record()
        try:
            self.directory.announce(record)
        except NodeDirectoryError as exc:
            log.warning("node %s: %s; trying again in %.1f s", self.config.node_name, exc, self.config.node.ttl_s / 3)
            return
        try:
            liveness.heartbeat(record)
        except DatabaseError as exc:
            log.warning("node %s: keeping its heartbeat in the database failed (%s); a Redis flush meanwhile"
                        " would see it lost once its last kept heartbeat lapses", self.config.node_name, exc)

    def _run(self) -> None:
        try:
            self.announce()
            self._first.set()
            while not self._stopped.wait(self.config.node.ttl_s / 3):
                self.announce()
        finally:
            self._first.set()
            connections.close_all()

    def start(self, first_within_s: float = 10.0) -> None:
        """Start announcing; returns once the first announcement was made (or tried)."""
        self._thread.start()
        self._first.wait(first_within_s)
        log.info("node %s: announcing %s with labels %s every %.1f s", self.config.node_name, self.total.describe(),
                 self.config.node.labels or "none", self.config.node.ttl_s / 3)

    def stop(self) -> None:
        """Stop announcing (the lease ends the record unless the agent is back before it does)."""
        self._stopped.set()
        self._thread.join(timeout=5)
        self.directory.close()

