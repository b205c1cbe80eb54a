"""Device tier: one preallocated tensor of page slots on the GPU, or on the CPU without one."""

from __future__ import annotations

import torch

from engine.data.kv.copy import copy_page
from engine.data.kv.errors import KVCapacityError, KVClosedError
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.memory import MemorySlots
from engine.data.kv.tier import Tier


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DeviceTier(MemorySlots):
    """Page slots in one tensor `pool` of shape `(capacity, 2, L, page, H, D)`.

    The tier only stores bytes; which page to evict is the store's decision. Views
    returned by `view` alias the pool and are valid only while the page stays in the
    tier (the store guarantees that for locked pages).
    """

    tier = Tier.DEVICE

    def __init__(
        self, layout: KVLayout, capacity_pages: int, device: torch.device | str | None = None
    ) -> None:
        self._init_slots(layout, capacity_pages)
        self.device = torch.device(device) if device is not None else default_device()
        self.pool: torch.Tensor | None = torch.empty(
            (capacity_pages, *layout.page_shape), dtype=layout.torch_dtype, device=self.device
        )

    def _page_slots(self) -> torch.Tensor:
        if self.pool is None:
            raise KVClosedError("device tier is closed")
        return self.pool


    def write(self, page: PageHash, src: torch.Tensor) -> int:
        """Copy `src` (one page, any device) into a free slot; returns the slot."""
        pool = self._page_slots()
        if not self._free:
            raise KVCapacityError(self.tier.label, self.capacity_pages, 0)
        slot = self._free.pop()
        copied = False
        try:
            copy_page(pool[slot], src)
            copied = True
        finally:
            if not copied:  # the slot goes back to the free list
                self._free.append(slot)
        self._slots[page] = slot
        return slot

    def allocate(self, page: PageHash) -> torch.Tensor:
        """Reserve a slot for `page` and return it for the caller to fill (e.g. a disk read)."""
        pool = self._page_slots()
        if not self._free:
            raise KVCapacityError(self.tier.label, self.capacity_pages, 0)
        slot = self._free.pop()
        self._slots[page] = slot
        return pool[slot]

    def remove(self, page: PageHash) -> None:
        self._recycle(self._slots.pop(page))

    def close(self) -> None:
        self.pool = None
        self._clear_slots()
