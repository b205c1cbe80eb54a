"""Host tier: page slots in one named shared-memory segment that other processes can map.

Segment layout (all little-endian):

* `[0, 4096)` segment header: `struct "<8sIIQQQI"` = magic `OFKVHST1`, format
  version, slot count, page bytes, slot-table offset, data offset, length of the
  layout JSON that follows it.
* slot table at `table_offset`: one 64-byte entry per slot (`SLOT_DTYPE`):
  `version` (u64 seqlock: odd while the owner rewrites the slot), `used` (u32),
  the page key as 32 raw digest bytes.
* page data at `data_offset` (4 KiB aligned): slot *i* holds one contiguous page.

The owning store is the only writer. A reader in another process (`HostPageReader`)
attaches by name, finds pages by key in the slot table and maps them without a copy;
the seqlock version tells it whether the page it looked at was rewritten meanwhile.
The owner creates the segment through `multiprocessing.shared_memory`, so the
resource tracker unlinks it even if the owner is killed; readers map
`/dev/shm/<name>` directly and never unlink it.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import uuid
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np
import torch

from engine.data.kv.copy import copy_page
from engine.data.kv.errors import KVCapacityError, KVClosedError, KVConfigError
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.memory import MemorySlots
from engine.data.kv.tier import Tier

log = logging.getLogger(__name__)

MAGIC = b"OFKVHST1"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQQQI")
_HEADER_BYTES = 4096
_ALIGN = 4096
SHM_DIR = "/dev/shm"

SLOT_DTYPE = np.dtype(
    [("version", "<u8"), ("used", "<u4"), ("reserved", "<u4"), ("digest", "u1", (32,)), ("pad", "u1", (16,))]
)
assert SLOT_DTYPE.itemsize == 64


def _align(value: int, to: int = _ALIGN) -> int:
    return (value + to - 1) // to * to


def _segment_size(nslots: int, page_nbytes: int) -> tuple[int, int, int]:
    table_offset = _HEADER_BYTES
    data_offset = _align(table_offset + nslots * SLOT_DTYPE.itemsize)
    return table_offset, data_offset, data_offset + nslots * page_nbytes


def _views(
    buf: memoryview, layout: KVLayout, nslots: int, table_offset: int, data_offset: int
) -> tuple[np.ndarray, torch.Tensor]:
    table = np.ndarray((nslots,), dtype=SLOT_DTYPE, buffer=buf, offset=table_offset)
    raw = np.ndarray((nslots * layout.page_nbytes,), dtype=np.uint8, buffer=buf, offset=data_offset)
    with warnings.catch_warnings():
        # A reader maps the segment read-only; torch warns about that, and the reader never writes.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        pages = torch.from_numpy(raw).view(layout.torch_dtype).view(nslots, *layout.page_shape)
    return table, pages


class HostTier(MemorySlots):
    """Owner side of the host tier. Not thread-safe: the store serializes calls."""

    tier = Tier.HOST

    def __init__(
        self, layout: KVLayout, capacity_pages: int, name: str | None = None, pin: bool | None = None
    ):
        self._init_slots(layout, capacity_pages)
        self.name = name or f"omniflow-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        table_offset, data_offset, size = _segment_size(capacity_pages, layout.page_nbytes)
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name=self.name, create=True, size=size
        )
        layout_json = json.dumps(layout.to_dict()).encode()
        header = _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            capacity_pages,
            layout.page_nbytes,
            table_offset,
            data_offset,
            len(layout_json),
        )
        self._shm.buf[: len(header) + len(layout_json)] = header + layout_json
        table, pages = _views(self._shm.buf, layout, capacity_pages, table_offset, data_offset)
        self._table: np.ndarray | None = table
        self._pages: torch.Tensor | None = pages
        self._table["version"] = 0
        self._table["used"] = 0
        self.pinned = False
        if pin if pin is not None else torch.cuda.is_available():
            self._pin()

    def _pin(self) -> None:
        """Page-lock the data region so host<->GPU copies run at full speed (CUDA only)."""
        pages = self._page_slots()
        result = torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), pages.numel() * pages.itemsize, 0)
        if int(result) != 0:
            raise KVConfigError(f"cudaHostRegister of the host KV segment failed with code {int(result)}")
        self.pinned = True

    def _page_slots(self) -> torch.Tensor:
        if self._pages is None:
            raise KVClosedError(f"host tier {self.name} is closed")
        return self._pages

    def _live_table(self) -> np.ndarray:
        if self._table is None:
            raise KVClosedError(f"host tier {self.name} is closed")
        return self._table


    def write(self, page: PageHash, src: torch.Tensor) -> int:
        pages, table = self._page_slots(), self._live_table()
        if not self._free:
            raise KVCapacityError(self.tier.label, self.capacity_pages, 0)
        slot = self._free.pop()
        entry = table[slot : slot + 1]
        entry["version"] += 1  # odd: readers must not trust this slot now
        copied = False
        try:
            copy_page(pages[slot], src)
            copied = True
        finally:
            if not copied:  # even again, and the slot goes back to the free list
                entry["version"] += 1
                self._free.append(slot)
        entry["digest"][0] = np.frombuffer(bytes.fromhex(page), dtype=np.uint8)
        entry["used"] = 1
        entry["version"] += 1
        self._slots[page] = slot
        return slot

    def remove(self, page: PageHash) -> None:
        table = self._live_table()
        slot = self._slots.pop(page)
        entry = table[slot : slot + 1]
        entry["version"] += 1
        entry["used"] = 0
        entry["version"] += 1
        self._recycle(slot)

    def close(self) -> None:
        """Unlink the segment. Mappings held by readers stay valid until they close."""
        if self._shm is None:
            return
        if self.pinned and self._pages is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pages.data_ptr())
            self.pinned = False
        self._table = None
        self._pages = None
        self._clear_slots()
        shm, self._shm = self._shm, None
        shm.unlink()
        try:
            shm.close()
        except BufferError:
            # A caller still holds a view of a page; the mapping goes away with it.
            log.warning("host KV segment %s unlinked while page views are still alive", self.name)


@dataclass(frozen=True, slots=True)
class HostPageView:
    """A zero-copy view of a page in another process's host tier, as of `version`."""

    page: PageHash
    slot: int
    version: int
    tensor: torch.Tensor


