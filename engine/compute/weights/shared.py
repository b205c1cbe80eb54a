"""Model weights shared read-only between processes of one host through one shared-memory segment.

The first process to load a model *publishes* it: every parameter and buffer is copied
into one segment (`engine.data.shm` naming and ownership, prefix `omniflowweights`), the
module is re-pointed at the segment, and a small index file next to the segment names
it under the model's key. Processes that start together load one copy, not one each: a
process that finds nothing published takes the key's host lock (`publishing`, an `flock`
that goes with its holder, its file removed once the model is published), looks again, and only
then loads and publishes; the others wait for the lock and attach to what it published. Another process *attaches*: it reads the index, maps the
segment read-only (`PROT_READ`), and builds the module as an empty skeleton (on the
`meta` device, no memory) whose tensors are then views of the mapping. So N processes
hold one copy. No pickle anywhere: the manifest is JSON (msgspec), the tensors raw bytes.

Contract: attached tensors are read-only memory. Inference never writes weights; a write
would fault (the mapping refuses it), which is the point. The owner unlinks its segment
and index when it closes; mappings that other processes hold stay valid until they drop
them (POSIX semantics), and segments of owners that died are reclaimed by
`engine.data.shm.reclaim_dead_segments(prefix=WEIGHTS_PREFIX)`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import gc
import hashlib
import mmap
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from engine.data.shm import (
    SHM_ROOT,
    Segment,
    SegmentAllocator,
    SegmentOwner,
    parse_segment_name,
    reclaim_dead_segments,
)

WEIGHTS_PREFIX = "omniflowweights"
PUBLISH_WAIT_S = 600.0
"""How long a process waits for another one of its host to load and publish a model before it
loads a copy of its own (a live loader that takes longer is stuck, or the model is huge)."""
_LOCK_POLL_S = 0.05
_ALIGN = 64
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool)
}


def _return_freed_memory() -> None:
    """Hand the heap that the loader's copy of the weights occupied back to the OS.

    glibc keeps freed small and mid-sized blocks (a layer's tensors are MBs each, under its
    adaptive mmap threshold) in its arenas; without a trim a publisher would hold the
    weights twice in resident memory: once in the segment, once as freed heap.
    """
    gc.collect()
    if sys.platform.startswith("linux"):
        name = ctypes.util.find_library("c")
        if name:
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(name).malloc_trim(0)


def index_path(root: str, prefix: str, key: str) -> str:
    """Where the index of the weights published under `key` lives (host or device sharing)."""
    return os.path.join(root, f"{prefix}-index-{hashlib.sha256(key.encode()).hexdigest()[:32]}")


class SharedWeightsError(RuntimeError):
    """Weights that cannot be published or attached."""


def reclaim_dead_indexes(root: str, prefix: str, owner: Callable[[str], SegmentOwner | None]) -> list[str]:
    """Remove the index files under `root` (host or device sharing's, named by `index_path`) whose
    publisher died; returns the names removed. Safe to run from many processes at once.

    An index being written is `<index>.<suffix>`, its writer named by the suffix (a name
    `parse_segment_name` reads), as its content may not be there yet. A written one's publisher is
    `owner(path)`: None when the file names none (garbled: nobody can attach to it), and
    `FileNotFoundError` when it is gone already (then it is left alone: a new index may take its
    place meanwhile).
    """
    head = f"{prefix}-index-"
    with os.scandir(root) as entries:
        indexes = [e.path for e in entries if e.name.startswith(head)]
    removed = []
    for path in indexes:
        _, staged, writer = os.path.basename(path).partition(".")
        try:
            publisher = parse_segment_name(writer, prefix) if staged else owner(path)
        except FileNotFoundError:
            continue
        if publisher is not None and publisher.alive():
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(os.path.basename(path))
    return removed


class ModuleTensor(msgspec.Struct, frozen=True):
    """One named tensor of a published module: `kind` "param" or "buffer". Where its bytes are is
    the sharing's own (`TensorEntry`: host memory; `cuda.KeptTensor`: a ref on the publisher's GPU)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]


