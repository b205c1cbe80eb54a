"""What the three tiers share: their names, capacities and counters."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from engine.data.kv.errors import KVConfigError

if TYPE_CHECKING:
    from engine.data.kv.keys import PageHash
    from engine.data.kv.layout import KVLayout


class Tier(IntEnum):
    """Storage tiers, fastest first; the value orders them (lower is closer to compute)."""

    DEVICE = 0
    HOST = 1
    DISK = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Capacity:
    """Room of one tier, in pages or in bytes (exactly one of the two)."""

    pages: int | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.pages is None) == (self.bytes is None):
            raise KVConfigError("a tier capacity needs exactly one of pages= or bytes=")
        value = self.pages if self.pages is not None else self.bytes
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise KVConfigError(f"a tier capacity must be a positive int, got {value!r}")

    def in_pages(self, page_nbytes: int) -> int:
        if self.pages is not None:
            return self.pages
        assert self.bytes is not None
        pages = self.bytes // page_nbytes
        if pages <= 0:
            raise KVConfigError(f"capacity of {self.bytes} bytes holds no page of {page_nbytes} bytes")
        return pages


@dataclass(slots=True)
class TierStats:
    """Counters of one tier. Promotions and demotions count pages that arrived in this tier."""

    lookups: int = 0
    hit_pages: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    dropped_corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0

    def as_dict(self, prefix: str) -> dict[str, float]:
        transfers = self.reads + self.writes
        seconds = self.read_seconds + self.write_seconds
        return {
            f"{prefix}.lookups": self.lookups,
            f"{prefix}.hit_pages": self.hit_pages,
            f"{prefix}.hit_rate": self.hit_pages / self.lookups if self.lookups else 0.0,
            f"{prefix}.evictions": self.evictions,
            f"{prefix}.promotions": self.promotions,
            f"{prefix}.demotions": self.demotions,
            f"{prefix}.dropped_corrupt": self.dropped_corrupt,
            f"{prefix}.bytes_read": self.bytes_read,
            f"{prefix}.bytes_written": self.bytes_written,
            f"{prefix}.bytes_transferred": self.bytes_read + self.bytes_written,
            f"{prefix}.transfer_seconds": seconds,
            f"{prefix}.transfer_latency_ms": 1000.0 * seconds / transfers if transfers else 0.0,
        }


class SlotTable:
    """Residency bookkeeping shared by the tiers: which page sits in which slot, and
    the free slots. A subclass sets `layout`, `_slots` (page -> slot) and `_free` in
    its constructor; a tier of memory slots (device, host: `engine.data.kv.memory.MemorySlots`)
    also `_held` and `_orphaned` (both empty), and gives a removed page's slot to `_recycle`.

    A held slot (`hold`, for a zero-copy send of its bytes) is never reused while held: a
    page removed meanwhile leaves the tier at once, but its slot (and its bytes) only
    returns to the free list when the last hold is let go (`let_go`).
    """

    layout: KVLayout
    _slots: dict[PageHash, object]
    _free: list[int]
    _held: dict[int, int]
    _orphaned: set[int]

    def __contains__(self, page: object) -> bool:
        return page in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def bytes_used(self) -> int:
        return len(self._slots) * self.layout.page_nbytes

    def pages(self) -> Iterator[PageHash]:
        """Resident pages, in the order they were written."""
        return iter(list(self._slots))

    def hold(self, page: PageHash) -> int:
        """Keep `page`'s slot from reuse until `let_go(slot)` (holds nest); returns the slot."""
        slot = self._slots[page]
        assert isinstance(slot, int), "only tiers of memory slots lend them"
        self._held[slot] = self._held.get(slot, 0) + 1
        return slot

    def let_go(self, slot: int) -> None:
        """End one hold of `slot`; the last one frees it if its page was removed meanwhile."""
        count = self._held[slot] - 1
        if count:
            self._held[slot] = count
            return
        del self._held[slot]
        if slot in self._orphaned:
            self._orphaned.discard(slot)
            self._free.append(slot)

    def _recycle(self, slot: int) -> None:
        """A removed page's slot: free now, or when its last hold is let go."""
        if slot in self._held:
            self._orphaned.add(slot)
        else:
            self._free.append(slot)
