"""The live view of a cluster: which role workers run (and how loaded they are), which nodes
host them, and where a deployment's replicas go.

* the worker registry (`engine.flow.discovery`): `make_registry(url, namespace=...)` opens a
  deployment's namespace (Redis, or in process without a url); `Registry` its protocol;
  `WorkerSnapshot` a live worker, its load and metrics as last heartbeated; `RegistryError`, and
  `RegistryUnavailableError` when the registry cannot be reached (transient);
  `deregister_workers` takes lost workers off a namespace at once and fences them, so that
  those still running (cut off, not dead) cannot register again; `restore_fences` fences again
  those whose tombstones a Redis flush or restart took (the caller's durable record says which
  were lost within `FENCE_TTL_S`);
* the node directory (`engine.flow.discovery.nodes`): `NodeDirectory`, the `NodeRecord` each
  node agent announces, with its `GpuInfo`; `NodeState`, a known node's last record and whether
  its lease is live; `NodeDirectoryError`; `detect_gpus`, this machine's
  GPUs as `nvidia-smi` lists them (`engine.flow.discovery.machine`);
* placement (`engine.flow.placement`, pure): `place` puts each `RoleDemand` on a `NodeOffer`,
  giving a `Placement` (a `Slot` per replica: its node and GPUs) or `PlacementError` with a
  `Refusal` per replica it could not place;
* GPUs on a node (`engine.flow.gpus`, pure): `assign_gpus` gives each `GpuRequest` its
  `GpuGrant` of the node's GPU indices, or `GpuAssignmentError`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from engine.flow.discovery import (
    FENCE_TTL_S,
    Registry,
    RegistryError,
    RegistryUnavailableError,
    WorkerSnapshot,
    make_registry,
)
from engine.flow.discovery.machine import detect_gpus
from engine.flow.discovery.nodes import GpuInfo, NodeDirectory, NodeDirectoryError, NodeRecord, NodeState
from engine.flow.gpus import GpuAssignmentError, GpuGrant, GpuRequest, assign_gpus
from engine.flow.placement import NodeOffer, Placement, PlacementError, Refusal, RoleDemand, Slot, place

log = logging.getLogger(__name__)

__all__ = [
    "FENCE_TTL_S",
    "GpuAssignmentError",
    "GpuGrant",
    "GpuInfo",
    "GpuRequest",
    "NodeDirectory",
    "NodeDirectoryError",
    "NodeOffer",
    "NodeRecord",
    "NodeState",
    "Placement",
    "PlacementError",
    "Refusal",
    "Registry",
    "RegistryError",
    "RegistryUnavailableError",
    "RoleDemand",
    "Slot",
    "WorkerSnapshot",
    "assign_gpus",
    "detect_gpus",
    "deregister_workers",
    "make_registry",
    "place",
    "restore_fences",
]


async def deregister_workers(registry_url: str, namespace: str, worker_ids: Iterable[str]) -> None:
    """Take `worker_ids` off the registry namespace now and fence them (`Registry.fence`), so no
    run goes to them while their registration's TTL runs out, and a worker process of theirs
    that still runs (its node cut off, not dead) cannot register again: it stops itself. A
    registry that cannot be reached leaves them to that TTL, unfenced (the node agent ends such
    a process when its node comes back): this never raises `RegistryError`."""
    registry = make_registry(registry_url, namespace=namespace)
    try:
        for worker_id in worker_ids:
            try:
                await registry.fence(worker_id)
            except RegistryError as exc:
                log.warning("could not fence worker %s in %s (%s): its record lasts until its TTL ends, and a"
                            " process of it that still runs is ended when its node agent sweeps", worker_id,
                            namespace, exc)
    finally:
        await registry.close()


async def restore_fences(registry_url: str, namespace: str, worker_ids: Sequence[str]) -> list[str]:
    """Fence again those of `worker_ids` (workers declared lost) that the namespace no longer has
    fenced: Redis keeps its tombstones in memory only, so a flush or restart forgets them, and a
    lost worker that still runs would register again beside its replacement. Fenced again, it is
    taken off the registry (had it registered again) and stops itself at its next heartbeat.
    Returns the ids fenced again; a registry that cannot be reached is logged and left to the
    next call (never raises `RegistryError`)."""
    if not worker_ids:
        return []
    registry = make_registry(registry_url, namespace=namespace)
    try:
        fenced = await registry.fenced(worker_ids)
        missing = [w for w in worker_ids if w not in fenced]
        for worker_id in missing:
            await registry.fence(worker_id)
    except RegistryError as exc:
        log.warning("could not restore the fences of lost workers in %s (%s); the next sweep tries again",
                    namespace, exc)
        return []
    finally:
        await registry.close()
    if missing:
        log.warning("registry namespace %s had lost the fences of workers %s (Redis flushed or restarted);"
                    " fenced them again", namespace, missing)
    return missing
