"""The live refs of a `TensorStore`: each `StoredTensor` by its ref id, and the leases that end them.

`RefTable` names refs (`<epoch>.<serial>`: an epoch drawn per table, so ids never repeat across
restarts at one address) and makes them (`new_ref`, stamped with the store's owner and host and
the lease's end as a UNIX time); it holds the live entries with their leases (a heap ordered by
expiry, stale items skipped on pop) and the bytes they add up to. It frees no memory: `remove`
and `expired` hand the entries they take out to the store, which frees what they hold.

Not thread-safe: `TensorStore` calls it under its lock (`next_id` and `new_ref` excepted: they
touch no table state).
"""

from __future__ import annotations

import heapq
import itertools
import math
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.data.shm import Segment
from engine.data.store_memory import SendHandle
from engine.data.wire import RefId, ShmLocation, TensorHeader, TensorRef

if TYPE_CHECKING:
    import torch

__all__ = ["RefTable", "StoredTensor", "generation_of"]


@dataclass(slots=True, eq=False)
class StoredTensor:
    """One live tensor. `data` is its bytes (uint8, 1-D, read-only); `segment` holds them
    when they live in shared memory, at `location`. A CUDA tensor kept on its GPU is `cuda`;
    its `data` is None until a consumer needs host bytes (`TensorStore.serve(host=True)`).
    A lent tensor (`TensorStore.lend`) has `parts` instead of `data`, and `on_free`.
    Valid while the ref is live."""

    ref: TensorRef
    header: TensorHeader
    data: np.ndarray | None
    segment: Segment | None
    expires: float  # monotonic
    sends: list[SendHandle] = field(default_factory=list)
    location: ShmLocation | None = None
    cuda: torch.Tensor | None = None
    cuda_ready: torch.cuda.Event | None = None
    """Recorded after the GPU copy on the producer's stream: waited for before the tensor is
    shared or staged from another thread (whose stream knows nothing of the producer's)."""
    cuda_budgeted: bool = False
    parts: tuple[np.ndarray, ...] | None = None
    """A lent tensor's bytes, in order: buffers its lender owns (uint8, 1-D)."""
    on_free: Callable[[], None] | None = None
    """Gives a lent tensor's `parts` back, once it is freed and no send reads them."""

    def byte_range(self, offset: int, end: int) -> list[np.ndarray]:
        """Host bytes [offset, end) as views, no copy: one for a tensor in one buffer, one per
        part the range touches for a lent tensor. Needs host bytes (`data` or `parts`)."""
        if self.parts is None:
            assert self.data is not None, "a CUDA tensor not staged to host memory"
            return [self.data[offset:end]]
        views = []
        start = 0
        for part in self.parts:
            stop = start + part.nbytes
            if stop > offset and start < end:
                views.append(part[max(offset, start) - start : min(end, stop) - start])
            start = stop
        return views


def generation_of(ref_id: RefId) -> int:
    """The generation that a segment holding `ref_id`'s tensor is stamped with: its serial + 1
    (0 marks a free segment)."""
    return int(ref_id.rsplit(".", 1)[1]) + 1


class RefTable:
    """The refs of one store: `owner` and `host` are stamped on every ref it makes; a lease is
    in (0, `max_lease_s`] seconds, `default_lease_s` when not given."""

    def __init__(self, owner: str, host: str, *, default_lease_s: float, max_lease_s: float,
                 wall_clock: Callable[[], float]) -> None:
        self._owner = owner
        self._host = host
        self._default_lease_s = default_lease_s
        self._max_lease_s = max_lease_s
        self._wall = wall_clock
        self._entries: dict[RefId, StoredTensor] = {}
        self._leases: list[tuple[float, RefId]] = []  # heap; stale entries skipped on pop
        self._epoch = secrets.token_hex(4)  # ids never repeat across restarts at one address
        self._serial = itertools.count()
        self.live_bytes = 0

    # --- naming ------------------------------------------------------------------------------

    def lease_seconds(self, lease_s: float | None) -> float:
        """The lease asked for, checked (`ValueError` outside the allowed range)."""
        lease = self._default_lease_s if lease_s is None else float(lease_s)
        if not 0 < lease <= self._max_lease_s:
            raise ValueError(f"lease must be in (0, {self._max_lease_s}] seconds, got {lease}")
        return lease

    def next_id(self) -> RefId:
        return RefId(f"{self._epoch}.{next(self._serial)}")

    def new_ref(self, ref_id: RefId, header: TensorHeader, lease: float, device: str,
                shm: ShmLocation | None = None) -> TensorRef:
        """The ref of a tensor of `header` on `device`, its lease ending `lease` seconds from now
        (`math.inf`: never)."""
        return TensorRef(owner=self._owner, id=ref_id, dtype=header.dtype, shape=header.shape,
                         nbytes=header.nbytes, lease_expires_at=self._wall() + lease, host=self._host,
                         device=device, shm=shm)

    # --- entries -----------------------------------------------------------------------------

    def add(self, entry: StoredTensor) -> None:
        """Hold `entry` until it is removed or its lease (unless infinite) ends."""
        self._entries[entry.ref.id] = entry
        if math.isfinite(entry.expires):
            heapq.heappush(self._leases, (entry.expires, entry.ref.id))
        self.live_bytes += entry.header.nbytes

    def get(self, ref_id: RefId) -> StoredTensor | None:
        """The entry under `ref_id`, whether or not its lease has ended (the caller checks)."""
        return self._entries.get(ref_id)

    def extend(self, entry: StoredTensor, expires: float) -> None:
        """Move the end of `entry`'s lease to `expires` (monotonic)."""
        entry.expires = expires
        heapq.heappush(self._leases, (expires, entry.ref.id))

    def remove(self, entry: StoredTensor) -> None:
        del self._entries[entry.ref.id]
        self.live_bytes -= entry.header.nbytes

    def expired(self, now: float) -> list[StoredTensor]:
        """Take out every entry whose lease ended by `now` (monotonic), in the order they ended."""
        gone = []
        while self._leases and self._leases[0][0] <= now:
            _expires, ref_id = heapq.heappop(self._leases)
            entry = self._entries.get(ref_id)
            if entry is not None and entry.expires <= now:
                self.remove(entry)
                gone.append(entry)
        return gone

    def clear(self) -> None:
        self._entries.clear()
        self._leases.clear()
        self.live_bytes = 0

    def values(self) -> Iterator[StoredTensor]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ref_id: object) -> bool:
        return ref_id in self._entries
