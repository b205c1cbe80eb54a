"""SGLang's KV and aux buffers, read and written through the raw pointers in `KVArgs`."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVArgs

from engine.compute.sglang.transfer.config import KVTransferConfigError, KVTransferError


class _CudaBytes:
    """A device buffer given by pointer, as torch reads it (`__cuda_array_interface__`)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def byte_view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A writable uint8 view of `nbytes` at `ptr` on `device` (no copy). The memory belongs to
    SGLang's pools; the view is valid while they live."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(ptr), dtype=torch.uint8)
    if device.type == "cuda":
        return torch.as_tensor(_CudaBytes(ptr, nbytes), device=device)
    raise KVTransferConfigError(f"buffers on {device} are not supported")


@dataclass(frozen=True, slots=True)
class KVBuffers:
    """A list of same-kind buffers (KV per layer, or aux) as rows of `item_lens[i]` bytes."""

    rows: tuple[torch.Tensor, ...]
    item_lens: tuple[int, ...]

    @classmethod
    def of(cls, ptrs: list[int], lens: list[int], item_lens: list[int], device: torch.device) -> KVBuffers:
        if not len(ptrs) == len(lens) == len(item_lens):
            raise KVTransferConfigError("KVArgs buffer lists of different lengths")
        rows = []
        for ptr, nbytes, item in zip(ptrs, lens, item_lens, strict=True):
            if item <= 0 or nbytes % item:
                raise KVTransferConfigError(f"a buffer of {nbytes} bytes is not rows of {item} bytes")
            rows.append(byte_view(ptr, nbytes, device).view(-1, item))
        return cls(tuple(rows), tuple(int(i) for i in item_lens))

    def nbytes(self, count: int) -> int:
        return count * sum(self.item_lens)

    def gather(self, indices: np.ndarray) -> list[torch.Tensor]:
        """Rows `indices` of each buffer, flat, in host memory (one tensor per buffer)."""
        if not self.rows:
            return []
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64), device=self.rows[0].device)
        self._check(index)
        return [rows.index_select(0, index).reshape(-1).cpu() for rows in self.rows]

    def scatter(self, indices: np.ndarray, data: torch.Tensor) -> None:
        """Write `data` (as `gather` made it) into rows `indices` of every buffer."""
        if not self.rows:
            return
        device = self.rows[0].device
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64), device=device)
        self._check(index)
        offset = 0
        for rows, item in zip(self.rows, self.item_lens, strict=True):
            size = len(index) * item
            rows.index_copy_(0, index, data[offset : offset + size].to(device).view(-1, item))
            offset += size
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _check(self, index: torch.Tensor) -> None:
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= min(len(r) for r in self.rows)):
            raise KVTransferError(f"page index outside the buffers ({len(self.rows[0])} rows)")


def kv_device(server_args: Any, kv_args: KVArgs) -> torch.device:
    device = str(getattr(server_args, "device", "cuda"))
    if device == "cuda":
        return torch.device("cuda", int(kv_args.gpu_id))
    if device == "cpu":
        return torch.device("cpu")
    raise KVTransferConfigError(f"the omniflow transfer backend reads KV on cuda or cpu, not {device!r}")
