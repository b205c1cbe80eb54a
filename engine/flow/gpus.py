"""Which GPUs of a node each replica placed there gets.

Pure: a node's GPU count, the GPU indices other replicas hold already, and the replicas to
seat (`GpuRequest`: per-process GPUs times `tp_size` ranks) in; each replica's indices out
(`GpuGrant`), or `GpuAssignmentError` naming the replica that does not fit and why. No I/O,
deterministic: the same input always gives the same grants.

Indices are the node's GPU indices as `nvidia-smi` numbers them (PCI bus order); a process
started with them sets `CUDA_DEVICE_ORDER=PCI_BUS_ID` and `CUDA_VISIBLE_DEVICES` to them
(`gpu_environment`), so CUDA's `cuda:0` is the replica's first GPU. Every rank of a
tensor-parallel replica sees all of the replica's GPUs; rank r runs on `cuda:{r * gpus}`
(`engine.compute.tp.seat.rank_device`), its own GPUs, distinct from every other rank's.

The packing: larger replicas first (then by role and replica), each on the lowest run of
consecutive free indices that holds it (a replica's ranks side by side, which on most
machines are the ones linked best), or, when no run is long enough, the lowest free indices.
A replica asking for no GPUs gets none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
DEVICE_ORDER_ENV = "CUDA_DEVICE_ORDER"


class GpuAssignmentError(ValueError):
    """The replicas cannot all get their GPUs on the node (or the input is malformed)."""


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """Replica `replica` of `role`: `tp_size` processes, each needing `gpus` GPUs of its own."""

    role: str
    replica: int
    gpus: int
    tp_size: int = 1

    @property
    def total(self) -> int:
        return self.gpus * self.tp_size


@dataclass(frozen=True, slots=True)
class GpuGrant:
    """Replica `replica` of `role` holds `gpus` (rank order: rank r has `rank_gpus(r)`)."""

    role: str
    replica: int
    gpus: tuple[int, ...]
    per_rank: int = 1
    """GPUs of each rank process."""

    def rank_gpus(self, rank: int) -> tuple[int, ...]:
        return self.gpus[rank * self.per_rank:(rank + 1) * self.per_rank]


def _describe(indices: Iterable[int]) -> str:
    listed = sorted(indices)
    return ", ".join(map(str, listed)) if listed else "none"


def _seat(free: Sequence[int], need: int) -> tuple[int, ...]:
    """The lowest run of `need` consecutive indices in `free` (sorted), else its `need` lowest."""
    run: list[int] = []
    for index in free:
        run = [*run, index] if run and run[-1] == index - 1 else [index]
        if len(run) == need:
            return tuple(run)
    return tuple(free[:need])


def assign_gpus(gpu_count: int, held: Iterable[int], requests: Sequence[GpuRequest]) -> tuple[GpuGrant, ...]:
    """Each of `requests` its GPU indices out of `range(gpu_count)` less `held`, distinct from
    every other's; grants in the order of `requests`. Raises `GpuAssignmentError`: a malformed
    input, or the first replica (in packing order) that finds too few GPUs free, with the
    node's count, what is held and what is left."""
    if gpu_count < 0:
        raise GpuAssignmentError(f"a node has at least 0 GPUs, not {gpu_count}")
    held = frozenset(held)
    outside = sorted(i for i in held if not 0 <= i < gpu_count)
    if outside:
        raise GpuAssignmentError(f"GPUs {_describe(outside)} are held but the node has {gpu_count}"
                                 f" (indices 0 to {gpu_count - 1})")
    seen: set[tuple[str, int]] = set()
    for request in requests:
        if request.gpus < 0 or request.tp_size < 1:
            raise GpuAssignmentError(f"role {request.role!r}, replica {request.replica}: needs at least 0 GPUs per"
                                     f" process and 1 process, not {request.gpus} and {request.tp_size}")
        if (request.role, request.replica) in seen:
            raise GpuAssignmentError(f"role {request.role!r}, replica {request.replica} is asked for twice")
        seen.add((request.role, request.replica))
    order = sorted(range(len(requests)),
                   key=lambda i: (-requests[i].total, requests[i].role, requests[i].replica))
    taken = set(held)
    grants: dict[int, GpuGrant] = {}
    for i in order:
        request = requests[i]
        free = [g for g in range(gpu_count) if g not in taken]
        if request.total > len(free):
            ranks = f" ({request.tp_size} ranks of {request.gpus})" if request.tp_size > 1 else ""
            raise GpuAssignmentError(
                f"role {request.role!r}, replica {request.replica}: needs {request.total} GPUs{ranks}, the node has"
                f" {gpu_count}, held by others: {_describe(held)}, taken by larger replicas here:"
                f" {_describe(taken - held)}, free: {_describe(free)}")
        seat = _seat(free, request.total) if request.total else ()
        taken.update(seat)
        grants[i] = GpuGrant(request.role, request.replica, seat, request.gpus)
    return tuple(grants[i] for i in range(len(requests)))


def gpu_environment(gpus: Sequence[int]) -> dict[str, str]:
    """What a process holding `gpus` is started with: CUDA sees those GPUs only, numbered in
    the order given. Empty (the environment is left as it is) for a process holding none:
    a CPU role may still open a GPU peer's tensors over CUDA IPC (`engine.data.cuda_ipc`),
    which needs that GPU visible."""
    if not gpus:
        return {}
    return {DEVICE_ORDER_ENV: "PCI_BUS_ID", VISIBLE_DEVICES_ENV: ",".join(str(g) for g in gpus)}


class GpuPool:
    """The GPUs of one machine and which of them replicas hold, for launchers that seat replicas
    as they start them (`LocalCluster`; several clusters of one studio share one pool). Not
    thread-safe: one event loop uses it."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise GpuAssignmentError(f"a machine has at least 0 GPUs, not {count}")
        self.count = count
        self._held: set[int] = set()

    @property
    def held(self) -> frozenset[int]:
        return frozenset(self._held)

    def take(self, requests: Sequence[GpuRequest]) -> tuple[GpuGrant, ...]:
        """Seat `requests` on GPUs nobody holds (`assign_gpus`), holding them from now on; raises
        `GpuAssignmentError` (and holds nothing) when they do not fit."""
        grants = assign_gpus(self.count, self._held, requests)
        for grant in grants:
            self._held.update(grant.gpus)
        return grants

    def give_back(self, gpus: Iterable[int]) -> None:
        """`gpus` are free again (their replica ended for good)."""
        self._held.difference_update(gpus)