class TensorEntry(ModuleTensor, frozen=True):
    """A tensor of a module shared in host memory: its bytes at `offset` of the segment."""

    offset: int


class WeightsManifest(msgspec.Struct, frozen=True):
    """What an attaching process needs: the segment, every tensor's place in it, and `meta`
    (whatever the publisher records to rebuild the module's skeleton, e.g. its config)."""

    key: str
    segment: str
    nbytes: int
    tensors: tuple[TensorEntry, ...]
    meta: dict[str, Any] = {}


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """Every parameter and buffer by every name it has (tied weights appear under each name)."""
    out = [(name, "param", t) for name, t in module.named_parameters(remove_duplicate=False)]
    out += [(name, "buffer", t) for name, t in module.named_buffers(remove_duplicate=False) if t is not None]
    return out


def _assign(module: torch.nn.Module, name: str, kind: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if kind == "param":
        owner._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[attr] = tensor


def _views(buffer: Any, manifest: WeightsManifest) -> dict[int, torch.Tensor]:
    """Tensors viewing `buffer`, by offset (aliases share one)."""
    views: dict[int, torch.Tensor] = {}
    with warnings.catch_warnings():
        # A read-only mapping: torch warns that it cannot express read-only tensors.
        warnings.simplefilter("ignore", UserWarning)
        base = torch.frombuffer(buffer, dtype=torch.uint8, count=manifest.nbytes) if manifest.nbytes else None
    for entry in manifest.tensors:
        if entry.offset in views:
            continue
        dtype = _DTYPES[entry.dtype]
        numel = int(np.prod(entry.shape)) if entry.shape else 1
        if base is None:
            views[entry.offset] = torch.empty(entry.shape, dtype=dtype)
            continue
        raw = base[entry.offset : entry.offset + numel * dtype.itemsize]
        views[entry.offset] = raw.view(dtype).view(entry.shape)
    return views


@dataclass(slots=True, eq=False)
class PublishedWeights:
    """Weights this process published: it owns the segment and the index file (see `close`)."""

    manifest: WeightsManifest
    segment: Segment
    index_path: str

    def close(self) -> None:
        """Unlink the segment and the index: no new process attaches. Mappings stay valid."""
        with contextlib.suppress(FileNotFoundError):
            if _read_index(self.index_path) == self.manifest.segment:
                os.unlink(self.index_path)
        self.segment.unlink()


def _read_index(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=WeightsManifest).segment
    except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return None


class HostWeights:
    """The host-local directory of published weights, by key. One per worker process (owned by
    its `WeightStore`); every process on the host sees the same directory (`root`).

    Not thread-safe by itself: the `WeightStore` serialises loads.
    """

    def __init__(self, root: str = SHM_ROOT, prefix: str = WEIGHTS_PREFIX) -> None:
        self.root = root
        self.prefix = prefix
        self._allocator = SegmentAllocator(root=root, prefix=prefix, pool_bytes=0)
        self._published: list[PublishedWeights] = []
        self._mappings: list[mmap.mmap] = []

    def index_path(self, key: str) -> str:
        return index_path(self.root, self.prefix, key)

    @contextlib.contextmanager
    def publishing(self, key: str, wait_s: float = PUBLISH_WAIT_S) -> Iterator[bool]:
        """Hold the host lock of `key` while loading and publishing it, so the other processes of
        the host that want it wait and then attach instead of loading copies of their own. Yields
        whether the lock is held: False after `wait_s` without it (the caller loads anyway). The
        lock is an `flock` on a file beside the index: it goes with its holder, however it ends; its
        holder removes the file as it lets go."""
        path = os.path.join(self.root, f"{self.prefix}-lock-{hashlib.sha256(key.encode()).hexdigest()[:32]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        locked = False
                        break
                    time.sleep(_LOCK_POLL_S)  # another process is loading the model: wait for it
            try:
                yield locked
            finally:
                if locked:
                    # The lock file goes once the model is published (a newcomer attaches without the
                    # lock) or its load failed; waiters on this file see the index when they get it.
                    with contextlib.suppress(FileNotFoundError):
                        if os.stat(path).st_ino == os.fstat(fd).st_ino:
                            os.unlink(path)
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def lookup(self, key: str) -> WeightsManifest | None:
        """The manifest published under `key` by a live process, if any."""
        try:
            with open(self.index_path(key), "rb") as f:
                manifest = msgspec.json.decode(f.read(), type=WeightsManifest)
        except FileNotFoundError:
            return None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise SharedWeightsError(f"unreadable weights index for {key!r}: {exc}") from exc
        owner = parse_segment_name(manifest.segment, self.prefix)
        if manifest.key != key or owner is None or not owner.alive():
            return None
        if not os.path.exists(os.path.join(self.root, manifest.segment)):
            return None
        return manifest

    def publish(self, key: str, module: torch.nn.Module, meta: dict[str, Any] | None = None) -> WeightsManifest:
        """Move `module`'s parameters and buffers into a new segment (the module now views it)
        and name it under `key`. The module must be on the CPU."""
        named = _named_tensors(module)
        offsets: dict[int, int] = {}
        entries: list[TensorEntry] = []
        total = 0
        for name, kind, tensor in named:
            if tensor.device.type != "cpu":
                raise SharedWeightsError(f"{name} is on {tensor.device}; host sharing takes CPU tensors")
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise SharedWeightsError(f"{name}: dtype {tensor.dtype} cannot be shared")
            ident = id(tensor)
            if ident not in offsets:
                offsets[ident] = total
                total += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
            entries.append(TensorEntry(name, kind, dtype, tuple(tensor.shape), offsets[ident]))
        segment = self._allocator.take(max(total, 1))
        manifest = WeightsManifest(key=key, segment=segment.name, nbytes=total, tensors=tuple(entries),
                                   meta=dict(meta or {}))
        views = _views(segment.buffer, manifest)
        with torch.no_grad():
            for (name, kind, tensor), entry in zip(named, entries, strict=True):
                target = views[entry.offset]
                if target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor.detach())
                _assign(module, name, kind, target)
        path = self.index_path(key)
        staging = f"{path}.{segment.name}"
        with open(staging, "wb") as f:
            f.write(msgspec.json.encode(manifest))
        os.replace(staging, path)  # atomic: readers see the old index or the new one
        self._published.append(PublishedWeights(manifest, segment, path))
        del named, views, tensor
        _return_freed_memory()
        return manifest

    def attach(self, manifest: WeightsManifest, skeleton: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """Build `skeleton()` on the meta device (no memory) and point every tensor at the mapped
        segment, read-only. Raises `SharedWeightsError` when the module does not match."""
        path = os.path.join(self.root, manifest.segment)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise SharedWeightsError(f"weights segment {manifest.segment} is gone") from exc
        try:
            mapping = mmap.mmap(fd, max(manifest.nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._mappings.append(mapping)
        with torch.device("meta"):
            module = skeleton()
        expected = {(name, kind) for name, kind, _ in _named_tensors(module)}
        given = {(e.name, e.kind) for e in manifest.tensors}
        if expected != given:
            missing, extra = sorted(expected - given)[:4], sorted(given - expected)[:4]
            raise SharedWeightsError(f"the skeleton does not match {manifest.key!r}: missing {missing}, extra {extra}")
        views = _views(mapping, manifest)
        for entry in manifest.tensors:
            _assign(module, entry.name, entry.kind, views[entry.offset])
        return module.eval()

    def reclaim(self) -> list[str]:
        """Remove segments and index files of publishers that died (a worker runs this at start);
        returns the names removed. Safe to run from many processes at once."""
        # An index being written is `<index>.<segment>` (see `publish`).
        def owner(path: str) -> SegmentOwner | None:
            segment = _read_index(path)
            return parse_segment_name(segment, self.prefix) if segment else None

        removed = reclaim_dead_segments(self.root, self.prefix)
        return removed + reclaim_dead_indexes(self.root, self.prefix, owner)

    def close(self) -> None:
        """Withdraw what this process published. Attached modules keep working."""
        for published in self._published:
            published.close()
        self._published.clear()
        self._mappings.clear()
