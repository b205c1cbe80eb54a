"""Shared-memory segments on one host: naming, ownership, pooling, mapping and reclaim.

A segment is a POSIX shared-memory file under `/dev/shm` named
`omniflow-<pid>-<start>-<serial>`: the creating process id and that process's start time
(clock ticks since boot, hex) identify the owner even after the pid is reused. Only the
owner unlinks its segments while it lives; once it is dead, any process may reclaim them
(`reclaim_dead_segments`). Consumers never create segments, so a consumer's death leaves
nothing behind: its mappings vanish with it.

We use `os.open` + `mmap` rather than `multiprocessing.shared_memory`: the latter registers
every segment it touches with multiprocessing's resource tracker, which unlinks segments
it did not create when a consumer exits, and drags pickle-based multiprocessing into the
wire path.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import re
import socket
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

SHM_ROOT = "/dev/shm"
SEGMENT_PREFIX = "omniflow"
PAGE = mmap.PAGESIZE

_NAME_RE = re.compile(r"^(?P<prefix>[A-Za-z0-9_]+)-(?P<pid>\d+)-(?P<start>[0-9a-f]+)-(?P<serial>\d+)$")


class SegmentError(Exception):
    """A segment that cannot be created or mapped."""


class SegmentGone(SegmentError):
    """The segment no longer exists (released, expired or its owner reclaimed)."""


HOST_ID_ENV = "OMNIFLOW_HOST_ID"


def host_id() -> str:
    """Identity of this machine's shared-memory namespace, as far as we can tell cheaply:
    hostname and boot id. Peers that agree on it try shared memory and fall back to TCP when
    mapping fails (containers on one machine may share a boot id but not /dev/shm).

    `OMNIFLOW_HOST_ID`, when set, is the identity instead: a node agent gives it to its role
    workers (`node:<name>`), so that nodes made of network namespaces of one machine, which
    share /dev/shm, the hostname and the boot id, still talk to each other over TCP only."""
    given = os.environ.get(HOST_ID_ENV, "").strip()
    if given:
        if len(given) > 200 or not given.isprintable() or " " in given:
            raise ValueError(f"{HOST_ID_ENV}={given!r}: 1-200 printable characters, no spaces")
        return given
    boot = ""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    return f"{socket.gethostname()}/{boot}"


def local_namespace() -> str | None:
    """Identity of the namespace Linux abstract Unix sockets live in (`ipc://@name`): this
    machine's boot and this process's network namespace; None off Linux. Processes that
    agree on it reach each other's abstract sockets; containers with networks of their own
    do not agree."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return f"{host_id()}/net:{netns}"


def process_start_token(pid: int) -> str | None:
    """The start time of process `pid` as a hex token, or None when no such process exists."""
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            return None
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        fields = stat[stat.rindex(b")") + 2 :].split()
        return format(int(fields[19]), "x")
    import psutil

    try:
        return format(int(psutil.Process(pid).create_time() * 100), "x")
    except psutil.NoSuchProcess:
        return None


@dataclass(frozen=True, slots=True)
class SegmentOwner:
    pid: int
    start: str

    def alive(self) -> bool:
        return process_start_token(self.pid) == self.start

    @classmethod
    def current(cls) -> SegmentOwner:
        """This process, as names and indexes it writes record it."""
        pid = os.getpid()
        start = process_start_token(pid)
        if start is None:
            raise SegmentError("cannot read this process's start time")
        return cls(pid, start)


def parse_segment_name(name: str, prefix: str = SEGMENT_PREFIX) -> SegmentOwner | None:
    match = _NAME_RE.match(name)
    if match is None or match["prefix"] != prefix:
        return None
    return SegmentOwner(int(match["pid"]), match["start"])


def list_segments(root: str = SHM_ROOT, prefix: str = SEGMENT_PREFIX, pid: int | None = None) -> list[str]:
    """Names of our segments under `root`, optionally only those created by `pid`."""
    head = f"{prefix}-" if pid is None else f"{prefix}-{pid}-"
    with os.scandir(root) as entries:
        return sorted(e.name for e in entries if e.name.startswith(head) and parse_segment_name(e.name, prefix))


