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

`KVStore` is the public face: it owns the mutex, the open/closed state and the pull metrics,
and under the mutex calls its parts: `hierarchy.TierHierarchy` (the tiers, their locks and pins,
eviction, demotion, promotion and the events), `locks` (taking and giving back locks), `loan`
(pages lent in place) and `prefetch.Prefetcher` (promotion on a background thread). Its config
is in `config`, its events in `events`; both are re-exported here, as is `Capacity`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engine.data.kv.config import DiskTierConfig, KVStoreConfig, WritePolicy
from engine.data.kv.errors import KVClosedError, KVLockError
from engine.data.kv.events import KVEvent, KVEventKind, KVListener
from engine.data.kv.hierarchy import TierHierarchy
from engine.data.kv.host import HostTier
from engine.data.kv.keys import PageHash
from engine.data.kv.loan import HeldSlot, PageLoan, give_back, hold_in_place, lent_runs
from engine.data.kv.locks import lock_pages, unlock_pages
from engine.data.kv.prefetch import Prefetcher, PrefetchHandle, PrefetchResult
from engine.data.kv.tier import Capacity, Tier

__all__ = [
    "Capacity",
    "DiskTierConfig",
    "KVEvent",
    "KVEventKind",
    "KVStore",
    "KVStoreConfig",
    "LookupResult",
    "PrefetchHandle",
    "PrefetchResult",
    "WritePolicy",
]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest run of leading pages held by the store, and the fastest tier of each."""

    prefix_pages: int
    tiers: tuple[Tier, ...]

    def pages_in(self, tier: Tier) -> int:
        return sum(1 for t in self.tiers if t is tier)


@dataclass(slots=True)
class _PullStats:
    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    paths: Counter[str] = field(default_factory=Counter)
    """Pages pulled per transport (`shm`, `tcp`, `inline`, `local`): which path they took."""

    def record(self, pages: int, nbytes: int, seconds: float, failed: bool, paths: Mapping[str, int]) -> None:
        if failed:
            self.failures += 1
        else:
            self.pages += pages
            self.bytes += nbytes
        self.paths.update(paths)
        self.seconds += seconds

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {
            "pull.pages": self.pages, "pull.bytes": self.bytes, "pull.seconds": self.seconds,
            "pull.failures": self.failures,
        }
        for path, pages in self.paths.items():
            out[f"pull.{path}.pages"] = pages
        return out


class KVStore:
    """The paged KV cache of one worker process. See the module docstring for the rules and its parts."""

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self.layout = config.layout
        self._mutex = threading.RLock()
        self._closed = False
        self.pulls = _PullStats()
        self._tiers = TierHierarchy(config)
        self._prefetcher = Prefetcher(self._tiers, self._mutex, self._check_open)

    # -- plumbing ------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(self._tiers.levels)

    @property
    def device(self) -> torch.device:
        return self._tiers.device.device

    @property
    def device_pool(self) -> torch.Tensor:
        """The device tier's slots, `(capacity, 2, L, page, H, D)`, for kernels that index by slot."""
        tier = self._tiers.device
        assert tier.pool is not None
        return tier.pool

    @property
    def host_segment_name(self) -> str | None:
        """Name other processes attach to (`HostPageReader(name)`); None without a host tier."""
        level = self._tiers.levels.get(Tier.HOST)
        return level.tier.name if level is not None and isinstance(level.tier, HostTier) else None

    def add_listener(self, listener: KVListener) -> None:
        with self._mutex:
            self._tiers.listeners.append(listener)

    def remove_listener(self, listener: KVListener) -> None:
        """Stop sending events to `listener` (no error if it was not, or no longer is, registered)."""
        with self._mutex:
            if listener in self._tiers.listeners:
                self._tiers.listeners.remove(listener)

    def _check_open(self) -> None:
        if self._closed:
            raise KVClosedError("KV store is closed")

    # -- public API -------------------------------------------------------------------

    def put(self, page: PageHash, data: torch.Tensor) -> None:
        """Store one page (copied). A page already in the device tier is only marked used."""
        data = self.layout.check_page(data)
        with self._mutex:
            self._check_open()
            levels = self._tiers.levels
            device = levels[Tier.DEVICE]
            if page in device.tier:
                device.tracker.touch(page)
            else:
                frequency = max(
                    (lv.tracker.frequency(page) for lv in levels.values() if page in lv.tracker),
                    default=0,
                )
                self._tiers.make_room(Tier.DEVICE)
                self._tiers.write(Tier.DEVICE, page, data)
                device.tracker.insert(page, frequency + 1)
                self._tiers.emit(KVEventKind.STORED, page, Tier.DEVICE)
            if self.config.write is WritePolicy.WRITE_THROUGH:
                with self._tiers.pinned(Tier.DEVICE, page):
                    for tier in (Tier.HOST, Tier.DISK):
                        level = levels.get(tier)
                        if level is None or page in level.tier:
                            continue
                        self._tiers.make_room(tier)
                        self._tiers.write(tier, page, data)
                        level.tracker.insert(page)
                        self._tiers.emit(KVEventKind.STORED, page, tier)

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
                best = self._tiers.best(page)
                self._tiers.count_lookup(best)
                if best is None:
                    break
                found.append(best)
        return LookupResult(prefix_pages=len(found), tiers=tuple(found))

    def contains(self, page: PageHash) -> bool:
        with self._mutex:
            return self._tiers.best(page) is not None

    def resident_run(self, pages: Sequence[PageHash]) -> int:
        """How many leading `pages` some tier holds, looked at under one hold of the mutex. Does
        not move or touch pages and, unlike `lookup`, counts no lookups in the tiers' metrics."""
        with self._mutex:
            run = 0
            while run < len(pages) and self._tiers.best(pages[run]) is not None:
                run += 1
            return run

    def device_slot(self, page: PageHash) -> int | None:
        """The device tier slot holding `page` (None: not there). Valid only while it stays; a
        listener reads it under the mutex, when an event says where the page went."""
        with self._mutex:
            tier = self._tiers.device
            return tier.slot_of(page) if page in tier else None

    def tiers_of(self, page: PageHash) -> tuple[Tier, ...]:
        with self._mutex:
            return tuple(tier for tier, level in self._tiers.levels.items() if page in level.tier)

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
            device = self._tiers.levels[Tier.DEVICE]
            for tier, level in self._tiers.levels.items():
                level.stats.lookups += 1
                if page not in level.tier:
                    continue
                if tier is not Tier.DEVICE and promote:
                    if not self._tiers.promote(page):
                        continue
                    level.stats.hit_pages += 1
                    dst = out if out is not None else self._tiers.page_buffer(Tier.DEVICE)
                    device.tier.read_into(page, dst)
                    return dst
                if tier is Tier.DEVICE:
                    device.tracker.touch(page)
                dst = out if out is not None else self._tiers.page_buffer(tier)
                if not self._tiers.read(tier, page, dst):
                    self._tiers.drop_corrupt(tier, page)
                    continue
                level.stats.hit_pages += 1
                if tier is not Tier.DEVICE:
                    level.tracker.touch(page)
                return dst
            return None

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
            held = hold_in_place(self._tiers, pages)
            if held is None:
                return None
            return PageLoan(tuple(pages), lent_runs(self._tiers, held), lambda: self._give_back(held))

    def _give_back(self, held: Sequence[HeldSlot]) -> None:
        with self._mutex:
            if self._closed:  # the tiers let go of every slot when they closed
                return
            give_back(self._tiers, held)

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
        with self._mutex:
            self._check_open()
            found = lock_pages(self._tiers, pages)
            if lookup:
                for source in found:
                    self._tiers.count_lookup(source)
            return [self._tiers.device.slot_of(page) for page in pages]

    def record_miss(self) -> None:
        """Count a lookup of a page no tier holds (a lookup in every tier, no hit): how a
        prefix search that stopped short of what it wanted ends (see `lock`)."""
        with self._mutex:
            self._tiers.count_lookup(None)

    def unlock(self, pages: Sequence[PageHash]) -> None:
        """Give back one lock on each of `pages` (all or nothing: `KVLockError` if one holds fewer)."""
        with self._mutex:
            unlock_pages(self._tiers, pages)

    def lock_count(self, page: PageHash) -> int:
        with self._mutex:
            return self._tiers.locks.get(page, 0)

    def view(self, page: PageHash) -> torch.Tensor:
        """The device tier's own bytes of a locked page (no copy); valid until it is unlocked."""
        with self._mutex:
            if not self._tiers.locks.get(page):
                raise KVLockError(f"page {page[:16]}... is not locked; lock it before taking a view")
            return self._tiers.device.view(page)

    def prefetch(self, pages: Sequence[PageHash], lock: bool = False) -> PrefetchHandle:
        """Promote pages into the device tier in the background; `lock` also locks each one loaded."""
        with self._mutex:
            self._check_open()
            return self._prefetcher.start(list(pages), lock)

    def remove(self, page: PageHash) -> None:
        """Forget a page in every tier. Refused while it is locked."""
        with self._mutex:
            self._check_open()
            if self._tiers.locks.get(page):
                raise KVLockError(f"page {page[:16]}... is locked")
            for tier, level in self._tiers.levels.items():
                if page in level.tier:
                    level.tier.remove(page)
                    level.tracker.remove(page)
                    self._tiers.emit(KVEventKind.DROPPED, page, tier)

    def resident_pages(self) -> dict[PageHash, Tier]:
        """Every page the store holds, with the fastest tier holding it."""
        with self._mutex:
            best: dict[PageHash, Tier] = {}
            for tier in sorted(self._tiers.levels, reverse=True):
                for page in self._tiers.levels[tier].tier.pages():
                    best[page] = tier
            return best

    def record_pull(self, pages: int, nbytes: int, seconds: float, failed: bool = False,
                    paths: Mapping[str, int] | None = None) -> None:
        """Account a cross-worker pull (done by `engine.data.kv.pull`) in the metrics; `paths`:
        its pages per transport (`pull.<transport>.pages`)."""
        with self._mutex:
            self.pulls.record(pages, nbytes, seconds, failed, paths or {})

    def metrics(self) -> dict[str, float]:
        """Plain numbers per tier (`device.hit_rate`, `host.bytes_used`, ...) and for pulls."""
        with self._mutex:
            return self._tiers.metrics() | self.pulls.as_dict()

    def close(self) -> None:
        """Stop prefetching, unlink the host segment and close the disk file. Idempotent."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
        self._prefetcher.stop()
        with self._mutex:
            self._tiers.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
