"""KVStore: the one paged KV cache of a worker process, over a device, a host and a disk tier.

Every role in the process allocates from the same store (unified allocation). Pages
are immutable and named by their key (`keys.page_hashes`), so a page is the same
bytes wherever it lives and may sit in several tiers at once:

* `put` writes to the device tier; with `WritePolicy.WRITE_THROUGH` also to the host
  and disk tiers at once, with `WRITE_BACK` only when evicted.
* A full tier evicts by its policy (LRU or LFU), skipping locked pages; the victim is
  demoted to the next tier down (device -> host -> disk) unless that tier already
  holds it, and a page evicted from the last tier is gone.
* A hit in a lower tier (`get`, `lock`, `prefetch`) promotes the page to the device
  tier and leaves the lower copy where it is.
* Locked pages (`lock`/`unlock`) are in use by compute and are never evicted from
  the device tier; when nothing can be evicted, `KVCapacityError` says so.
* Lent pages (`lend`) are read in place by a zero-copy send to another worker: not
  evicted from the tier they are lent from, and their slots not reused (not even after
  `remove`) until the loan is given back.

The store is thread-safe (one re-entrant mutex; copies run under it, which keeps the
state simple and costs little next to a forward pass). Listeners get a `KVEvent` for
every change of residency, in order, while the mutex is held: keep them short (the
index publisher only buffers).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import numpy as np
import torch

from engine.data.kv.copy import copy_page
from engine.data.kv.device import DeviceTier
from engine.data.kv.disk import Checksum, DiskTier
from engine.data.kv.errors import (
    KVCapacityError,
    KVClosedError,
    KVLockError,
    KVPageNotFound,
    KVTimeoutError,
)
from engine.data.kv.host import HostTier
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.loan import PageLoan
from engine.data.kv.policy import EvictionPolicy, PageTracker, make_tracker
from engine.data.kv.tier import Capacity, Tier, TierStats

AnyTier = DeviceTier | HostTier | DiskTier


class WritePolicy(StrEnum):
    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    path: Path | str
    capacity: Capacity
    fsync: bool = False
    checksum: Checksum = Checksum.BLOCKSUM64


@dataclass(frozen=True, slots=True)
class KVStoreConfig:
    """Everything a store needs; built once by the worker and passed down.

    `device` is the torch device of the device tier (default: CUDA when present, else
    CPU). `pin_host` page-locks the host segment (default: when CUDA is present).
    """

    layout: KVLayout
    device_capacity: Capacity
    host_capacity: Capacity | None = None
    disk: DiskTierConfig | None = None
    eviction: EvictionPolicy = EvictionPolicy.LRU
    write: WritePolicy = WritePolicy.WRITE_BACK
    device: str | None = None
    host_segment_name: str | None = None
    pin_host: bool | None = None


class KVEventKind(StrEnum):
    STORED = "stored"  # written into `tier` by put (or write-through)
    PROMOTED = "promoted"  # copied up into `tier` from `source`
    DEMOTED = "demoted"  # moved down into `tier` from `source` (copied unless already there)
    EVICTED = "evicted"  # removed from `tier` to make room
    DROPPED = "dropped"  # removed from `tier` because it was corrupt or explicitly removed


@dataclass(frozen=True, slots=True)
class KVEvent:
    kind: KVEventKind
    page: PageHash
    tier: Tier
    source: Tier | None = None
    best: Tier | None = None  # the fastest tier holding the page after the event; None: gone


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest run of leading pages held by the store, and the fastest tier of each."""

    prefix_pages: int
    tiers: tuple[Tier, ...]

    def pages_in(self, tier: Tier) -> int:
        return sum(1 for t in self.tiers if t is tier)


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    loaded: int  # promoted into the device tier by this prefetch
    resident: int  # already in the device tier
    missing: tuple[PageHash, ...]  # in no tier (or found corrupt)
    locked: int = 0
    cancelled: bool = False  # stopped by `PrefetchHandle.cancel` before the end of the list


