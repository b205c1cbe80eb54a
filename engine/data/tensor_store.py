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

`TensorStore` is the public face: it owns the lock and the clocks, and under the lock calls its
parts: `engine.data.ref_table.RefTable` (the live refs, their ids and leases) and
`engine.data.store_memory.StoreMemory` (segments, their recycling after zero-copy sends, lent
buffers' give-back, the GPU budget). `StoredTensor` (one live tensor) is in `ref_table`;
`Reservation`, `SendHandle` and the segment layout are in `store_memory`.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.data.codec import (
    DTYPE_SIZES,
    KiB,
    MiB,
    UnsupportedTensor,
    contiguous_strides,
    flatten_tensor,
)
from engine.data.ref_table import RefTable, StoredTensor, generation_of
from engine.data.shm import SHM_ROOT, SegmentAllocator, host_id, reclaim_dead_segments
from engine.data.store_memory import Reservation, SendHandle, StoreMemory
from engine.data.wire import RefId, TensorHeader, TensorRef

if TYPE_CHECKING:
    import torch

__all__ = ["RefNotFound", "StoreConfig", "StoreError", "StoreStats", "TensorRef", "TensorStore"]


def _is_cuda(value: object) -> bool:
    return type(value).__module__.startswith("torch") and bool(getattr(value, "is_cuda", False))


class StoreError(Exception):
    pass


class RefNotFound(StoreError):
    """No live tensor under this ref id: never stored, released, or its lease expired."""


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


@dataclass(frozen=True, slots=True)
class StoreStats:
    live_refs: int
    live_bytes: int
    segments: int  # this store's segments on /dev/shm: live ones plus pooled ones
    pooled_segments: int
    pooled_bytes: int


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
        self._refs = RefTable(owner, self.host, default_lease_s=self.config.default_lease_s,
                              max_lease_s=self.config.max_lease_s, wall_clock=wall_clock)
        segments = None
        if self.config.use_shm:
            reclaim_dead_segments(self.config.shm_root)
            segments = SegmentAllocator(
                self.config.shm_root, pool_bytes=self.config.pool_bytes, pool_idle_s=self.config.pool_idle_s
            )
        self._memory = StoreMemory(segments, inline_max_bytes=self.config.inline_max_bytes,
                                   cuda_max_bytes=self.config.cuda_max_bytes, clock=clock)

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
        lease = self._refs.lease_seconds(lease_s)
        header = TensorHeader(dtype, shape, contiguous_strides(shape), nbytes)
        ref = self._refs.new_ref(self._refs.next_id(), header, lease, "cpu")
        expires = self._clock() + lease
        with self._lock:
            self._refs.add(StoredTensor(ref, header, None, None, expires, parts=parts, on_free=on_free))
        return ref

    def _cuda_room(self, tensor: torch.Tensor) -> bool:
        with self._lock:
            return self._memory.cuda_room(tensor.numel() * tensor.element_size())

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
        lease = self._refs.lease_seconds(lease_s) if copy else math.inf
        ref = self._refs.new_ref(self._refs.next_id(), header, lease, str(gpu.device))
        import torch

        ready = torch.cuda.Event()
        ready.record()  # on this thread's current stream, which made the copy
        expires = self._clock() + lease
        with self._lock:
            self._refs.add(StoredTensor(ref, header, None, None, expires, cuda=gpu, cuda_ready=ready,
                                        cuda_budgeted=copy))
            if copy:
                self._memory.charge_cuda(header.nbytes)
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
                self._memory.abort(reservation.segment)

    def _reserve(self, header: TensorHeader) -> Reservation:
        if not self._memory.in_segment(header.nbytes):
            return self._memory.reserve(header)  # private memory: nothing shared to guard
        with self._lock:
            return self._memory.reserve(header)

    def _stage_locked(self, entry: StoredTensor) -> None:
        """Give a CUDA entry its host bytes (once): into a segment when large, like `put`."""
        if entry.data is not None or entry.cuda is None:
            return
        flat = flatten_tensor(entry.cuda)  # the device-to-host copy
        reservation = self._memory.reserve(entry.header)
        reservation.data[:] = flat.data
        reservation.committed = True
        reservation.data.flags.writeable = False
        entry.data = reservation.data
        segment = reservation.segment
        if segment is not None:
            entry.segment = segment
            # Stamped with the generation of its ref, as if it had been put here.
            entry.location = self._memory.publish(segment, generation_of(entry.ref.id))

    def _commit(self, reservation: Reservation, lease_s: float | None, device: str) -> TensorRef:
        reservation.committed = True
        lease = self._refs.lease_seconds(lease_s)
        header = reservation.header
        ref_id = self._refs.next_id()
        segment = reservation.segment
        data = reservation.data
        data.flags.writeable = False
        expires = self._clock() + lease
        with self._lock:
            # Stamped after the data: a reader that sees this generation sees the tensor.
            location = None if segment is None else self._memory.publish(segment, generation_of(ref_id))
            ref = self._refs.new_ref(ref_id, header, lease, device, shm=location)
            self._refs.add(StoredTensor(ref, header, data, segment, expires, location=location))
        return ref

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
        entry = self._refs.get(ref_id)
        if entry is not None and entry.expires <= self._clock():
            self._refs.remove(entry)
            self._free(entry)
            entry = None
        if entry is None:
            raise RefNotFound(f"no live tensor {ref_id!r}")
        return entry

    def extend(self, ref_id: RefId, lease_s: float) -> float:
        """Extend the lease to `lease_s` from now; returns the new expiry as a UNIX time."""
        lease = self._refs.lease_seconds(lease_s)
        with self._lock:
            entry = self._refs.get(ref_id)
            now = self._clock()
            if entry is None or entry.expires <= now:
                raise RefNotFound(f"no live tensor {ref_id!r}")
            if math.isinf(entry.expires):
                return math.inf  # kept until released: no lease to extend
            self._refs.extend(entry, now + lease)
        return self._wall() + lease

    def release(self, ref_id: RefId) -> bool:
        """Free the tensor now; False if it was not live. Views that consumers mapped stay
        readable but may be overwritten once the segment is reused."""
        with self._lock:
            entry = self._refs.get(ref_id)
            if entry is not None:
                self._refs.remove(entry)
                self._free(entry)
        self._give_back()
        return entry is not None

    def sweep(self, now: float | None = None) -> list[RefId]:
        """Free every tensor whose lease ended by `now` (monotonic; default: the clock), let
        go of idle pooled segments and reclaim dead processes' segments. Returns freed ids."""
        with self._lock:
            now = self._clock() if now is None else now
            expired = self._refs.expired(now)
            for entry in expired:
                self._free(entry)
            self._memory.drain()
            self._memory.trim(now)
        self._give_back()
        return [entry.ref.id for entry in expired]

    def reclaim_dead(self) -> list[str]:
        """Unlink segments of dead processes on this host (any producer may do this)."""
        return reclaim_dead_segments(self.config.shm_root)

    def _free(self, entry: StoredTensor) -> None:
        """Free what `entry`, just taken out of the ref table, holds."""
        if entry.cuda_budgeted:
            self._memory.refund_cuda(entry.header.nbytes)
        entry.cuda = None  # freed, or parked by torch until consumers' mappings are gone
        entry.cuda_ready = None
        if entry.segment is not None:
            self._memory.free_segment(entry.segment, entry.sends)
        elif entry.on_free is not None:
            entry.parts = None
            self._memory.free_lent(entry.on_free, entry.sends)

    def _give_back(self) -> None:
        """Call the `on_free` of lent tensors whose sends are done (outside the store's lock:
        the lender takes its own)."""
        with self._lock:
            to_free = self._memory.take_lent()
        for on_free in to_free:
            on_free()

    # --- introspection and shutdown ----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, ref_id: object) -> bool:
        return ref_id in self._refs

    def stats(self) -> StoreStats:
        with self._lock:
            live_segments = sum(1 for e in self._refs.values() if e.segment is not None)
            return StoreStats(
                live_refs=len(self._refs),
                live_bytes=self._refs.live_bytes,
                segments=live_segments + self._memory.unheld_segments,
                pooled_segments=self._memory.pooled_segments,
                pooled_bytes=self._memory.pooled_bytes,
            )

    def close(self) -> None:
        """Free everything and unlink every segment this store created."""
        with self._lock:
            entries = list(self._refs.values())
            lent = [e.on_free for e in entries if e.on_free is not None]
            for entry in entries:
                if entry.segment is not None:
                    entry.segment.unlink()
            self._refs.clear()
            lent.extend(self._memory.close())
        for on_free in lent:  # the lenders' buffers are theirs again: nothing here sends any more
            on_free()
