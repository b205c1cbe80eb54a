"""Model weights on a GPU shared between the processes of one host through CUDA IPC.

The GPU counterpart of `engine.compute.weights.shared.HostWeights`, carried by the transfer
plane instead of a segment of its own. The first process to load a model on a GPU
*publishes* it: every unique CUDA parameter and buffer is served in place by the process's
tensor store (`TensorStore.keep`: no copy, no lease), and a small JSON index file under
`root` names the refs under the model's key, with the publisher's pid and process start
time. Another process of the host *attaches*: it reads the index, builds the module as an
empty skeleton on the `meta` device and pulls every ref from the publisher's tensor server
by CUDA IPC only (`engine.data.cuda_ipc`): each tensor is the publisher's GPU memory mapped,
so N processes hold one copy on the GPU. No pickle anywhere: the index is JSON (msgspec),
the tensors travel as IPC handles.

Contract, and what differs from host sharing:
* Attached tensors are the publisher's memory, not a copy and not write-protected: inference
  never writes weights; a process that did would change them for every process.
* The publisher process must outlive every process attached to it. CUDA memory belongs to
  the process that allocated it: when the publisher *exits* (or is killed), its allocations
  go with its CUDA context, and what the attached modules read is undefined (CUDA's rule
  for IPC memory): expect a CUDA error that poisons the attached process's context, or
  wrong weights. Nothing here checks that on every read; a role worker's heartbeat asks
  its `WeightStore.orphaned()` and stops the worker (exit status 4) once a publisher of
  weights it attached is gone, so its calls move to other replicas. While the publisher lives, its `close()` is
  safe: it withdraws the index (no new process attaches) and releases its refs, and torch
  keeps each block allocated until the last mapping of it is gone.
* Index files of publishers that died are removed by `reclaim`; their GPU memory went with
  them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from engine.compute.weights.shared import (
    ModuleTensor,
    SharedWeightsError,
    _assign,
    _named_tensors,
    index_path,
    reclaim_dead_indexes,
)
from engine.data.channel import TransferError
from engine.data.codec import DTYPE_SIZES
from engine.data.shm import SHM_ROOT, SegmentError, SegmentOwner
from engine.data.wire import RefId, TensorRef, Transport

if TYPE_CHECKING:
    from engine.data.peer import Peer

DEVICE_WEIGHTS_PREFIX = "omniflowcudaweights"


class KeptTensor(ModuleTensor, frozen=True):
    """A tensor of a module shared on its GPU: served under ref `id` by the publisher (tied
    weights: several names, one id)."""

    id: str
    nbytes: int


class DeviceWeightsManifest(msgspec.Struct, frozen=True):
    """The index file of one published module: who serves it (`pid` started at `start`, a
    token of `engine.data.shm.process_start_token`, on `host`, tensor server at `data`), on
    which GPU (`device`, and its `device_uuid`, so that a process whose numbering of the GPUs
    differs does not attach to another one), its tensors, and `meta` (whatever the
    publisher records to rebuild the module's skeleton, as for `HostWeights`)."""

    key: str
    pid: int
    start: str
    host: str
    data: str
    device: str
    device_uuid: str
    tensors: tuple[KeptTensor, ...]
    meta: dict[str, Any] = {}

    @property
    def owner(self) -> SegmentOwner:
        return SegmentOwner(self.pid, self.start)

    def ref(self, tensor: KeptTensor) -> TensorRef:
        """The ref of `tensor` as the publisher's store issued it (kept refs have no lease)."""
        return TensorRef(owner=self.data, id=RefId(tensor.id), dtype=tensor.dtype, shape=tensor.shape,
                         nbytes=tensor.nbytes, lease_expires_at=math.inf, host=self.host, device=self.device)


def write_index(path: str, manifest: DeviceWeightsManifest, staging_suffix: str) -> None:
    """Write `manifest` to `path` atomically: readers see the old index or the new one. The
    staging file is `<path>.<staging_suffix>`; the suffix names its writer for `reclaim`."""
    staging = f"{path}.{staging_suffix}"
    with open(staging, "wb") as f:
        f.write(msgspec.json.encode(manifest))
    os.replace(staging, path)


def read_index(path: str) -> DeviceWeightsManifest:
    """The manifest in the index file `path`. Raises `FileNotFoundError`, or
    `SharedWeightsError` when the file is not a readable index."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return msgspec.json.decode(raw, type=DeviceWeightsManifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SharedWeightsError(f"unreadable CUDA weights index {path}: {exc}") from exc


def _device_uuid(device: torch.device) -> str:
    """The GPU's UUID: the same in every process, whatever index CUDA_VISIBLE_DEVICES gives it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = torch.cuda.get_device_properties(index).uuid
    # torch's `_CUuuid` carries the 16 raw bytes; its str() formatting is not part of its contract.
    raw = getattr(uuid, "bytes", None)
    return bytes(raw).hex() if raw is not None else str(uuid)


@dataclass(slots=True, eq=False)
class _Published:
    manifest: DeviceWeightsManifest
    index_path: str
    ref_ids: tuple[RefId, ...]


class DeviceWeights:
    """The host-local directory of weights published on GPUs, by key, served by `peer` (this
    process's seat on the transfer plane, which must outlive this object). One per worker
    process (owned by its `WeightStore`); every process of the host sees the same directory
    (`root`). See the module docstring for the publisher's lifetime contract."""

    def __init__(self, peer: Peer, root: str = SHM_ROOT, prefix: str = DEVICE_WEIGHTS_PREFIX,
                 timeout_s: float = 30.0) -> None:
        self.peer = peer
        self.root = root
        self.prefix = prefix
        self.timeout_s = timeout_s
        try:
            owner = SegmentOwner.current()
        except SegmentError as exc:
            raise SharedWeightsError(str(exc)) from exc
        self._pid, self._start = owner.pid, owner.start
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self._published: list[_Published] = []

    def index_path(self, key: str) -> str:
        return index_path(self.root, self.prefix, key)

    def lookup(self, key: str) -> DeviceWeightsManifest | None:
        """The manifest published under `key` by a live process of this host, if any. Raises
        `SharedWeightsError` when the index file is garbled."""
        try:
            manifest = read_index(self.index_path(key))
        except FileNotFoundError:
            return None
        if manifest.key != key or manifest.host != self.peer.host or not manifest.owner.alive():
            return None
        return manifest

    def publisher_alive(self, manifest: DeviceWeightsManifest) -> bool:
        """Whether the process that published `manifest` still runs: modules attached to it are
        valid only while it does."""
        return manifest.owner.alive()

    def publish(self, key: str, module: torch.nn.Module, meta: dict[str, Any] | None = None) -> DeviceWeightsManifest:
        """Serve `module`'s parameters and buffers in place (tied weights once) and name them under
        `key`. Every tensor must be on one CUDA device; non-contiguous ones are made contiguous
        and re-assigned in the module first. Parameters become non-trainable. The memory stays
        served until `close`, whatever becomes of `module`."""
        named = _named_tensors(module)
        if not named:
            raise SharedWeightsError(f"{key!r}: the module has no parameters or buffers to share")
        devices = {tensor.device for _name, _kind, tensor in named}
        for name, _kind, tensor in named:
            if tensor.device.type != "cuda":
                raise SharedWeightsError(f"{name} is on {tensor.device}: DeviceWeights shares CUDA tensors"
                                         " (HostWeights shares CPU ones)")
            if str(tensor.dtype).removeprefix("torch.") not in DTYPE_SIZES:
                raise SharedWeightsError(f"{name}: dtype {tensor.dtype} cannot be shared")
        if len(devices) != 1:
            raise SharedWeightsError(f"{key!r} spans {sorted(map(str, devices))}: one device per published module")
        (device,) = devices
        kept: dict[tuple[int, int, torch.dtype, tuple[int, ...], tuple[int, ...]], tuple[TensorRef, torch.Tensor]] = {}
        entries: list[KeptTensor] = []
        with contextlib.ExitStack() as undo:  # a failed publish serves nothing
            with torch.no_grad():
                for name, kind, tensor in named:
                    # Tied weights are one tensor under several names (and views of one storage
                    # with one layout are one tensor): kept, and later opened, once.
                    ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype,
                             tuple(tensor.shape), tuple(tensor.stride()))
                    if ident not in kept:
                        served = tensor.detach().contiguous()  # no copy unless non-contiguous
                        ref = self.peer.store.keep(served)
                        undo.callback(self.peer.store.release, ref.id)
                        kept[ident] = (ref, served)
                    ref, served = kept[ident]
                    _assign(module, name, kind, served)  # the module now holds what is served
                    entries.append(KeptTensor(name, kind, ref.dtype, ref.shape, id=ref.id, nbytes=ref.nbytes))
            manifest = DeviceWeightsManifest(
                key=key, pid=self._pid, start=self._start, host=self.peer.host, data=self.peer.address,
                device=str(device), device_uuid=_device_uuid(device), tensors=tuple(entries),
                meta=dict(meta or {}),
            )
            path = self.index_path(key)
            write_index(path, manifest, f"{self.prefix}-{self._pid}-{self._start}-{next(self._serial)}")
            undo.pop_all()
        with self._lock:
            self._published.append(_Published(manifest, path, tuple(ref.id for ref, _ in kept.values())))
        del named, kept
        return manifest

    def attach(self, manifest: DeviceWeightsManifest, skeleton: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """Build `skeleton()` on the meta device (no memory) and point every tensor at the
        publisher's GPU memory, opened by CUDA IPC (never copied: any other transport is
        refused). Raises `SharedWeightsError` when the module does not match, this process
        cannot open the memory, or the publisher does not answer within `timeout_s`.

        The module is valid only while the publisher process lives (module docstring)."""
        if not torch.cuda.is_available():
            raise SharedWeightsError(f"{manifest.key!r} lives on {manifest.device}; this process has no CUDA")
        device = torch.device(manifest.device)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SharedWeightsError(f"{manifest.key!r} lives on {manifest.device}, which this process does not see")
        if _device_uuid(device) != manifest.device_uuid:
            raise SharedWeightsError(f"{manifest.device} of this process is not the publisher's"
                                     f" {manifest.device} (CUDA_VISIBLE_DEVICES differs)")
        with torch.device("meta"):
            module = skeleton()
        expected = {name: (kind, tuple(t.shape)) for name, kind, t in _named_tensors(module)}
        given = {e.name: (e.kind, e.shape) for e in manifest.tensors}
        if expected != given:
            missing = sorted(n for n in expected if given.get(n) != expected[n])[:4]
            extra = sorted(n for n in given if expected.get(n) != given[n])[:4]
            raise SharedWeightsError(f"the skeleton does not match {manifest.key!r}: missing or reshaped {missing},"
                                     f" extra or reshaped {extra}")
        opened: dict[str, torch.Tensor] = {}
        for entry in manifest.tensors:
            if entry.id not in opened:
                opened[entry.id] = self._open(manifest, entry)
            _assign(module, entry.name, entry.kind, opened[entry.id])
        return module.eval()

    def _open(self, manifest: DeviceWeightsManifest, entry: KeptTensor) -> torch.Tensor:
        ref = manifest.ref(entry)
        if ref.nbytes == 0:  # nothing to share (CUDA IPC has no handle for an empty storage)
            return torch.empty(ref.shape, dtype=getattr(torch, ref.dtype), device=manifest.device)
        try:
            if ref.owner == self.peer.address:
                # Published by this very process: CUDA IPC cannot open a process's own memory.
                data = self.peer.pull(ref, self.timeout_s)
            else:
                data = self.peer.client.fetch(ref, (Transport.CUDA_IPC,), self.timeout_s)
        except TransferError as exc:
            raise SharedWeightsError(f"cannot open {entry.name} of {manifest.key!r} from {ref.owner}: {exc}") from exc
        if data.transport not in (Transport.CUDA_IPC, Transport.LOCAL) or not data.on_gpu:
            raise SharedWeightsError(f"{entry.name} of {manifest.key!r} came by {data.transport}, not CUDA IPC")
        return data.torch()

    def reclaim(self) -> list[str]:
        """Remove index files of publishers that died, and staging files they left (a worker runs
        this at start); returns the names removed. Safe to run from many processes at once."""
        # An index being written is `<index>.<prefix>-<pid>-<start>-<serial>` (`write_index`).
        def owner(path: str) -> SegmentOwner | None:
            try:
                return read_index(path).owner
            except SharedWeightsError:
                return None  # garbled: nobody can attach to it

        return reclaim_dead_indexes(self.root, self.prefix, owner)

    def close(self) -> None:
        """Withdraw what this process published: remove its index files (those that still name
        it) and release its refs. Attached processes keep working while this process lives."""
        with self._lock:
            published, self._published = self._published, []
        for item in published:
            with contextlib.suppress(FileNotFoundError, SharedWeightsError):
                current = read_index(item.index_path)
                if (current.pid, current.start) == (self._pid, self._start):
                    os.unlink(item.index_path)
            for ref_id in item.ref_ids:
                self.peer.store.release(ref_id)
