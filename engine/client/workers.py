"""Deploy, scale and stop role workers.

* `LocalCluster` -- a deployment's role workers spawned from this process (they end with it):
  `start()`, `spawn(role, index)` one more, `retire(worker)` one (it drains first), `stop()`;
  it supervises them under a `RestartPolicy` and reports each `ReplicaEvent` (`ReplicaEventKind`:
  lost, replaced, gave up); `LaunchedWorker` one replica with its follower ranks; `LaunchError`
  a worker that did not come up;
* worker ids of tensor-parallel replicas: `rank_worker_id`, `leader_worker_id`, `TP_RANK_SUFFIX`;
* for a node agent starting `python -m engine.worker` processes itself: `HOST_ID_ENV` (the host
  identity they share memory under), `listening_socket` (the rendezvous a replica's ranks meet on);
* `REFUSED_METRIC` -- the worker metric counting connections its sockets refused.

Loads torch (the launcher forks workers from a zygote that has it): import it where workers
are started, not in settings.
"""

from __future__ import annotations

from engine.data.rendezvous import listening_socket
from engine.data.shm import HOST_ID_ENV
from engine.worker.launcher import (
    TP_RANK_SUFFIX,
    LaunchedWorker,
    LaunchError,
    LocalCluster,
    leader_worker_id,
    rank_worker_id,
)
from engine.worker.process import REFUSED_METRIC
from engine.worker.supervise import ReplicaEvent, ReplicaEventKind, RestartPolicy

__all__ = [
    "HOST_ID_ENV",
    "REFUSED_METRIC",
    "TP_RANK_SUFFIX",
    "LaunchError",
    "LaunchedWorker",
    "LocalCluster",
    "ReplicaEvent",
    "ReplicaEventKind",
    "RestartPolicy",
    "leader_worker_id",
    "listening_socket",
    "rank_worker_id",
]
