"""The producer side of direct transfers: tensors kept by their producer, handed out as refs.

A producer `put`s an output (or `reserve`s a buffer, fills it and `commit`s it) and gets a
`TensorRef` to pass on; consumers pull the bytes straight from this store through a
`engine.data.server.TensorServer`. Every ref has a lease: `release` frees it at once,
otherwise `sweep` frees it once the lease expires, so a consumer that dies (SIGKILL
included) can never pin memory for longer than one lease.

Tensors above `StoreConfig.inline_max_bytes` live in shared-memory segments (see
`engine.data.shm`) so that a consumer on the same host maps them without a copy; smaller
ones live in private memory and travel inline. A CUDA tensor stays on its GPU (one copy
there): consumers on this host with CUDA open it by CUDA IPC (`engine.data.cuda_ipc`), and
the first consumer that cannot has it staged to host memory once, as above. The store is
thread-safe: the server thread reads it while the producer puts.
"""

from __future__ import annotations

import heapq
import itertools
import math
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.data.codec import (
    DTYPE_SIZES,
    TORCH_ONLY_DTYPES,
    KiB,
    MiB,
    UnsupportedTensor,
    contiguous_strides,
    flatten_tensor,
)
from engine.data.shm import PAGE, SHM_ROOT, Segment, SegmentAllocator, host_id, reclaim_dead_segments
from engine.data.wire import RefId, ShmLocation, TensorHeader, TensorRef

if TYPE_CHECKING:
    import torch

__all__ = ["RefNotFound", "Reservation", "SentFrames", "StoreConfig", "StoreStats", "StoredTensor", "TensorRef", "TensorStore"]


def _is_cuda(value: object) -> bool:
    return type(value).__module__.startswith("torch") and bool(getattr(value, "is_cuda", False))


class StoreError(Exception):
    pass


class RefNotFound(StoreError):
    """No live tensor under this ref id: never stored, released, or its lease expired."""


# Segment layout: the generation of the ref that occupies it (uint64, little-endian, 0 when
# free) in the first page, the tensor from the second page on (page-aligned for the reader).
DATA_OFFSET = PAGE


@dataclass(frozen=True, slots=True)
class StoreConfig:
    default_lease_s: float = 60.0
    max_lease_s: float = 24 * 3600.0
    inline_max_bytes: int = 64 * KiB
    use_shm: bool = sys.platform.startswith("linux")
    shm_root: str = SHM_ROOT
    pool_bytes: int = 512 * MiB
    pool_idle_s: float = 10.0
    keep_cuda: bool = True
    """Keep CUDA tensors on their GPU (served by CUDA IPC, staged to host memory on demand);
    False stages every CUDA tensor to host memory at `put`."""
    cuda_max_bytes: int = 1 << 30
    """GPU memory the store's copies may hold at once (tensors served in place by `keep` not
    counted): a CUDA tensor put beyond it is staged to host memory at `put` instead."""


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


@dataclass(frozen=True, slots=True)
class StoreStats:
    live_refs: int
    live_bytes: int
    segments: int  # this store's segments on /dev/shm: live ones plus pooled ones
    pooled_segments: int
    pooled_bytes: int


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


