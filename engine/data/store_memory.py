"""Where a `TensorStore`'s bytes live, and when they may be used again.

`StoreMemory` hands out the buffers producers fill (`reserve`: a shared-memory segment for a
tensor above `inline_max_bytes` when the store has segments, private memory otherwise), stamps a
filled segment with its ref's generation (`publish`), and takes freed bytes back: a freed
segment goes back to the allocator's pool, and a lent tensor's `on_free` is queued for its
lender (`take_lent`), only once no zero-copy send (`SendHandle`) still reads them. It also keeps
the GPU memory that the store's CUDA copies hold within `cuda_max_bytes`.

Not thread-safe: `TensorStore` calls it under its lock, and calls the lenders' `on_free` that
`take_lent` hands over outside that lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.data.codec import TORCH_ONLY_DTYPES, UnsupportedTensor
from engine.data.shm import PAGE, Segment, SegmentAllocator
from engine.data.wire import ShmLocation, TensorHeader

if TYPE_CHECKING:
    import torch

__all__ = ["DATA_OFFSET", "Reservation", "SendHandle", "SentFrames", "StoreMemory"]

# Segment layout: the generation of the ref that occupies it (uint64, little-endian, 0 when
# free) in the first page, the tensor from the second page on (page-aligned for the reader).
DATA_OFFSET = PAGE


class SendHandle(Protocol):
    """Something still reading a segment (a ZeroMQ zero-copy send): the segment is not
    recycled before `done`."""

    @property
    def done(self) -> bool: ...


@dataclass(slots=True, eq=False)
class SentFrames:
    """A `SendHandle` for bytes sent as several zero-copy frames (one per tracker)."""

    trackers: list[SendHandle]

    @property
    def done(self) -> bool:
        return all(tracker.done for tracker in self.trackers)


@dataclass(slots=True, eq=False)
class Reservation:
    """A writable buffer in the store for a producer to fill before `TensorStore.commit`."""

    header: TensorHeader
    data: np.ndarray  # uint8, 1-D, writable
    segment: Segment | None
    committed: bool = False

    @property
    def array(self) -> np.ndarray:
        if self.header.dtype in TORCH_ONLY_DTYPES:
            raise UnsupportedTensor(f"numpy has no {self.header.dtype}; use .torch()")
        return self.data.view(np.dtype(self.header.dtype)).reshape(self.header.shape)

    def torch(self) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.data).view(getattr(torch, self.header.dtype)).reshape(self.header.shape)


class StoreMemory:
    """The segments and GPU budget of one store. `segments` is None for a store without shared
    memory (every buffer private); this object owns it from now on and closes it in `close`."""

    def __init__(self, segments: SegmentAllocator | None, *, inline_max_bytes: int, cuda_max_bytes: int,
                 clock: Callable[[], float]) -> None:
        self._segments = segments
        self._inline_max_bytes = inline_max_bytes
        self._cuda_max_bytes = cuda_max_bytes
        self._clock = clock
        self._reserved: set[Segment] = set()  # taken by reservations not yet committed
        self._draining: list[tuple[Segment | Callable[[], None], list[SendHandle]]] = []
        """Freed segments and lent tensors' `on_free`, waiting for their sends to finish."""
        self._to_free: list[Callable[[], None]] = []  # lent tensors to give back, outside the lock
        self._cuda_bytes = 0

    # --- buffers -----------------------------------------------------------------------------

    def in_segment(self, nbytes: int) -> bool:
        """Whether a buffer of `nbytes` is a shared-memory segment (else private memory)."""
        return self._segments is not None and nbytes > self._inline_max_bytes

    def reserve(self, header: TensorHeader) -> Reservation:
        """A writable buffer for `header`'s bytes: a segment (taken from the pool when one fits)
        when `in_segment`, else private memory, which touches no shared state."""
        if self._segments is not None and self.in_segment(header.nbytes):
            self.drain()
            segment = self._segments.take(DATA_OFFSET + header.nbytes)
            self._reserved.add(segment)
            return Reservation(header, segment.array[DATA_OFFSET : DATA_OFFSET + header.nbytes], segment)
        return Reservation(header, np.empty(header.nbytes, np.uint8), None)

    def publish(self, segment: Segment, generation: int) -> ShmLocation:
        """A reserved segment, now filled, becomes a live ref's (of `generation`, > 0): stamped
        after the data, so a reader that sees this generation sees the tensor."""
        self._reserved.discard(segment)
        location = ShmLocation(segment.name, segment.size, DATA_OFFSET, generation=generation)
        segment.array[:8].view(np.uint64)[0] = generation
        return location

    def abort(self, segment: Segment) -> None:
        """A reserved segment that will not be published: back to the pool."""
        self._reserved.discard(segment)
        self._draining.append((segment, []))
        self.drain()

    # --- the GPU budget ------------------------------------------------------------------------

    def cuda_room(self, nbytes: int) -> bool:
        """Whether a CUDA copy of `nbytes` more stays within `cuda_max_bytes`."""
        return self._cuda_bytes + nbytes <= self._cuda_max_bytes

    def charge_cuda(self, nbytes: int) -> None:
        self._cuda_bytes += nbytes

    def refund_cuda(self, nbytes: int) -> None:
        self._cuda_bytes -= nbytes

    # --- freeing -------------------------------------------------------------------------------

    def free_segment(self, segment: Segment, sends: list[SendHandle]) -> None:
        """A freed ref's segment: readers in place must ask the owner from now on (generation
        0); it is recycled once `sends` are done."""
        segment.array[:8].view(np.uint64)[0] = 0
        self._draining.append((segment, sends))
        self.drain()

    def free_lent(self, on_free: Callable[[], None], sends: list[SendHandle]) -> None:
        """A freed lent tensor: `on_free` goes to `take_lent` once `sends` are done."""
        self._draining.append((on_free, sends))
        self.drain()

    def drain(self) -> None:
        """Recycle freed segments, and queue lent tensors for `take_lent`, once no zero-copy send
        still reads them."""
        if not self._draining:
            return
        now = self._clock()
        keep = []
        for freed, sends in self._draining:
            if not all(h.done for h in sends):
                keep.append((freed, sends))
            elif isinstance(freed, Segment):
                assert self._segments is not None
                self._segments.give_back(freed, now)
            else:
                self._to_free.append(freed)
        self._draining = keep

    def take_lent(self) -> list[Callable[[], None]]:
        """The `on_free` of lent tensors that `drain` found done, each handed over once: for the
        store to call outside its lock (the lender takes its own)."""
        to_free, self._to_free = self._to_free, []
        return to_free

    def trim(self, now: float) -> None:
        """Let go of segments pooled for longer than the pool's idle time."""
        if self._segments is not None:
            self._segments.trim(now)

    # --- introspection and shutdown --------------------------------------------------------------

    @property
    def pooled_segments(self) -> int:
        return self._segments.pooled_segments if self._segments else 0

    @property
    def pooled_bytes(self) -> int:
        return self._segments.pooled_bytes if self._segments else 0

    @property
    def unheld_segments(self) -> int:
        """Segments of this store that no live ref holds: pooled, reserved, or freed and waiting
        for their sends (a lent tensor waiting for its sends counts here too)."""
        return self.pooled_segments + len(self._draining) + len(self._reserved)

    def close(self) -> list[Callable[[], None]]:
        """Unlink every segment not held by a live ref (the store unlinks those) and close the
        allocator; returns the `on_free` of every lent tensor still waiting, for the store to
        call outside its lock."""
        lent = []
        for freed, _sends in self._draining:
            if isinstance(freed, Segment):
                freed.unlink()
            else:
                lent.append(freed)
        self._draining.clear()
        lent.extend(self._to_free)
        self._to_free.clear()
        for segment in self._reserved:
            segment.unlink()
        self._reserved.clear()
        self._cuda_bytes = 0
        if self._segments is not None:
            self._segments.close()
        return lent
