"""`TierHierarchy`: a store's tiers, fastest first, and every move of a page between them.

It owns the tiers (device, host, disk: opened from the config, closed together), each with its
eviction tracker, its metrics and its pins (pages a move or a loan is reading), the device
tier's lock counts, and the listeners, which it tells of every change of residency (`events`).
* `make_room` evicts by the tier's policy, passing over locked and pinned pages, until a slot
  is free; `KVCapacityError` when nothing can go.
* `evict` demotes the victim to the next tier down unless that tier holds it already (making
  room there first), then forgets it; a page evicted from the last tier is gone.
* `promote` copies a page held only lower down into the device tier and leaves the lower copy;
  a copy found corrupt is dropped and the next tier down tried.
* `write` and `read` move one page into or out of a tier, timed for the metrics.
Not thread-safe: `KVStore` calls it under its mutex, and the copies run under that mutex too.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from engine.data.kv.config import KVStoreConfig
from engine.data.kv.copy import copy_page
from engine.data.kv.device import DeviceTier
from engine.data.kv.disk import DiskTier
from engine.data.kv.errors import KVCapacityError
from engine.data.kv.events import KVEvent, KVEventKind, KVListener
from engine.data.kv.host import HostTier
from engine.data.kv.keys import PageHash
from engine.data.kv.policy import PageTracker, make_tracker
from engine.data.kv.tier import Tier, TierStats

AnyTier = DeviceTier | HostTier | DiskTier


@dataclass(slots=True)
class Level:
    """One tier of the hierarchy and what is kept about it."""

    tier: AnyTier
    tracker: PageTracker
    stats: TierStats = field(default_factory=TierStats)
    pins: Counter[PageHash] = field(default_factory=Counter)


class TierHierarchy:
    """The tiers of one store, fastest first. See the module docstring for the moves."""

    def __init__(self, config: KVStoreConfig) -> None:
        self.layout = config.layout
        nbytes = config.layout.page_nbytes
        self.levels: dict[Tier, Level] = {}
        self.locks: Counter[PageHash] = Counter()  # device pages in use by compute: never evicted
        self.listeners: list[KVListener] = []
        self._staging: torch.Tensor | None = None
        with ExitStack() as undo:
            undo.callback(self.close)  # a store that cannot open all its tiers closes those it opened
            self.levels[Tier.DEVICE] = Level(
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
                self.levels[Tier.HOST] = Level(host, make_tracker(config.eviction))
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
                self.levels[Tier.DISK] = Level(disk, tracker)
            undo.pop_all()

    @property
    def device(self) -> DeviceTier:
        tier = self.levels[Tier.DEVICE].tier
        assert isinstance(tier, DeviceTier)
        return tier

    def best(self, page: PageHash) -> Tier | None:
        """The fastest tier holding `page`; None: no tier does."""
        for tier, level in self.levels.items():
            if page in level.tier:
                return tier
        return None

    def count_lookup(self, found: Tier | None) -> None:
        """Count one page's lookup: one in each tier the search reached, and a hit in `found`,
        where it stopped (None: it reached every tier and found nothing)."""
        for tier, level in self.levels.items():
            level.stats.lookups += 1
            if tier is found:
                level.stats.hit_pages += 1
                return

    def release(self, pages: Iterable[PageHash]) -> None:
        """Take one lock off each of `pages` (the caller checked they hold one)."""
        for page in pages:
            self.locks[page] -= 1
            if not self.locks[page]:
                del self.locks[page]

    def emit(self, kind: KVEventKind, page: PageHash, tier: Tier, source: Tier | None = None) -> None:
        if not self.listeners:
            return
        event = KVEvent(kind=kind, page=page, tier=tier, source=source, best=self.best(page))
        for listener in self.listeners:
            listener(event)

    # -- room, eviction, promotion ---------------------------------------------------

    def make_room(self, tier: Tier) -> None:
        level = self.levels[tier]
        while level.tier.free_pages == 0:
            victim = next((p for p in level.tracker.order() if not self._protected(tier, p)), None)
            if victim is None:
                locked = sum(1 for p in level.tracker.order() if self._protected(tier, p))
                raise KVCapacityError(tier.label, level.tier.capacity_pages, locked)
            self._evict(tier, victim)

    def promote(self, page: PageHash) -> bool:
        """Copy a page held only by a lower tier into the device tier. False if none has it intact."""
        for src in (Tier.HOST, Tier.DISK):
            level = self.levels.get(src)
            if level is None or page not in level.tier:
                continue
            with self.pinned(src, page):
                self.make_room(Tier.DEVICE)
                if not self._timed(page, src, Tier.DEVICE, lambda s=src: self._load_into_device(page, s)):
                    self.drop_corrupt(src, page)
                    continue
            frequency = level.tracker.frequency(page)
            level.tracker.touch(page)
            device = self.levels[Tier.DEVICE]
            device.tracker.insert(page, frequency + 1)
            device.stats.promotions += 1
            self.emit(KVEventKind.PROMOTED, page, Tier.DEVICE, source=src)
            return True
        return False

    def drop_corrupt(self, tier: Tier, page: PageHash) -> None:
        level = self.levels[tier]
        # The disk tier already forgot the page when its checksum failed.
        if page in level.tier:
            level.tier.remove(page)
        level.tracker.remove(page)
        level.stats.dropped_corrupt += 1
        self.emit(KVEventKind.DROPPED, page, tier)

    @contextmanager
    def pinned(self, tier: Tier, page: PageHash) -> Iterator[None]:
        """Keep `page` in `tier` from eviction for the duration (pins nest)."""
        pins = self.levels[tier].pins
        pins[page] += 1
        try:
            yield
        finally:
            pins[page] -= 1
            if not pins[page]:
                del pins[page]

    def _protected(self, tier: Tier, page: PageHash) -> bool:
        if tier is Tier.DEVICE and self.locks.get(page):
            return True
        return bool(self.levels[tier].pins.get(page))

    def _below(self, tier: Tier) -> Tier | None:
        for lower in self.levels:
            if lower > tier:
                return lower
        return None

    def _evict(self, tier: Tier, page: PageHash) -> None:
        level = self.levels[tier]
        lower = self._below(tier)
        if lower is not None:
            below = self.levels[lower]
            with self.pinned(tier, page):
                if page in below.tier:
                    below.tracker.touch(page)
                else:
                    self.make_room(lower)
                    self._timed(page, tier, lower, lambda: self._copy_down(page, tier, lower))
                    below.tracker.insert(page, level.tracker.frequency(page))
                below.stats.demotions += 1
                self.emit(KVEventKind.DEMOTED, page, lower, source=tier)
        level.tier.remove(page)
        level.tracker.remove(page)
        level.stats.evictions += 1
        self.emit(KVEventKind.EVICTED, page, tier)

    def _timed(self, page: PageHash, src: Tier, dst: Tier, copy: Callable[[], bool]) -> bool:
        """Run `copy` of `page` from `src` to `dst`, counting it in both tiers' metrics."""
        started = time.perf_counter()
        ok = copy()
        elapsed = time.perf_counter() - started
        nbytes = self.layout.page_nbytes
        src_stats, dst_stats = self.levels[src].stats, self.levels[dst].stats
        src_stats.reads += 1
        src_stats.read_seconds += elapsed
        dst_stats.writes += 1
        dst_stats.write_seconds += elapsed
        if ok:
            src_stats.bytes_read += nbytes
            dst_stats.bytes_written += nbytes
        return ok

    def _copy_down(self, page: PageHash, src: Tier, dst: Tier) -> bool:
        source = self.levels[src].tier
        assert isinstance(source, DeviceTier | HostTier)
        self.levels[dst].tier.write(page, source.view(page))
        return True

    def _staging_page(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(
                self.layout.page_shape, dtype=self.layout.torch_dtype, pin_memory=torch.cuda.is_available()
            )
        return self._staging

    def _load_into_device(self, page: PageHash, src: Tier) -> bool:
        device = self.device
        source = self.levels[src].tier
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

    # -- one page in or out, timed -------------------------------------------------------

    def write(self, tier: Tier, page: PageHash, data: torch.Tensor) -> None:
        stats = self.levels[tier].stats
        started = time.perf_counter()
        self.levels[tier].tier.write(page, data)
        stats.write_seconds += time.perf_counter() - started
        stats.writes += 1
        stats.bytes_written += self.layout.page_nbytes

    def read(self, tier: Tier, page: PageHash, dst: torch.Tensor) -> bool:
        """Copy `page` out of `tier` into `dst`; False if the tier found it corrupt."""
        level = self.levels[tier]
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

    def page_buffer(self, tier: Tier) -> torch.Tensor:
        """An empty page on the device of `tier`'s copies: the device tier's, else the CPU."""
        device = self.device.device if tier is Tier.DEVICE else torch.device("cpu")
        return torch.empty(self.layout.page_shape, dtype=self.layout.torch_dtype, device=device)

    def metrics(self) -> dict[str, float]:
        """Plain numbers per tier (`device.hit_rate`, `host.bytes_used`, ...) and `device.locked_pages`."""
        out: dict[str, float] = {}
        nbytes = self.layout.page_nbytes
        for tier, level in self.levels.items():
            prefix = tier.label
            out.update(level.stats.as_dict(prefix))
            out[f"{prefix}.pages_used"] = len(level.tier)
            out[f"{prefix}.capacity_pages"] = level.tier.capacity_pages
            out[f"{prefix}.bytes_used"] = len(level.tier) * nbytes
            out[f"{prefix}.capacity_bytes"] = level.tier.capacity_pages * nbytes
            out[f"{prefix}.lent_pages"] = len(level.pins)  # outside the mutex, pins are loans
        out["device.locked_pages"] = len(self.locks)
        return out

    def close(self) -> None:
        """Forget the listeners and close every tier (unlinking the host segment, closing the disk file)."""
        self.listeners.clear()
        for level in self.levels.values():
            level.tier.close()
        self._staging = None
