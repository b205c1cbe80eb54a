"""`MemorySlots`: what the device and host tiers share, page slots in one tensor.

A subclass keeps its pages in a tensor of shape `(capacity_pages, *layout.page_shape)` and
gives it through `_page_slots()` (raising `KVClosedError` once the tier is closed); the
residency bookkeeping (`SlotTable`) and the reads of a resident page are written here once.
"""

from __future__ import annotations

import torch

from engine.data.kv.copy import copy_page
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.tier import SlotTable


class MemorySlots(SlotTable):
    _slots: dict[PageHash, int]

    def _init_slots(self, layout: KVLayout, capacity_pages: int) -> None:
        """Every slot free, none held."""
        self.layout = layout
        self.capacity_pages = capacity_pages
        self._slots = {}
        # Lowest slot first, so a fresh tier fills slots 0, 1, 2... (deterministic for tests).
        self._free = list(range(capacity_pages - 1, -1, -1))
        self._held = {}
        self._orphaned = set()

    def _clear_slots(self) -> None:
        """Forget every page and slot (the tier is closing)."""
        self._slots.clear()
        self._free.clear()
        self._held.clear()
        self._orphaned.clear()

    def _page_slots(self) -> torch.Tensor:
        raise NotImplementedError

    def slot_of(self, page: PageHash) -> int:
        return self._slots[page]

    def view(self, page: PageHash) -> torch.Tensor:
        """Zero-copy view of a resident page; valid until the page leaves the tier."""
        return self._page_slots()[self._slots[page]]

    def slot_bytes(self, first: int, count: int) -> torch.Tensor:
        """The bytes of `count` adjacent slots from `first`, 1-D uint8, no copy."""
        return self._page_slots()[first : first + count].reshape(-1).view(torch.uint8)

    def read_into(self, page: PageHash, dst: torch.Tensor) -> bool:
        copy_page(dst, self._page_slots()[self._slots[page]])
        return True