class PrefetchHandle:
    """A prefetch in flight. `wait` returns its result or raises what stopped it."""

    def __init__(self, future: Future[PrefetchResult], cancelled: threading.Event) -> None:
        self._future = future
        self._cancelled = cancelled

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> PrefetchResult:
        try:
            return self._future.result(timeout)
        except TimeoutError as exc:
            raise KVTimeoutError(f"prefetch did not finish within {timeout} s") from exc

    def cancel(self) -> None:
        """Stop after the page being loaded now; pages already loaded stay and `wait` reports them."""
        self._cancelled.set()


@dataclass(slots=True)
class _PullStats:
    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    paths: Counter[str] = field(default_factory=Counter)
    """Pages pulled per transport (`shm`, `tcp`, `inline`, `local`): which path they took."""


@dataclass(slots=True)
class _Level:
    tier: AnyTier
    tracker: PageTracker
    stats: TierStats = field(default_factory=TierStats)
    pins: Counter[PageHash] = field(default_factory=Counter)


class KVStore:
    """The paged KV cache of one worker process. See the module docstring for the rules."""

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self.layout = config.layout
        nbytes = config.layout.page_nbytes
        self._mutex = threading.RLock()
        self._levels: dict[Tier, _Level] = {}
        self._locks: Counter[PageHash] = Counter()
        self._listeners: list[Callable[[KVEvent], None]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._staging: torch.Tensor | None = None
        self._closed = False
        self.pulls = _PullStats()
        with ExitStack() as undo:
            undo.callback(self._close_tiers)  # a store that cannot open all its tiers closes those it opened
            self._levels[Tier.DEVICE] = _Level(
                DeviceTier(config.layout, config.device_capacity.in_pages(nbytes), config.device),
                make_tracker(config.eviction),
            )
            if config.host_capacity is not None:
                host = HostTier(
                    config.layout,
                    config.host_capacity.in_pages(nbytes),
                    name=config.host_segment_name,
                    pin=config.pin_host,
                )
                self._levels[Tier.HOST] = _Level(host, make_tracker(config.eviction))
            if config.disk is not None:
                disk = DiskTier(
                    config.layout,
                    config.disk.capacity.in_pages(nbytes),
                    config.disk.path,
                    fsync=config.disk.fsync,
                    checksum=config.disk.checksum,
                )
                tracker = make_tracker(config.eviction)
                for page in disk.pages():  # oldest write first: LRU order survives a restart
                    tracker.insert(page)
                self._levels[Tier.DISK] = _Level(disk, tracker)
            undo.pop_all()

    # -- plumbing ------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(self._levels)

    @property
    def device(self) -> torch.device:
        tier = self._levels[Tier.DEVICE].tier
        assert isinstance(tier, DeviceTier)
        return tier.device

    @property
    def device_pool(self) -> torch.Tensor:
        """The device tier's slots, `(capacity, 2, L, page, H, D)`, for kernels that index by slot."""
        tier = self._levels[Tier.DEVICE].tier
        assert isinstance(tier, DeviceTier) and tier.pool is not None
        return tier.pool

    @property
    def host_segment_name(self) -> str | None:
        """Name other processes attach to (`HostPageReader(name)`); None without a host tier."""
        level = self._levels.get(Tier.HOST)
        return level.tier.name if level is not None and isinstance(level.tier, HostTier) else None

    def add_listener(self, listener: Callable[[KVEvent], None]) -> None:
        with self._mutex:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[KVEvent], None]) -> None:
        """Stop sending events to `listener` (no error if it was not, or no longer is, registered)."""
        with self._mutex:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _check_open(self) -> None:
        if self._closed:
            raise KVClosedError("KV store is closed")

    def _below(self, tier: Tier) -> Tier | None:
        for lower in self._levels:
            if lower > tier:
                return lower
        return None

    def _best(self, page: PageHash) -> Tier | None:
        for tier, level in self._levels.items():
            if page in level.tier:
                return tier
        return None

    def _emit(self, kind: KVEventKind, page: PageHash, tier: Tier, source: Tier | None = None) -> None:
        if not self._listeners:
            return
        event = KVEvent(kind=kind, page=page, tier=tier, source=source, best=self._best(page))
        for listener in self._listeners:
            listener(event)

    @contextmanager
    def _pinned(self, tier: Tier, page: PageHash) -> Iterator[None]:
        pins = self._levels[tier].pins
        pins[page] += 1
        try:
            yield
        finally:
            pins[page] -= 1
            if not pins[page]:
                del pins[page]

    def _protected(self, tier: Tier, page: PageHash) -> bool:
        if tier is Tier.DEVICE and self._locks.get(page):
            return True
        return bool(self._levels[tier].pins.get(page))

    def _transfer(self, page: PageHash, src: Tier, dst: Tier, copy: Callable[[], bool]) -> bool:
        started = time.perf_counter()
        ok = copy()
        elapsed = time.perf_counter() - started
        nbytes = self.layout.page_nbytes
        src_stats, dst_stats = self._levels[src].stats, self._levels[dst].stats
        src_stats.reads += 1
        src_stats.read_seconds += elapsed
        dst_stats.writes += 1
        dst_stats.write_seconds += elapsed
        if ok:
            src_stats.bytes_read += nbytes
            dst_stats.bytes_written += nbytes
        return ok

    # -- room, eviction, promotion ---------------------------------------------------

    def _make_room(self, tier: Tier) -> None:
        level = self._levels[tier]
        while level.tier.free_pages == 0:
            victim = next((p for p in level.tracker.order() if not self._protected(tier, p)), None)
            if victim is None:
                locked = sum(1 for p in level.tracker.order() if self._protected(tier, p))
                raise KVCapacityError(tier.label, level.tier.capacity_pages, locked)
            self._evict(tier, victim)

    def _evict(self, tier: Tier, page: PageHash) -> None:
        level = self._levels[tier]
        lower = self._below(tier)
        if lower is not None:
            below = self._levels[lower]
            with self._pinned(tier, page):
                if page in below.tier:
                    below.tracker.touch(page)
                else:
                    self._make_room(lower)
                    self._transfer(page, tier, lower, lambda: self._copy_down(page, tier, lower))
                    below.tracker.insert(page, level.tracker.frequency(page))
                below.stats.demotions += 1
                self._emit(KVEventKind.DEMOTED, page, lower, source=tier)
        level.tier.remove(page)
        level.tracker.remove(page)
        level.stats.evictions += 1
        self._emit(KVEventKind.EVICTED, page, tier)

    def _copy_down(self, page: PageHash, src: Tier, dst: Tier) -> bool:
        source = self._levels[src].tier
        assert isinstance(source, DeviceTier | HostTier)
        self._levels[dst].tier.write(page, source.view(page))
        return True

    def _staging_page(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(
                self.layout.page_shape, dtype=self.layout.torch_dtype, pin_memory=torch.cuda.is_available()
            )
        return self._staging

    def _load_into_device(self, page: PageHash, src: Tier) -> bool:
        device = self._levels[Tier.DEVICE].tier
        assert isinstance(device, DeviceTier)
        source = self._levels[src].tier
        if isinstance(source, HostTier):
            device.write(page, source.view(page))
            return True
        assert isinstance(source, DiskTier)
        if device.device.type == "cpu":
            target = device.allocate(page)
            if source.read_into(page, target):
                return True
            device.remove(page)
            return False
        staging = self._staging_page()
        if not source.read_into(page, staging):
            return False
        device.write(page, staging)
        return True

    def _promote(self, page: PageHash) -> bool:
        """Copy a page held only by a lower tier into the device tier. False if none has it intact."""
        for src in (Tier.HOST, Tier.DISK):
            level = self._levels.get(src)
            if level is None or page not in level.tier:
                continue
            with self._pinned(src, page):
                self._make_room(Tier.DEVICE)
                if not self._transfer(page, src, Tier.DEVICE, lambda s=src: self._load_into_device(page, s)):
                    self._drop_corrupt(src, page)
                    continue
            frequency = level.tracker.frequency(page)
            level.tracker.touch(page)
            device = self._levels[Tier.DEVICE]
            device.tracker.insert(page, frequency + 1)
            device.stats.promotions += 1
            self._emit(KVEventKind.PROMOTED, page, Tier.DEVICE, source=src)
            return True
        return False

    def _drop_corrupt(self, tier: Tier, page: PageHash) -> None:
        level = self._levels[tier]
        # The disk tier already forgot the page when its checksum failed.
        if page in level.tier:
            level.tier.remove(page)
        level.tracker.remove(page)
        level.stats.dropped_corrupt += 1
        self._emit(KVEventKind.DROPPED, page, tier)

    # -- public API -------------------------------------------------------------------

    def put(self, page: PageHash, data: torch.Tensor) -> None:
        """Store one page (copied). A page already in the device tier is only marked used."""
        data = self.layout.check_page(data)
        with self._mutex:
            self._check_open()
            device = self._levels[Tier.DEVICE]
            if page in device.tier:
                device.tracker.touch(page)
            else:
                frequency = max(
                    (lv.tracker.frequency(page) for lv in self._levels.values() if page in lv.tracker),
                    default=0,
                )
                self._make_room(Tier.DEVICE)
                self._timed_write(Tier.DEVICE, page, data)
                device.tracker.insert(page, frequency + 1)
                self._emit(KVEventKind.STORED, page, Tier.DEVICE)
            if self.config.write is WritePolicy.WRITE_THROUGH:
                with self._pinned(Tier.DEVICE, page):
                    for tier in (Tier.HOST, Tier.DISK):
                        level = self._levels.get(tier)
                        if level is None or page in level.tier:
                            continue
                        self._make_room(tier)
                        self._timed_write(tier, page, data)
                        level.tracker.insert(page)
                        self._emit(KVEventKind.STORED, page, tier)

    def _timed_write(self, tier: Tier, page: PageHash, data: torch.Tensor) -> None:
        stats = self._levels[tier].stats
        started = time.perf_counter()
        self._levels[tier].tier.write(page, data)
        stats.write_seconds += time.perf_counter() - started
        stats.writes += 1
        stats.bytes_written += self.layout.page_nbytes

    def put_many(self, pages: Sequence[PageHash], data: Sequence[torch.Tensor] | torch.Tensor) -> None:
        """Store pages in order; `data` is one tensor per page or a stacked `(n, *page_shape)` tensor."""
        if len(pages) != len(data):
            raise ValueError(f"{len(pages)} page keys for {len(data)} pages")
        for page, tensor in zip(pages, data, strict=True):
            self.put(page, tensor)

    def lookup(self, pages: Sequence[PageHash]) -> LookupResult:
        """Longest run of leading `pages` that some tier holds. Does not move or touch pages.

        Counts a lookup in each tier the search reached for a page, and a hit in the tier
        that held it. The disk tier answers from its index; a page found corrupt later
        is dropped then.
        """
        found: list[Tier] = []
        with self._mutex:
            self._check_open()
            for page in pages:
                best = None
                for tier, level in self._levels.items():
                    level.stats.lookups += 1
                    if page in level.tier:
                        level.stats.hit_pages += 1
                        best = tier
                        break
                if best is None:
                    break
                found.append(best)
        return LookupResult(prefix_pages=len(found), tiers=tuple(found))

    def contains(self, page: PageHash) -> bool:
        with self._mutex:
            return self._best(page) is not None

    def resident_run(self, pages: Sequence[PageHash]) -> int:
        """How many leading `pages` some tier holds, looked at under one hold of the mutex. Does
        not move or touch pages and, unlike `lookup`, counts no lookups in the tiers' metrics."""
        with self._mutex:
            run = 0
            while run < len(pages) and self._best(pages[run]) is not None:
                run += 1
            return run

    def device_slot(self, page: PageHash) -> int | None:
        """The device tier slot holding `page` (None: not there). Valid only while it stays; a
        listener reads it under the mutex, when an event says where the page went."""
        with self._mutex:
            tier = self._levels[Tier.DEVICE].tier
            assert isinstance(tier, DeviceTier)
            return tier.slot_of(page) if page in tier else None

    def tiers_of(self, page: PageHash) -> tuple[Tier, ...]:
        with self._mutex:
            return tuple(tier for tier, level in self._levels.items() if page in level.tier)

    def get(
        self, page: PageHash, out: torch.Tensor | None = None, promote: bool = True
    ) -> torch.Tensor | None:
        """A copy of a page, or None if no tier holds it intact. Counts one lookup.

        With `promote` (the default) a lower-tier hit is first copied into the device
        tier; without it the page is read where it is (serving a peer should not
        reshuffle this worker's device tier). `out` receives the copy if given.
        """
        with self._mutex:
            self._check_open()
            device = self._levels[Tier.DEVICE]
            for tier, level in self._levels.items():
                level.stats.lookups += 1
                if page not in level.tier:
                    continue
                if tier is not Tier.DEVICE and promote:
                    if not self._promote(page):
                        continue
                    level.stats.hit_pages += 1
                    return self._copy_out(Tier.DEVICE, page, out)
                if tier is Tier.DEVICE:
                    device.tracker.touch(page)
                dst = out if out is not None else self._new_page_buffer(tier)
                if not self._transfer_out(tier, page, dst):
                    self._drop_corrupt(tier, page)
                    continue
                level.stats.hit_pages += 1
                if tier is not Tier.DEVICE:
                    level.tracker.touch(page)
                return dst
            return None

    def _new_page_buffer(self, tier: Tier) -> torch.Tensor:
        device = self.device if tier is Tier.DEVICE else torch.device("cpu")
        return torch.empty(self.layout.page_shape, dtype=self.layout.torch_dtype, device=device)

    def _copy_out(self, tier: Tier, page: PageHash, out: torch.Tensor | None) -> torch.Tensor:
        dst = out if out is not None else self._new_page_buffer(tier)
        self._levels[tier].tier.read_into(page, dst)
        return dst

    def _transfer_out(self, tier: Tier, page: PageHash, dst: torch.Tensor) -> bool:
        level = self._levels[tier]
        started = time.perf_counter()
        if isinstance(level.tier, DiskTier) and dst.device.type != "cpu":
            staging = self._staging_page()
            ok = level.tier.read_into(page, staging)
            if ok:
                copy_page(dst, staging)
        else:
            ok = level.tier.read_into(page, dst)
        level.stats.read_seconds += time.perf_counter() - started
        level.stats.reads += 1
        if ok:
            level.stats.bytes_read += self.layout.page_nbytes
        return ok

    def lend(self, pages: Sequence[PageHash]) -> PageLoan | None:
        """Lend the bytes of `pages` in place, for a zero-copy send (see `PageLoan`): None, and
        nothing lent, unless every page is held in host memory (the device tier on the CPU, or
        the host tier; a page only on a GPU or the disk must be copied out with `get`).

        Reads each page where it is, as `get(promote=False)` does (no promotion; counts a lookup
        and a read per page), and pins it there until the loan is released: eviction passes it
        over, and `remove` takes it out of the store at once but leaves its slot, and its bytes,
        untouched until then. The caller must release the loan (a lease bounds how long).
        """
        with self._mutex:
            self._check_open()
            tiers: list[Tier] = []
            for page in pages:
                tier = self._best(page)
                if tier is None or not self._in_host_memory(tier):
                    return None
                tiers.append(tier)
            held: list[tuple[Tier, PageHash, int]] = []
            for page, tier in zip(pages, tiers, strict=True):
                level = self._levels[tier]
                assert isinstance(level.tier, DeviceTier | HostTier)
                for upper in self._levels:
                    self._levels[upper].stats.lookups += 1
                    if upper is tier:
                        break
                level.tracker.touch(page)
                level.stats.hit_pages += 1
                level.stats.reads += 1
                level.stats.bytes_read += self.layout.page_nbytes
                level.pins[page] += 1
                held.append((tier, page, level.tier.hold(page)))
            return PageLoan(tuple(pages), self._runs(held), lambda: self._give_back(held))

    def _in_host_memory(self, tier: Tier) -> bool:
        return tier is Tier.HOST or (tier is Tier.DEVICE and self.device.type == "cpu")

    def _runs(self, held: Sequence[tuple[Tier, PageHash, int]]) -> tuple[np.ndarray, ...]:
        """The lent slots' bytes, one view per run of adjacent slots of one tier."""
        runs: list[tuple[Tier, int, int]] = []
        for tier, _page, slot in held:
            if runs and runs[-1][0] is tier and runs[-1][1] + runs[-1][2] == slot:
                runs[-1] = (tier, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((tier, slot, 1))
        views = []
        for tier, first, count in runs:
            slots = self._levels[tier].tier
            assert isinstance(slots, DeviceTier | HostTier)
            views.append(slots.slot_bytes(first, count).numpy())
        return tuple(views)

    def _give_back(self, held: Sequence[tuple[Tier, PageHash, int]]) -> None:
        with self._mutex:
            if self._closed:  # the tiers let go of every slot when they closed
                return
            for tier, page, slot in held:
                level = self._levels[tier]
                level.pins[page] -= 1
                if not level.pins[page]:
                    del level.pins[page]
                assert isinstance(level.tier, DeviceTier | HostTier)
                level.tier.let_go(slot)

    def lock(self, pages: Sequence[PageHash], *, lookup: bool = False) -> list[int]:
        """Pin pages in the device tier (promoting them first); returns their device slots.

        All or nothing: if a page is in no tier (`KVPageNotFound`) or the device tier
        cannot take it (`KVCapacityError`), the locks taken by this call are released.
        Locks nest; each `lock` needs one `unlock`.

        With `lookup`, a successful call also counts as a cache lookup of `pages`, as
        `lookup()` counts one: a lookup in each tier the search reached for a page, a hit
        in the tier that held it. The LLM's prefix matching reads its cached prefix this
        way (with `record_miss` for the page that ended it), so the tier hit rates show
        prefix reuse, not only pages served to peers.
        """
        taken: list[PageHash] = []
        held: list[Tier] = []
        with self._mutex:
            self._check_open()
            device = self._levels[Tier.DEVICE]
            with ExitStack() as undo:
                undo.callback(self._release, taken)  # on any failure, the locks this call took so far
                for page in pages:
                    if page in device.tier:
                        device.tracker.touch(page)
                        held.append(Tier.DEVICE)
                    else:
                        source = self._best(page)
                        if source is None or not self._promote(page):
                            raise KVPageNotFound(page)
                        held.append(source)
                    self._locks[page] += 1
                    taken.append(page)
                undo.pop_all()
            if lookup:
                for source in held:
                    for tier, level in self._levels.items():
                        level.stats.lookups += 1
                        if tier is source:
                            level.stats.hit_pages += 1
                            break
            assert isinstance(device.tier, DeviceTier)
            return [device.tier.slot_of(page) for page in pages]

    def record_miss(self) -> None:
        """Count a lookup of a page no tier holds (a lookup in every tier, no hit): how a
        prefix search that stopped short of what it wanted ends (see `lock`)."""
        with self._mutex:
            for level in self._levels.values():
                level.stats.lookups += 1

    def _release(self, pages: Iterable[PageHash]) -> None:
        for page in pages:
            self._locks[page] -= 1
            if not self._locks[page]:
                del self._locks[page]

    def unlock(self, pages: Sequence[PageHash]) -> None:
        with self._mutex:
            missing = [page for page, n in Counter(pages).items() if self._locks.get(page, 0) < n]
            if missing:
                raise KVLockError(f"unlock of pages that are not locked: {missing[:4]}")
            self._release(pages)

    def lock_count(self, page: PageHash) -> int:
        with self._mutex:
            return self._locks.get(page, 0)

    def view(self, page: PageHash) -> torch.Tensor:
        """The device tier's own bytes of a locked page (no copy); valid until it is unlocked."""
        with self._mutex:
            if not self._locks.get(page):
                raise KVLockError(f"page {page[:16]}... is not locked; lock it before taking a view")
            device = self._levels[Tier.DEVICE].tier
            assert isinstance(device, DeviceTier)
            return device.view(page)

    def prefetch(self, pages: Sequence[PageHash], lock: bool = False) -> PrefetchHandle:
        """Promote pages into the device tier in the background; `lock` also locks each one loaded."""
        with self._mutex:
            self._check_open()
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")
            cancelled = threading.Event()
            future = self._executor.submit(self._prefetch_job, list(pages), lock, cancelled)
        return PrefetchHandle(future, cancelled)

    def _prefetch_job(self, pages: list[PageHash], lock: bool, cancelled: threading.Event) -> PrefetchResult:
        loaded = resident = locked = 0
        missing: list[PageHash] = []
        stopped = False
        for page in pages:
            with self._mutex:
                if cancelled.is_set():
                    stopped = True
                    break
                self._check_open()
                device = self._levels[Tier.DEVICE]
                if page in device.tier:
                    resident += 1
                elif self._promote(page):
                    loaded += 1
                else:
                    missing.append(page)
                    continue
                if lock:
                    self._locks[page] += 1
                    locked += 1
        return PrefetchResult(
            loaded=loaded, resident=resident, missing=tuple(missing), locked=locked, cancelled=stopped
        )

    def remove(self, page: PageHash) -> None:
        """Forget a page in every tier. Refused while it is locked."""
        with self._mutex:
            self._check_open()
            if self._locks.get(page):
                raise KVLockError(f"page {page[:16]}... is locked")
            for tier, level in self._levels.items():
                if page in level.tier:
                    level.tier.remove(page)
                    level.tracker.remove(page)
                    self._emit(KVEventKind.DROPPED, page, tier)

    def resident_pages(self) -> dict[PageHash, Tier]:
        """Every page the store holds, with the fastest tier holding it."""
        with self._mutex:
            best: dict[PageHash, Tier] = {}
            for tier in sorted(self._levels, reverse=True):
                for page in self._levels[tier].tier.pages():
                    best[page] = tier
            return best

    def record_pull(self, pages: int, nbytes: int, seconds: float, failed: bool = False,
                    paths: Mapping[str, int] | None = None) -> None:
        """Account a cross-worker pull (done by `engine.data.kv.pull`) in the metrics; `paths`:
        its pages per transport (`pull.<transport>.pages`)."""
        with self._mutex:
            if failed:
                self.pulls.failures += 1
            else:
                self.pulls.pages += pages
                self.pulls.bytes += nbytes
            self.pulls.paths.update(paths or {})
            self.pulls.seconds += seconds

    def metrics(self) -> dict[str, float]:
        """Plain numbers per tier (`device.hit_rate`, `host.bytes_used`, ...) and for pulls."""
        with self._mutex:
            out: dict[str, float] = {}
            nbytes = self.layout.page_nbytes
            for tier, level in self._levels.items():
                prefix = tier.label
                out.update(level.stats.as_dict(prefix))
                out[f"{prefix}.pages_used"] = len(level.tier)
                out[f"{prefix}.capacity_pages"] = level.tier.capacity_pages
                out[f"{prefix}.bytes_used"] = len(level.tier) * nbytes
                out[f"{prefix}.capacity_bytes"] = level.tier.capacity_pages * nbytes
                out[f"{prefix}.lent_pages"] = len(level.pins)  # outside the mutex, pins are loans
            out["device.locked_pages"] = len(self._locks)
            out["pull.pages"] = self.pulls.pages
            out["pull.bytes"] = self.pulls.bytes
            out["pull.seconds"] = self.pulls.seconds
            out["pull.failures"] = self.pulls.failures
            for path, pages in self.pulls.paths.items():
                out[f"pull.{path}.pages"] = pages
            return out

    def _close_tiers(self) -> None:
        for level in self._levels.values():
            level.tier.close()

    def close(self) -> None:
        """Stop prefetching, unlink the host segment and close the disk file. Idempotent."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        with self._mutex:
            self._listeners.clear()
            self._close_tiers()
            self._staging = None

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
