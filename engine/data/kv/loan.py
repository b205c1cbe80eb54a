"""Pages lent out of a `KVStore` for a zero-copy send: views of the store's own slots, kept
from reuse until the borrower gives them back (`KVStore.lend`).

`PageLoan` is what the borrower holds; `hold_in_place`, `lent_runs` and `give_back` are how the
store makes and ends one over its `TierHierarchy`, under its mutex.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.data.kv.device import DeviceTier
from engine.data.kv.hierarchy import TierHierarchy
from engine.data.kv.host import HostTier
from engine.data.kv.keys import PageHash
from engine.data.kv.tier import Tier


@dataclass(eq=False)
class PageLoan:
    """The bytes of `pages`, in order, as views of the lending store's slots (no copy): `runs`
    are 1-D uint8 arrays, one per run of pages in adjacent slots of one tier.

    Until `release`, the store neither evicts these pages nor reuses their slots: a page
    removed meanwhile leaves the store at once, but its slot keeps its bytes until the
    release, so a send reading `runs` reads what was written. Read-only to the borrower.
    `release` gives the pages back; it is idempotent and safe from any thread.
    """

    pages: tuple[PageHash, ...]
    runs: tuple[np.ndarray, ...]
    _give_back: Callable[[], None] = field(repr=False)
    _released: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(run.nbytes for run in self.runs)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._give_back()


@dataclass(frozen=True, slots=True)
class HeldSlot:
    """A lent page: the tier it is read from and the slot that tier holds for it."""

    tier: Tier
    page: PageHash
    slot: int


def hold_in_place(tiers: TierHierarchy, pages: Sequence[PageHash]) -> list[HeldSlot] | None:
    """Hold the slot of each of `pages` where it is, pinned there: None, and nothing held, unless
    every page is in host memory. Counts a lookup and a read of each, as `KVStore.get(promote=False)`."""
    found: list[Tier] = []
    for page in pages:
        tier = tiers.best(page)
        if tier is None or not _in_host_memory(tiers, tier):
            return None
        found.append(tier)
    held: list[HeldSlot] = []
    for page, tier in zip(pages, found, strict=True):
        level = tiers.levels[tier]
        assert isinstance(level.tier, DeviceTier | HostTier)
        tiers.count_lookup(tier)
        level.tracker.touch(page)
        level.stats.reads += 1
        level.stats.bytes_read += tiers.layout.page_nbytes
        level.pins[page] += 1
        held.append(HeldSlot(tier, page, level.tier.hold(page)))
    return held


def lent_runs(tiers: TierHierarchy, held: Sequence[HeldSlot]) -> tuple[np.ndarray, ...]:
    """The held slots' bytes, one view per run of adjacent slots of one tier."""
    runs: list[tuple[Tier, int, int]] = []
    for item in held:
        if runs and runs[-1][0] is item.tier and runs[-1][1] + runs[-1][2] == item.slot:
            runs[-1] = (item.tier, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((item.tier, item.slot, 1))
    views = []
    for tier, first, count in runs:
        slots = tiers.levels[tier].tier
        assert isinstance(slots, DeviceTier | HostTier)
        views.append(slots.slot_bytes(first, count).numpy())
    return tuple(views)


def give_back(tiers: TierHierarchy, held: Sequence[HeldSlot]) -> None:
    """Unpin the held pages and let their tiers reuse the slots (a removed page's slot only now)."""
    for item in held:
        level = tiers.levels[item.tier]
        level.pins[item.page] -= 1
        if not level.pins[item.page]:
            del level.pins[item.page]
        assert isinstance(level.tier, DeviceTier | HostTier)
        level.tier.let_go(item.slot)


def _in_host_memory(tiers: TierHierarchy, tier: Tier) -> bool:
    return tier is Tier.HOST or (tier is Tier.DEVICE and tiers.device.device.type == "cpu")
