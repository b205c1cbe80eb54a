"""Deploy, scale and stop role workers.

* `LocalCluster` -- a deployment's role workers spawned from this process (they end with it),
  each replica asking for GPUs on GPUs of its own from a `GpuPool` (the machine's, which
  several clusters may share):
  `start()`, `spawn(role, index)` one more, `retire(worker)` one (it drains first), `stop()`;
  it supervises them under a `RestartPolicy` and reports each `ReplicaEvent` (`ReplicaEventKind`:
  lost, replaced, gave up) and each replica's steps as it comes up (`WorkerLaunch`, `LaunchState`:
  starting, ready, failed, abandoned); `LaunchedWorker` one replica with its follower ranks;
  `LaunchError` a worker that did not come up;
* worker ids of tensor-parallel replicas: `rank_worker_id`, `leader_worker_id`, `TP_RANK_SUFFIX`;
* for a node agent starting `python -m engine.worker` processes itself: `replica_processes`, the
  command lines of one replica's processes (`WorkerProcess`, with `WorkerOptions` shared by a
  deployment's workers on the node) and the environment confining them to the replica's GPUs,
  and `HOST_ID_ENV`, the host identity they share memory under; `start_failure`, why one of
  them could not start, read from what it printed;
* `REFUSED_METRIC` -- the worker metric counting connections its sockets refused.

Loads torch (the launcher forks workers from a zygote that has it): import it where workers
are started, not in settings.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine.data.rendezvous import listening_socket
from engine.data.shm import HOST_ID_ENV
from engine.flow.gpus import GpuPool, gpu_environment
from engine.worker.announce import REFUSED_METRIC, start_failure
from engine.worker.launcher import (
    TP_RANK_SUFFIX,
    LaunchedWorker,
    LaunchError,
    LaunchState,
    LocalCluster,
    WorkerLaunch,
    leader_worker_id,
    rank_worker_id,
)
from engine.worker.supervise import ReplicaEvent, ReplicaEventKind, RestartPolicy

__all__ = [
    "HOST_ID_ENV",
    "REFUSED_METRIC",
    "TP_RANK_SUFFIX",
    "GpuPool",
    "LaunchError",
    "LaunchState",
    "LaunchedWorker",
    "LocalCluster",
    "ReplicaEvent",
    "ReplicaEventKind",
    "RestartPolicy",
    "WorkerLaunch",
    "WorkerOptions",
    "WorkerProcess",
    "leader_worker_id",
    "rank_worker_id",
    "replica_processes",
    "start_failure",
]


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """What every role worker of a deployment on one node is started with."""

    workflow: Path
    """The deployment's GraphSpec (JSON) or DSL module."""
    registry_url: str
    namespace: str
    listen: str
    """Its control endpoint (`tcp://HOST:0`: any free port)."""
    heartbeat_s: float
    registry_ttl_s: float
    keys_dir: Path
    """The deployment's worker-plane keys (`PlaneKeys.write`)."""
    allow_module_ops: bool = False
    """Whether its python nodes may name `module:function` ops (the studio's setting of the same
    name); by default a worker runs registered ops only, whatever a graph names."""
    users_root: Path | None = None
    """Where the node keeps its users' folders (`<OMNIFLOW_DATA_DIR>/users`): its workers write a
    run's files there, in the run owner's folder (`engine.spec.userfiles`)."""


@dataclass(frozen=True, slots=True)
class WorkerProcess:
    """One role worker process to start: its worker id, its command line and the descriptors it
    inherits (`subprocess.Popen(argv, pass_fds=pass_fds)`)."""

    worker_id: str
    argv: tuple[str, ...]
    pass_fds: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    """The node's GPUs this rank holds (its own share of the replica's)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """What its environment gets besides the node agent's: `CUDA_VISIBLE_DEVICES` (and
    `CUDA_DEVICE_ORDER`) naming the replica's GPUs; nothing for a replica holding none."""


@contextlib.contextmanager
def replica_processes(role: str, worker_id: str, tp_size: int, options: WorkerOptions,
                      gpus: tuple[int, ...] = ()) -> Iterator[list[WorkerProcess]]:
    """The processes of one replica of `role` whose rank 0 is `worker_id`: that one alone, or with
    `tp_size` > 1 one per tensor-parallel rank (`rank_worker_id`), rank 0 first, all meeting on a
    socket bound here and handed to rank 0, whose rendezvous store serves on it. Start them all
    inside the block: it closes this process's copy of that socket when it ends.

    `gpus`: the replica's GPUs (its placement slot's, `engine.flow.gpus`), an equal share per
    rank in rank order; every rank sees all of them (`CUDA_VISIBLE_DEVICES`), so rank r's
    `cuda:{r * share}` is its own. Raises ValueError when they do not split evenly."""
    if len(gpus) % tp_size:
        raise ValueError(f"role {role!r}: {len(gpus)} GPUs do not split evenly over {tp_size} ranks")
    share = len(gpus) // tp_size
    env = gpu_environment(gpus)
    common = (sys.executable, "-m", "engine.worker", "--role", role, "--workflow", str(options.workflow),
              "--registry", options.registry_url, "--namespace", options.namespace, "--listen", options.listen,
              "--heartbeat", str(options.heartbeat_s), "--registry-ttl", str(options.registry_ttl_s),
              "--keys", str(options.keys_dir), "--module-ops" if options.allow_module_ops else "--no-module-ops",
              *(("--users-root", str(options.users_root)) if options.users_root is not None else ()))
    if tp_size <= 1:
        yield [WorkerProcess(worker_id, (*common, "--worker-id", worker_id), gpus=tuple(gpus), env=env)]
        return
    listener, address = listening_socket()
    with listener:
        yield [WorkerProcess(rank_worker_id(worker_id, rank),
                             (*common, "--worker-id", rank_worker_id(worker_id, rank), "--tp-rank", str(rank),
                              "--tp-address", address,
                              *(("--tp-listen-fd", str(listener.fileno())) if rank == 0 else ())),
                             (listener.fileno(),) if rank == 0 else (),
                             gpus=tuple(gpus[rank * share:(rank + 1) * share]), env=env)
               for rank in range(tp_size)]