def reclaim_dead_segments(root: str = SHM_ROOT, prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Unlink every segment whose owner process is gone; returns the names unlinked.

    Safe to run from many processes at once: a name already unlinked by another is skipped."""
    reclaimed = []
    liveness: dict[SegmentOwner, bool] = {}
    for name in list_segments(root, prefix):
        owner = parse_segment_name(name, prefix)
        if owner is None:
            continue
        if owner not in liveness:
            liveness[owner] = owner.alive()
        if liveness[owner]:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(root, name))
            reclaimed.append(name)
    return reclaimed


def size_class(nbytes: int) -> int:
    """Capacity of the segment that holds `nbytes`: page-aligned, at most 25% slack, so that
    released segments are reused by tensors of similar sizes."""
    if nbytes <= PAGE:
        return PAGE
    top = nbytes.bit_length() - 1
    step = max(PAGE, 1 << max(top - 2, 0))
    return -(-nbytes // step) * step


@dataclass(slots=True, eq=False)
class Segment:
    """A segment created and owned by this process, mapped read-write.

    `array` is the whole segment as uint8. Dropping the last reference unmaps it; `unlink`
    removes the name so that nobody can map it again (existing mappings stay valid)."""

    name: str
    size: int
    path: str
    buffer: mmap.mmap
    array: np.ndarray = field(init=False)
    unlinked: bool = False

    def __post_init__(self) -> None:
        self.array = np.frombuffer(self.buffer, np.uint8)

    def unlink(self) -> None:
        if self.unlinked:
            return
        self.unlinked = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class SegmentAllocator:
    """Creates this process's segments, keeps released ones warm for reuse, and unlinks.

    Reusing a released segment saves the producer a fresh-page fault on every 4 KiB and lets
    a consumer that still maps it skip mapping again, which is what makes a same-host hand-off
    run near memcpy speed. The pool is bounded by `pool_bytes` and by `pool_idle_s`.
    Not thread-safe: its owner (the tensor store) serialises calls."""

    def __init__(
        self,
        root: str = SHM_ROOT,
        prefix: str = SEGMENT_PREFIX,
        pool_bytes: int = 512 << 20,
        pool_idle_s: float = 10.0,
    ) -> None:
        self.root = root
        self.prefix = prefix
        self.pool_bytes = pool_bytes
        self.pool_idle_s = pool_idle_s
        owner = SegmentOwner.current()
        self._stem = f"{prefix}-{owner.pid}-{owner.start}"
        self._serial = itertools.count()
        self._pool: OrderedDict[str, tuple[Segment, float]] = OrderedDict()  # name -> (seg, since)
        self._pooled_bytes = 0

    @property
    def pooled_segments(self) -> int:
        return len(self._pool)

    @property
    def pooled_bytes(self) -> int:
        return self._pooled_bytes

    def take(self, nbytes: int) -> Segment:
        """A segment of capacity `size_class(nbytes)`: a pooled one if any, else a new one."""
        size = size_class(nbytes)
        for name, (segment, _since) in self._pool.items():
            if segment.size == size:
                del self._pool[name]
                self._pooled_bytes -= size
                return segment
        return self._create(size)

    def _create(self, size: int) -> Segment:
        while True:
            name = f"{self._stem}-{next(self._serial)}"
            path = os.path.join(self.root, name)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                break
            except FileExistsError:
                continue  # another allocator of this process (a second store) took that serial: the next
        try:
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.unlink(path)
            raise SegmentError(f"cannot create a {size}-byte segment: {exc}") from exc
        finally:
            os.close(fd)
        return Segment(name, size, path, buffer)

    def give_back(self, segment: Segment, now: float) -> None:
        """Return a segment nobody may read any more: pooled for reuse, or unlinked."""
        if segment.size > self.pool_bytes or segment.unlinked:
            segment.unlink()
            return
        while self._pool and self._pooled_bytes + segment.size > self.pool_bytes:
            self._drop_oldest()
        self._pool[segment.name] = (segment, now)
        self._pooled_bytes += segment.size

    def trim(self, now: float) -> int:
        """Unlink pooled segments idle for longer than `pool_idle_s`; returns how many."""
        dropped = 0
        while self._pool:
            _segment, since = next(iter(self._pool.values()))
            if now - since < self.pool_idle_s:
                break
            self._drop_oldest()
            dropped += 1
        return dropped

    def _drop_oldest(self) -> None:
        _name, (segment, _since) = self._pool.popitem(last=False)
        self._pooled_bytes -= segment.size
        segment.unlink()

    def close(self) -> None:
        while self._pool:
            self._drop_oldest()


class SegmentMapper:
    """A consumer's read-only mappings of other processes' segments, least recently used
    first out once they exceed `max_bytes`.

    A mapping is reused while its name exists: names are never reused, and an owner only
    recycles a segment after the ref that pointed into it was released. A mapping keeps the
    memory of an unlinked segment alive, so names that vanished are dropped on every miss.
    Thread-safe."""

    def __init__(self, root: str = SHM_ROOT, max_bytes: int = 1 << 30) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._maps)

    def __contains__(self, name: object) -> bool:
        return name in self._maps

    def map(self, name: str, size: int) -> mmap.mmap:
        """A read-only mapping of `size` bytes of segment `name`; raises `SegmentGone`."""
        if parse_segment_name(name) is None or "/" in name:
            raise SegmentError(f"not a segment name: {name!r}")
        with self._lock:
            return self._map(name, size)

    def _map(self, name: str, size: int) -> mmap.mmap:
        cached = self._maps.get(name)
        if cached is not None and len(cached) >= size:
            self._maps.move_to_end(name)
            return cached
        self._prune()
        try:
            fd = os.open(os.path.join(self.root, name), os.O_RDONLY)
        except FileNotFoundError as exc:
            raise SegmentGone(f"segment {name} does not exist") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise SegmentError(f"segment {name} holds {actual} bytes, {size} expected")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._forget(name)
        self._maps[name] = mapping
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._maps) > 1:
            self._forget(next(iter(self._maps)))
        return mapping

    def _forget(self, name: str) -> None:
        mapping = self._maps.pop(name, None)
        if mapping is not None:
            # Never close: received tensors may still view it; the last reference unmaps.
            self._bytes -= len(mapping)

    def _prune(self) -> None:
        for name in [n for n in self._maps if not os.path.exists(os.path.join(self.root, n))]:
            self._forget(name)

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()
            self._bytes = 0