class TensorStore:
    """Producer outputs by ref id, with leases. `owner` is the address stamped on refs (the
    address of the server that serves this store)."""

    def __init__(
        self,
        owner: str,
        config: StoreConfig | None = None,
        *,
        host: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.owner = owner
        self.config = config or StoreConfig()
        self.host = host or host_id()
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._entries: dict[RefId, StoredTensor] = {}
        self._leases: list[tuple[float, RefId]] = []  # heap; stale entries skipped on pop
        self._draining: list[tuple[Segment | Callable[[], None], list[SendHandle]]] = []
        """Freed segments and lent tensors' `on_free`, waiting for their sends to finish."""
        self._to_free: list[Callable[[], None]] = []  # lent tensors to give back, outside the lock
        self._reserved: set[Segment] = set()  # taken by reservations not yet committed
        self._epoch = secrets.token_hex(4)  # ids never repeat across restarts at one address
        self._serial = itertools.count()
        self._live_bytes = 0
        self._cuda_bytes = 0
        self._segments: SegmentAllocator | None = None
        if self.config.use_shm:
            reclaim_dead_segments(self.config.shm_root)
            self._segments = SegmentAllocator(
                self.config.shm_root, pool_bytes=self.config.pool_bytes, pool_idle_s=self.config.pool_idle_s
            )

    # --- producing -------------------------------------------------------------------------

    def put(self, tensor: np.ndarray | torch.Tensor, lease_s: float | None = None) -> TensorRef:
        """Keep a copy of `tensor` (one copy, into shared memory when it is large) and return
        its ref. The caller may reuse `tensor` afterwards. A CUDA tensor's copy stays on its
        GPU (`StoreConfig.keep_cuda`)."""
        if self.config.keep_cuda and _is_cuda(tensor) and self._cuda_room(tensor):  # type: ignore[arg-type]
            return self._put_cuda(tensor, lease_s)  # type: ignore[arg-type]
        flat = flatten_tensor(tensor)
        reservation = self._reserve(flat.header)
        reservation.data[:] = flat.data
        return self._commit(reservation, lease_s, flat.device)

    def keep(self, tensor: torch.Tensor) -> TensorRef:
        """Serve the contiguous CUDA tensor `tensor` itself, not a copy, with no lease: until
        `release` or `close`. For long-lived tensors that do not change while they are served
        (model weights shared with other processes of the host by CUDA IPC)."""
        if not _is_cuda(tensor):
            raise ValueError("keep() serves CUDA tensors in place; put() copies any other tensor")
        if not tensor.is_contiguous():
            raise ValueError("keep() needs a contiguous tensor (serving one in place means no copy)")
        return self._put_cuda(tensor, None, copy=False)

    def lend(self, dtype: str, shape: tuple[int, ...], parts: tuple[np.ndarray, ...],
             on_free: Callable[[], None], lease_s: float | None = None) -> TensorRef:
        """Serve the bytes of `parts` (uint8, 1-D, in order; together a C-contiguous tensor of
        `shape` and `dtype`) where they are, without a copy, under a lease like `put`'s; when
        the ref is freed (released or expired) and no zero-copy send reads them any more,
        `on_free()` is called once (from a thread of the store's, not under its lock): the
        lender may reuse them from then on, not before. They travel as TCP chunks only
        (several frames to a chunk, one per part it touches): never through shared memory nor
        inline."""
        if dtype not in DTYPE_SIZES:
            raise UnsupportedTensor(f"unknown dtype {dtype!r}")
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        if sum(part.nbytes for part in parts) != nbytes or any(part.dtype != np.uint8 or part.ndim != 1
                                                               for part in parts):
            raise ValueError(f"parts are not the {nbytes} bytes of a {dtype} tensor of shape {shape}")
        lease = self._lease_seconds(lease_s)
        header = TensorHeader(dtype, shape, contiguous_strides(shape), nbytes)
        ref = TensorRef(owner=self.owner, id=RefId(f"{self._epoch}.{next(self._serial)}"), dtype=dtype,
                        shape=shape, nbytes=nbytes, lease_expires_at=self._wall() + lease, host=self.host,
                        device="cpu")
        expires = self._clock() + lease
        with self._lock:
            self._entries[ref.id] = StoredTensor(ref, header, None, None, expires, parts=parts, on_free=on_free)
            heapq.heappush(self._leases, (expires, ref.id))
            self._live_bytes += nbytes
        return ref

    def _cuda_room(self, tensor: torch.Tensor) -> bool:
        with self._lock:
            return self._cuda_bytes + tensor.numel() * tensor.element_size() <= self.config.cuda_max_bytes

    def _put_cuda(self, tensor: torch.Tensor, lease_s: float | None, *, copy: bool = True) -> TensorRef:
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in DTYPE_SIZES:
            raise UnsupportedTensor(f"dtype {tensor.dtype} cannot travel on the wire")
        source = tensor.detach()
        gpu = source.contiguous()
        if copy and gpu.data_ptr() == source.data_ptr():
            gpu = gpu.clone()  # the store's own copy: the caller may reuse its tensor
        shape = tuple(int(d) for d in gpu.shape)
        header = TensorHeader(name, shape, contiguous_strides(shape), gpu.numel() * gpu.element_size())
        # Kept tensors (no copy) have no lease: they stay until released.
        lease = self._lease_seconds(lease_s) if copy else math.inf
        serial = next(self._serial)
        ref = TensorRef(owner=self.owner, id=RefId(f"{self._epoch}.{serial}"), dtype=name, shape=shape,
                        nbytes=header.nbytes, lease_expires_at=self._wall() + lease, host=self.host,
                        device=str(gpu.device))
        import torch

        ready = torch.cuda.Event()
        ready.record()  # on this thread's current stream, which made the copy
        expires = self._clock() + lease
        with self._lock:
            self._entries[ref.id] = StoredTensor(ref, header, None, None, expires, cuda=gpu, cuda_ready=ready,
                                                 cuda_budgeted=copy)
            if copy:
                self._cuda_bytes += header.nbytes
            if math.isfinite(expires):
                heapq.heappush(self._leases, (expires, ref.id))
            self._live_bytes += header.nbytes
        return ref

    def reserve(self, shape: tuple[int, ...], dtype: str) -> Reservation:
        """A writable buffer for a tensor of `shape` and `dtype` (wire name, e.g. "float32"),
        for producers that compute straight into the store; then `commit` it."""
        if dtype not in DTYPE_SIZES:
            raise UnsupportedTensor(f"unknown dtype {dtype!r}")
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        return self._reserve(TensorHeader(dtype, shape, contiguous_strides(shape), nbytes))

    def commit(self, reservation: Reservation, lease_s: float | None = None) -> TensorRef:
        if reservation.committed:
            raise StoreError("reservation already committed or aborted")
        return self._commit(reservation, lease_s, "cpu")

    def abort(self, reservation: Reservation) -> None:
        """Give back a reservation that will not be committed."""
        if reservation.committed:
            raise StoreError("reservation already committed or aborted")
        reservation.committed = True
        if reservation.segment is not None:
            with self._lock:
                self._reserved.discard(reservation.segment)
                self._draining.append((reservation.segment, []))
                self._drain()

    def _reserve(self, header: TensorHeader) -> Reservation:
        if self._segments is not None and header.nbytes > self.config.inline_max_bytes:
            with self._lock:
                return self._reserve_locked(header)
        return Reservation(header, np.empty(header.nbytes, np.uint8), None)

    def _reserve_locked(self, header: TensorHeader) -> Reservation:
        if self._segments is not None and header.nbytes > self.config.inline_max_bytes:
            self._drain()
            segment = self._segments.take(DATA_OFFSET + header.nbytes)
            self._reserved.add(segment)
            return Reservation(header, segment.array[DATA_OFFSET : DATA_OFFSET + header.nbytes], segment)
        return Reservation(header, np.empty(header.nbytes, np.uint8), None)

    def _stage_locked(self, entry: StoredTensor) -> None:
        """Give a CUDA entry its host bytes (once): into a segment when large, like `put`."""
        if entry.data is not None or entry.cuda is None:
            return
        flat = flatten_tensor(entry.cuda)  # the device-to-host copy
        reservation = self._reserve_locked(entry.header)
        reservation.data[:] = flat.data
        reservation.committed = True
        reservation.data.flags.writeable = False
        entry.data = reservation.data
        segment = reservation.segment
        if segment is not None:
            self._reserved.discard(segment)
            entry.segment = segment
            # The generation of a staged tensor is its serial + 1, as if it had been put here.
            serial = int(entry.ref.id.rsplit(".", 1)[1])
            entry.location = ShmLocation(segment.name, segment.size, DATA_OFFSET, generation=serial + 1)
            segment.array[:8].view(np.uint64)[0] = entry.location.generation

    def _commit(self, reservation: Reservation, lease_s: float | None, device: str) -> TensorRef:
        reservation.committed = True
        lease = self._lease_seconds(lease_s)
        header = reservation.header
        serial = next(self._serial)
        ref_id = RefId(f"{self._epoch}.{serial}")
        segment = reservation.segment
        location = None
        if segment is not None:
            location = ShmLocation(segment.name, segment.size, DATA_OFFSET, generation=serial + 1)
        ref = TensorRef(
            owner=self.owner,
            id=ref_id,
            dtype=header.dtype,
            shape=header.shape,
            nbytes=header.nbytes,
            lease_expires_at=self._wall() + lease,
            host=self.host,
            device=device,
            shm=location,
        )
        data = reservation.data
        data.flags.writeable = False
        expires = self._clock() + lease
        with self._lock:
            if segment is not None and location is not None:
                self._reserved.discard(segment)
                # Written after the data: a reader that sees this generation sees the tensor.
                segment.array[:8].view(np.uint64)[0] = location.generation
            self._entries[ref_id] = StoredTensor(ref, header, data, segment, expires, location=location)
            heapq.heappush(self._leases, (expires, ref_id))
            self._live_bytes += header.nbytes
        return ref

    def _lease_seconds(self, lease_s: float | None) -> float:
        lease = self.config.default_lease_s if lease_s is None else float(lease_s)
        if not 0 < lease <= self.config.max_lease_s:
            raise ValueError(f"lease must be in (0, {self.config.max_lease_s}] seconds, got {lease}")
        return lease

    # --- serving ---------------------------------------------------------------------------

    def get(self, ref_id: RefId) -> StoredTensor:
        """The live tensor under `ref_id`; raises `RefNotFound` (also once its lease expired).
        Its bytes may be recycled as soon as it is released: readers that must not see that
        happen use `serve`."""
        with self._lock:
            return self._live(ref_id)

    def serve(self, ref_id: RefId, send: Callable[[StoredTensor], SendHandle | None], *, host: bool = True) -> None:
        """Call `send(entry)` while `ref_id` cannot be released. If it returns a handle (a
        zero-copy send still reading the bytes), the entry's segment is not recycled before the
        handle is done, even if the ref is released meanwhile. With `host`, a CUDA entry is
        staged to host memory first (`entry.data` is set). Raises `RefNotFound`."""
        with self._lock:
            entry = self._live(ref_id)
            if entry.cuda_ready is not None:  # the producer's copy is complete before anyone reads it
                entry.cuda_ready.synchronize()
                entry.cuda_ready = None
            if host:
                self._stage_locked(entry)
            handle = send(entry)
            if handle is not None and (entry.segment is not None or entry.on_free is not None):
                entry.sends = [h for h in entry.sends if not h.done]
                entry.sends.append(handle)

    def _live(self, ref_id: RefId) -> StoredTensor:
        entry = self._entries.get(ref_id)
        if entry is not None and entry.expires <= self._clock():
            self._drop(entry)
            entry = None
        if entry is None:
            raise RefNotFound(f"no live tensor {ref_id!r}")
        return entry

    def extend(self, ref_id: RefId, lease_s: float) -> float:
        """Extend the lease to `lease_s` from now; returns the new expiry as a UNIX time."""
        lease = self._lease_seconds(lease_s)
        with self._lock:
            entry = self._entries.get(ref_id)
            now = self._clock()
            if entry is None or entry.expires <= now:
                raise RefNotFound(f"no live tensor {ref_id!r}")
            if math.isinf(entry.expires):
                return math.inf  # kept until released: no lease to extend
            entry.expires = now + lease
            heapq.heappush(self._leases, (entry.expires, ref_id))
        return self._wall() + lease

    def release(self, ref_id: RefId) -> bool:
        """Free the tensor now; False if it was not live. Views that consumers mapped stay
        readable but may be overwritten once the segment is reused."""
        with self._lock:
            entry = self._entries.get(ref_id)
            if entry is not None:
                self._drop(entry)
        self._give_back()
        return entry is not None

    def sweep(self, now: float | None = None) -> list[RefId]:
        """Free every tensor whose lease ended by `now` (monotonic; default: the clock), let
        go of idle pooled segments and reclaim dead processes' segments. Returns freed ids."""
        freed: list[RefId] = []
        with self._lock:
            now = self._clock() if now is None else now
            while self._leases and self._leases[0][0] <= now:
                _expires, ref_id = heapq.heappop(self._leases)
                entry = self._entries.get(ref_id)
                if entry is not None and entry.expires <= now:
                    self._drop(entry)
                    freed.append(ref_id)
            self._drain()
            if self._segments is not None:
                self._segments.trim(now)
        self._give_back()
        return freed

    def reclaim_dead(self) -> list[str]:
        """Unlink segments of dead processes on this host (any producer may do this)."""
        return reclaim_dead_segments(self.config.shm_root)

    def _drop(self, entry: StoredTensor) -> None:
        del self._entries[entry.ref.id]
        if entry.cuda_budgeted:
            self._cuda_bytes -= entry.header.nbytes
        entry.cuda = None  # freed, or parked by torch until consumers' mappings are gone
        entry.cuda_ready = None
        self._live_bytes -= entry.header.nbytes
        if entry.segment is not None:
            entry.segment.array[:8].view(np.uint64)[0] = 0  # in-place readers must ask the owner now
            self._draining.append((entry.segment, entry.sends))
            self._drain()
        elif entry.on_free is not None:
            entry.parts = None
            self._draining.append((entry.on_free, entry.sends))
            self._drain()

    def _drain(self) -> None:
        """Recycle released segments, and queue lent tensors for `_give_back`, once no
        zero-copy send still reads them."""
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

    def _give_back(self) -> None:
        """Call the `on_free` of lent tensors that `_drain` found done (outside the store's
        lock: the lender takes its own)."""
        with self._lock:
            to_free, self._to_free = self._to_free, []
        for on_free in to_free:
            on_free()

    # --- introspection and shutdown ----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ref_id: object) -> bool:
        return ref_id in self._entries

    def stats(self) -> StoreStats:
        with self._lock:
            live_segments = sum(1 for e in self._entries.values() if e.segment is not None)
            pooled = self._segments.pooled_segments if self._segments else 0
            pooled_bytes = self._segments.pooled_bytes if self._segments else 0
            return StoreStats(
                live_refs=len(self._entries),
                live_bytes=self._live_bytes,
                segments=live_segments + pooled + len(self._draining) + len(self._reserved),
                pooled_segments=pooled,
                pooled_bytes=pooled_bytes,
            )

    def close(self) -> None:
        """Free everything and unlink every segment this store created."""
        with self._lock:
            lent = [e.on_free for e in self._entries.values() if e.on_free is not None]
            for entry in list(self._entries.values()):
                if entry.segment is not None:
                    entry.segment.unlink()
            self._entries.clear()
            self._leases.clear()
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
            self._live_bytes = 0
            self._cuda_bytes = 0
            if self._segments is not None:
                self._segments.close()
        for on_free in lent:  # the lenders' buffers are theirs again: nothing here sends any more
            on_free()