class HostPageReader:
    """Reader side: maps another process's host tier by name, read-only, without copying.

    A view is a snapshot claim: the owner may evict and reuse the slot at any time, so
    check `is_current(view)` after using its bytes (a seqlock), or use `read`, which
    copies and checks for you.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise KVConfigError(f"no host KV segment named {name!r}") from exc
        try:
            size = os.fstat(fd).st_size
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        buf = memoryview(self._mmap)
        magic, version, nslots, page_nbytes, table_offset, data_offset, json_len = _HEADER.unpack_from(buf)
        if magic != MAGIC or version != FORMAT_VERSION:
            buf.release()
            raise KVConfigError(f"segment {name!r} is not a host KV segment of format {FORMAT_VERSION}")
        self.layout = KVLayout.from_dict(json.loads(bytes(buf[_HEADER.size : _HEADER.size + json_len])))
        if self.layout.page_nbytes != page_nbytes:
            buf.release()
            raise KVConfigError(f"segment {name!r} has an inconsistent header")
        self.capacity_pages = nslots
        table, pages = _views(buf, self.layout, nslots, table_offset, data_offset)
        buf.release()
        self._table: np.ndarray | None = table
        self._pages: torch.Tensor | None = pages

    def _live(self) -> tuple[np.ndarray, torch.Tensor]:
        if self._table is None or self._pages is None:
            raise KVClosedError(f"reader of {self.name} is closed")
        return self._table, self._pages

    def find(self, pages: Iterable[PageHash]) -> dict[PageHash, int]:
        """Slots of the wanted pages that are resident now (absent pages are left out)."""
        table, _ = self._live()
        snapshot = table.copy()
        valid = np.flatnonzero((snapshot["used"] == 1) & (snapshot["version"] % 2 == 0))
        by_digest = {snapshot["digest"][i].tobytes(): int(i) for i in valid}
        found: dict[PageHash, int] = {}
        for page in pages:
            slot = by_digest.get(bytes.fromhex(page))
            if slot is not None:
                found[page] = slot
        return found

    def _entry_matches(self, slot: int, page: PageHash) -> int | None:
        table, _ = self._live()
        version = int(table["version"][slot])
        if version % 2 or table["used"][slot] != 1 or table["digest"][slot].tobytes() != bytes.fromhex(page):
            return None
        return version

    def view(self, page: PageHash) -> HostPageView | None:
        slot = self.find([page]).get(page)
        if slot is None:
            return None
        version = self._entry_matches(slot, page)
        if version is None:
            return None
        _, pages = self._live()
        return HostPageView(page=page, slot=slot, version=version, tensor=pages[slot])

    def is_current(self, view: HostPageView) -> bool:
        """True while the owner has not touched the slot since the view was taken."""
        table, _ = self._live()
        return int(table["version"][view.slot]) == view.version

    def read(self, page: PageHash, out: torch.Tensor | None = None, attempts: int = 3) -> torch.Tensor | None:
        """Copy a page out, checked against concurrent rewrites; None when it is not resident."""
        for _ in range(attempts):
            view = self.view(page)
            if view is None:
                return None
            dst = out if out is not None else torch.empty_like(view.tensor)
            copy_page(dst, view.tensor)
            if self.is_current(view):
                return dst
        return None

    def close(self) -> None:
        self._table = None
        self._pages = None
        if self._mmap is not None:
            mm, self._mmap = self._mmap, None
            try:
                mm.close()
            except BufferError:
                log.warning("reader of %s closed while page views are still alive", self.name)
