"""Disk tier: one segment file of page slots per layout, each page checksummed, restartable.

File `<dir>/kv-<layout fingerprint>.seg` (all little-endian):

* `[0, 4096)` file header: `struct "<8sIIQQQI"` = magic `OFKVDSK1`, format version,
  slot count, page bytes, slot-table offset, data offset, length of the layout JSON
  that follows, then a CRC32 of everything before it.
* slot table: one 64-byte record per slot, `struct "<4sHHQ32sQI"` = magic `OFKP`,
  record version, checksum kind (`Checksum`), write sequence number, page key (32 raw
  digest bytes), page bytes, checksum of the page bytes, then a CRC32 of the 60 bytes
  before it.
* page data, 4 KiB aligned: slot *i* holds one page.

A page is written payload first, record second, so a write torn anywhere leaves
either the old record (whose checksum no longer matches the new payload) or a record
whose own CRC fails: both read as a miss, never as data. The index is the slot table
itself: reopening the directory scans it (one read) and keeps every record whose CRC
holds, ordered by write sequence so LRU order survives the restart. Evicting a page
clears its record. Writes are not fsynced unless asked for: a cache only has to be
right, not durable, and the checksums make it right.

Checksums (`Checksum`, chosen per tier, recorded per page so either kind reads back):

* `BLOCKSUM64` (default): the page is cut into 4 KiB blocks, each block summed as
  little-endian u64 words (mod 2**64, a short tail zero-padded), and the CRC32 of that
  vector of sums plus the length is the checksum. It runs at memory speed (about 4x
  zlib's CRC32 here), which keeps the tier near raw write speed, and catches torn and
  zeroed blocks, stale or misplaced blocks and any single bit flip; it can miss a
  change that preserves one block's word sum (two opposite flips of the same bit).
* `CRC32`: zlib's CRC32 of the whole page, the stronger and slower choice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np
import torch

from engine.data.kv.errors import DiskTierBusy, KVCapacityError, KVClosedError, KVConfigError
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.tier import SlotTable, Tier

MAGIC = b"OFKVDSK1"
FORMAT_VERSION = 1
_FILE_HEADER = struct.Struct("<8sIIQQQI")
_FILE_HEADER_BYTES = 4096
_RECORD = struct.Struct("<4sHHQ32sQI")  # followed by the record's own CRC32 (u32)
_RECORD_MAGIC = b"OFKP"
RECORD_BYTES = 64
_ALIGN = 4096
_BLOCK = 4096

assert _RECORD.size + 4 == RECORD_BYTES


class Checksum(IntEnum):
    """How a page's bytes are checked; the value is stored in each record's flags field."""

    CRC32 = 0
    BLOCKSUM64 = 1


def page_checksum(kind: Checksum, data: memoryview) -> int:
    """The 32-bit checksum of a page's bytes (see the module docstring for the two kinds)."""
    if kind is Checksum.CRC32:
        return zlib.crc32(data)
    raw = np.frombuffer(data, dtype=np.uint8)
    full = len(raw) // _BLOCK * _BLOCK
    sums = raw[:full].view("<u8").reshape(-1, _BLOCK // 8).sum(axis=1, dtype=np.uint64)
    tail = raw[full:]
    if len(tail):
        padded = np.zeros((len(tail) + 7) // 8 * 8, dtype=np.uint8)
        padded[: len(tail)] = tail
        sums = np.append(sums, padded.view("<u8").sum(dtype=np.uint64))
    return zlib.crc32(len(raw).to_bytes(8, "little") + sums.astype("<u8").tobytes())


def _align(value: int) -> int:
    return (value + _ALIGN - 1) // _ALIGN * _ALIGN


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


def _pread_into(fd: int, dst: memoryview, offset: int) -> int:
    total = 0
    while total < len(dst):
        got = os.preadv(fd, [dst[total:]], offset + total)
        if got == 0:
            break
        total += got
    return total


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


@dataclass(slots=True)
class _Slot:
    index: int
    seq: int
    checksum: int
    kind: Checksum


class DiskTier(SlotTable):
    """Owner of one segment file. Not thread-safe: the store serializes calls.

    `write` and `read_into` take CPU tensors (the store stages GPU pages through host
    memory). A page whose bytes fail their checksum is reported as missing by
    `read_into` and removed, so it is never returned.
    """

    tier = Tier.DISK

    @staticmethod
    def file(directory: str | Path, layout: KVLayout) -> Path:
        """The tier's file for `layout` in `directory`."""
        return Path(directory) / f"kv-{layout.fingerprint()}.seg"

    @staticmethod
    def held(directory: str | Path, layout: KVLayout) -> bool:
        """Whether a live process holds the tier's file in `directory` (a probe: the answer
        may change right after)."""
        try:
            fd = os.open(DiskTier.file(directory, layout), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def __init__(
        self,
        layout: KVLayout,
        capacity_pages: int,
        directory: str | Path,
        fsync: bool = False,
        checksum: Checksum = Checksum.BLOCKSUM64,
    ):
        self.layout = layout
        self.capacity_pages = capacity_pages
        self.fsync = fsync
        self.checksum = checksum
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.file(self.directory, layout)
        self._table_offset = _FILE_HEADER_BYTES
        self._data_offset = _align(self._table_offset + capacity_pages * RECORD_BYTES)
        self._size = self._data_offset + capacity_pages * layout.page_nbytes
        self._slots: dict[PageHash, _Slot] = {}
        self._free: list[int] = []
        self._seq = 0
        self.recovered_pages = 0
        self.discarded_records = 0
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._fd)
            self._fd = None
            raise DiskTierBusy(f"disk tier file {self.path} is in use by another process") from exc
        with contextlib.ExitStack() as undo:
            undo.callback(self.close)  # a tier that cannot create or recover its file releases it
            if os.fstat(self._fd).st_size == 0:
                self._create()
            else:
                self._open_existing()
            undo.pop_all()

    # -- file header and recovery -------------------------------------------------

    def _file_header(self) -> bytes:
        layout_json = json.dumps(self.layout.to_dict(), sort_keys=True).encode()
        head = _FILE_HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            self.capacity_pages,
            self.layout.page_nbytes,
            self._table_offset,
            self._data_offset,
            len(layout_json),
        )
        body = head + layout_json
        return body + struct.pack("<I", zlib.crc32(body))

    def _create(self) -> None:
        fd = self._live_fd()
        os.ftruncate(fd, self._size)
        _pwrite_all(fd, memoryview(self._file_header()), 0)
        self._free = list(range(self.capacity_pages - 1, -1, -1))

    def _open_existing(self) -> None:
        fd = self._live_fd()
        expected = self._file_header()
        found = os.pread(fd, len(expected), 0)
        if found != expected:
            raise KVConfigError(
                f"disk tier file {self.path} was made for another layout or capacity "
                f"(this store: {self.layout.fingerprint()}, {self.capacity_pages} pages); "
                "use the same settings or remove the file"
            )
        if os.fstat(fd).st_size < self._size:
            os.ftruncate(fd, self._size)
        table = os.pread(fd, self.capacity_pages * RECORD_BYTES, self._table_offset)
        best: dict[PageHash, _Slot] = {}
        used: set[int] = set()
        for index in range(self.capacity_pages):
            record = table[index * RECORD_BYTES : (index + 1) * RECORD_BYTES]
            if record[:4] != _RECORD_MAGIC:
                continue
            _magic, version, flags, seq, digest, nbytes, checksum = _RECORD.unpack_from(record)
            (record_crc,) = struct.unpack_from("<I", record, _RECORD.size)
            if (
                version != 1
                or flags not in tuple(Checksum)
                or nbytes != self.layout.page_nbytes
                or zlib.crc32(record[: _RECORD.size]) != record_crc
            ):
                self.discarded_records += 1
                continue
            page = PageHash(digest.hex())
            previous = best.get(page)
            if previous is not None and previous.seq >= seq:
                self.discarded_records += 1
                continue
            if previous is not None:
                used.discard(previous.index)
                self.discarded_records += 1
            best[page] = _Slot(index=index, seq=seq, checksum=checksum, kind=Checksum(flags))
            used.add(index)
        for page, slot in sorted(best.items(), key=lambda item: item[1].seq):
            self._slots[page] = slot
        self._seq = max((slot.seq for slot in best.values()), default=0)
        self._free = [i for i in range(self.capacity_pages - 1, -1, -1) if i not in used]
        self.recovered_pages = len(self._slots)

    # -- tier interface -------------------------------------------------------------

    def _live_fd(self) -> int:
        if self._fd is None:
            raise KVClosedError(f"disk tier {self.path} is closed")
        return self._fd


    def _payload_offset(self, index: int) -> int:
        return self._data_offset + index * self.layout.page_nbytes

    def _record_offset(self, index: int) -> int:
        return self._table_offset + index * RECORD_BYTES

    def write(self, page: PageHash, src: torch.Tensor) -> int:
        fd = self._live_fd()
        if not self._free:
            raise KVCapacityError(self.tier.label, self.capacity_pages, 0)
        if src.device.type != "cpu":
            src = src.cpu()
        data = _byte_view(src.contiguous())
        if len(data) != self.layout.page_nbytes:
            raise KVConfigError(
                f"page of {len(data)} bytes given to a disk tier of {self.layout.page_nbytes}"
            )
        index = self._free.pop()
        written = False
        try:
            checksum = page_checksum(self.checksum, data)
            _pwrite_all(fd, data, self._payload_offset(index))
            self._seq += 1
            head = _RECORD.pack(
                _RECORD_MAGIC,
                1,
                int(self.checksum),
                self._seq,
                bytes.fromhex(page),
                self.layout.page_nbytes,
                checksum,
            )
            _pwrite_all(
                fd, memoryview(head + struct.pack("<I", zlib.crc32(head))), self._record_offset(index)
            )
            if self.fsync:
                os.fdatasync(fd)
            written = True
        finally:
            if not written:  # the slot goes back to the free list
                self._free.append(index)
        self._slots[page] = _Slot(index=index, seq=self._seq, checksum=checksum, kind=self.checksum)
        return index

    def read_into(self, page: PageHash, dst: torch.Tensor) -> bool:
        """Read a page into `dst` (contiguous CPU tensor of one page). False if it fails its checksum.

        A failing page is removed from the tier before returning; `dst` then holds
        garbage and must not be used.
        """
        fd = self._live_fd()
        slot = self._slots[page]
        view = _byte_view(dst)
        got = _pread_into(fd, view, self._payload_offset(slot.index))
        if got != len(view) or page_checksum(slot.kind, view) != slot.checksum:
            self.remove(page)
            return False
        return True

    def remove(self, page: PageHash) -> None:
        slot = self._slots.pop(page)
        _pwrite_all(self._live_fd(), memoryview(bytes(RECORD_BYTES)), self._record_offset(slot.index))
        self._free.append(slot.index)

    def payload_offset(self, page: PageHash) -> int:
        """Where the page's bytes start in `path` (for tests that damage a page on purpose)."""
        return self._payload_offset(self._slots[page].index)

    def record_offset(self, page: PageHash) -> int:
        return self._record_offset(self._slots[page].index)

    def sync(self) -> None:
        os.fsync(self._live_fd())

    def close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        self._slots.clear()
        self._free.clear()
