"""CUDA IPC: a GPU allocation of one process opened by another process of the same host.

Built on torch's own CUDA IPC (what `torch.multiprocessing` uses underneath), without its
pickling: `share` turns a CUDA tensor's storage into a `CudaIpcHandle` (plain bytes and
ints, carried as msgpack), `open_shared` maps it in the consumer as a tensor on the same
memory. torch keeps the producer's block alive while consumers hold it: each `share` counts
one reference in a shared-memory counter, the consumer's mapping gives it back when it is
freed, and a producer that drops the tensor earlier parks the block until the count is
zero. A handle that is shared but never opened must be given back with `release_unopened`,
or the producer's block stays parked until it exits.

The producer must stay alive while consumers use the memory (the driver frees an
allocation with the process that made it): consumers that outlive it copy (`clone()`).
torch is imported by the functions that need it, never by importing this module.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from engine.data.codec import DTYPE_SIZES
from engine.data.wire import CudaIpcHandle, TensorHeader

if TYPE_CHECKING:
    import torch


class CudaIpcUnavailable(RuntimeError):
    """This process cannot share or open CUDA memory (no torch, no CUDA, or not the same host)."""


class CudaIpcOpenError(CudaIpcUnavailable):
    """The driver would not open the handle (another GPU set, a container): nothing was mapped,
    so the reference it counted is still to be given back (`release_unopened`)."""


def available() -> bool:
    """Whether this process can use CUDA IPC: torch is already imported and sees a GPU.

    A process that never imported torch holds no CUDA tensors to share, and importing
    torch (seconds) just to find out is not worth it."""
    if "torch" not in sys.modules:
        return False
    import torch

    return bool(torch.cuda.is_available())


def share(tensor: torch.Tensor) -> tuple[CudaIpcHandle, int]:
    """A handle on the storage under the CUDA tensor `tensor`, and the tensor's byte offset
    in that storage. Each call counts one reference that the consumer gives back."""
    if tensor.device.type != "cuda":
        raise CudaIpcUnavailable(f"a {tensor.device} tensor cannot go by CUDA IPC")
    storage = tensor.untyped_storage()
    (device, handle, storage_size, storage_offset, counter_handle, counter_offset, event_handle,
     event_sync_required) = storage._share_cuda_()
    shared = CudaIpcHandle(
        device=int(device),
        handle=bytes(handle),
        storage_size=int(storage_size),
        storage_offset=int(storage_offset),
        ref_counter_handle=bytes(counter_handle),
        ref_counter_offset=int(counter_offset),
        event_handle=bytes(event_handle) if event_handle is not None else None,
        event_sync_required=bool(event_sync_required),
    )
    return shared, tensor.storage_offset() * tensor.element_size()


def open_shared(shared: CudaIpcHandle, header: TensorHeader) -> torch.Tensor:
    """The producer's tensor described by `header` (`header.offset`: its byte offset in the
    storage), mapped from `shared` without a copy, on the producer's device index.

    Raises CudaIpcUnavailable, ValueError or CudaIpcOpenError before anything is mapped: then
    the handle's reference is the caller's to give back (`release_unopened`). Once mapped, the
    tensor's storage gives it back when it is freed."""
    if not available():
        raise CudaIpcUnavailable("this process has no CUDA")
    import torch

    itemsize = DTYPE_SIZES[header.dtype]
    if header.offset % itemsize or header.offset + header.nbytes > shared.storage_size:
        raise ValueError(f"a {header.dtype}{list(header.shape)} tensor at byte {header.offset} does not fit"
                         f" a shared storage of {shared.storage_size} bytes")
    if shared.device >= torch.cuda.device_count():
        raise CudaIpcUnavailable(f"the owner's cuda:{shared.device} is not visible here")
    dtype = getattr(torch, header.dtype)
    tensor = torch.empty(0, dtype=dtype, device=torch.device("cuda", shared.device))
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            shared.device, shared.handle, shared.storage_size, shared.storage_offset,
            shared.ref_counter_handle, shared.ref_counter_offset,
            shared.event_handle, shared.event_sync_required,
        )
    except RuntimeError as exc:
        raise CudaIpcOpenError(f"cannot open the owner's CUDA memory: {exc}") from exc
    return tensor.set_(storage, header.offset // itemsize, header.shape, header.strides)


def release_unopened(shared: CudaIpcHandle) -> None:
    """Give back the reference `share` counted for a handle nobody will open."""
    import torch

    torch.UntypedStorage._release_ipc_counter_cuda(shared.ref_counter_handle, shared.ref_counter_offset)
