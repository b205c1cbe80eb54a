"""Rank 0's journal of KV memory operations: what its follower ranks must mirror.

Rank 0 runs the ordinary engine over its shard (its pages hold its own KV heads). Whatever its
engine does to KV memory, a follower must do to its own heads' pages, at the same slots, before
the next forward reads them. The journal records it, in order, as `KVOp`s (`messages.py`); the
runner sends them with the next pass (`runner.py`). Two places feed it:

* the store's residency events (`KVStore.add_listener`: every write, promotion, demotion,
  eviction and drop, device <-> host <-> disk, in order, under the store's mutex): tier moves
  become `CopyPage`/`DropPage`, and a write becomes `WritePage` with the page's device slot and
  where its bytes came from, which the writer announced first (`expect`);
* `MirroredCache` (`cache.py`), the engine's page bookkeeping: tail page writes (`SetTail`), the
  copies of a tail a session or a handoff keeps (`SaveTail`, `ForgetTail` once the copy is
  freed), and the origin of each page it stores.

An origin is named by what the followers hold too (`origin_of`): a page of the last prefill's
fresh pages, a tail slot, a saved tail, or, for bytes from outside the role (a pulled handoff, a
prefix pulled from a peer), each follower's heads themselves (`Shards`). A write whose origin
nobody announced breaks the journal (`drain` raises): a follower cannot mirror it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence

import torch

from engine.compute.tp.group import TPError
from engine.compute.tp.messages import (
    CopyPage,
    DropPage,
    ForgetTail,
    Fresh,
    KVOp,
    PageOrigin,
    Saved,
    SaveTail,
    Shards,
    Tail,
    WritePage,
)
from engine.data.kv.keys import PageHash
from engine.data.kv.store import KVEvent, KVEventKind, KVStore
from engine.data.kv.tier import Tier


def page_bytes(page: torch.Tensor) -> bytes:
    """A page's raw bytes (any dtype, any device)."""
    return page.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


class KVJournal:
    """The operations rank 0's KV memory went through since the last `drain` (thread-safe)."""

    def __init__(self, store: KVStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._ops: list[KVOp] = []
        self._expected: dict[PageHash, PageOrigin] = {}
        self._saved: dict[int, int] = {}
        """Saved tails by data pointer -> id (an entry leaves when its tensor is freed)."""
        self._ids = itertools.count(1)
        self._broken: str | None = None
        self._page_numel = store.layout.page_numel
        self.tails: torch.Tensor | None = None
        """The engine's tail pages (set by `MirroredCache`)."""
        self.fresh: list[torch.Tensor] = []
        """The fresh pages of each chunk of the last prefill forward (set by the runner)."""
        self._from_disk: list[PageHash] = []
        """Pages promoted from the disk tier into the device tier since `take_from_disk`: the
        followers read their own disk copies of them, which rank 0 has not seen intact."""
        store.add_listener(self._on_event)

    def close(self) -> None:
        self._store.remove_listener(self._on_event)

    # -- recording ----------------------------------------------------------------------------------

    def record(self, op: KVOp) -> None:
        with self._lock:
            self._ops.append(op)

    def drain(self) -> list[KVOp]:
        """The operations since the last drain, in order (TPError when one cannot be mirrored)."""
        with self._lock:
            if self._broken is not None:
                raise TPError(f"rank 0's KV memory went where its followers cannot follow: {self._broken}")
            ops, self._ops = self._ops, []
            return ops

    def _on_event(self, event: KVEvent) -> None:
        """The store's listener (its mutex held): a residency change as a follower mirrors it."""
        page, tier = event.page, event.tier
        if event.kind is KVEventKind.STORED and tier is Tier.DEVICE:
            with self._lock:
                origin = self._expected.pop(page, None)
                if origin is None:
                    self._broken = f"page {page[:16]} was written from bytes no follower holds"
                    return
            self.record(WritePage(page, self._slot(page), origin))
        elif event.kind is KVEventKind.STORED:  # write-through: the device copy just written
            self.record(CopyPage(page, int(Tier.DEVICE), int(tier)))
        elif event.kind in (KVEventKind.PROMOTED, KVEventKind.DEMOTED):
            assert event.source is not None
            slot = self._slot(page) if tier is Tier.DEVICE else -1
            with self._lock:
                self._ops.append(CopyPage(page, int(event.source), int(tier), slot))
                if tier is Tier.DEVICE and event.source is Tier.DISK:
                    self._from_disk.append(page)
        else:  # evicted or dropped
            self.record(DropPage(page, int(tier)))

    def take_from_disk(self) -> list[PageHash]:
        """The pages promoted from the disk tier since the last call (in order), forgotten here."""
        with self._lock:
            pages, self._from_disk = self._from_disk, []
            return pages

    def _slot(self, page: PageHash) -> int:
        slot = self._store.device_slot(page)
        assert slot is not None, "a page the device tier just took"
        return slot

    # -- origins ------------------------------------------------------------------------------------

    def expect(self, pages: Sequence[PageHash], origins: Sequence[PageOrigin]) -> None:
        """The next write of each of `pages` into the device tier has the bytes of its origin."""
        with self._lock:
            self._expected.update(zip(pages, origins, strict=True))

    def settle(self, pages: Sequence[PageHash]) -> None:
        """Forget what `expect` said of `pages` (those already resident were never written)."""
        with self._lock:
            for page in pages:
                self._expected.pop(page, None)

    def origin_of(self, data: torch.Tensor) -> PageOrigin:
        """Where one page's bytes are, as a follower names its own copy of them."""
        storage = data.untyped_storage().data_ptr()
        for chunk, fresh in enumerate(self.fresh):
            if fresh.untyped_storage().data_ptr() == storage:
                return Fresh(chunk, (data.storage_offset() - fresh.storage_offset()) // self._page_numel)
        tails = self.tails
        if tails is not None and tails.untyped_storage().data_ptr() == storage:
            return Tail((data.storage_offset() - tails.storage_offset()) // self._page_numel)
        with self._lock:
            saved = self._saved.get(data.data_ptr())
        if saved is None:
            raise TPError("a KV page from a tensor the follower ranks do not hold")
        return Saved(saved)

    def save(self, copy: torch.Tensor, origin: PageOrigin) -> int:
        """`copy` (a tail page's) is kept by the engine: each follower keeps its own, from `origin`,
        until `copy` is freed. Returns its id."""
        id_ = next(self._ids)
        pointer = copy.data_ptr()
        with self._lock:
            self._saved[pointer] = id_
            self._ops.append(SaveTail(id_, origin))
        weakref.finalize(copy, self._forget, pointer, id_)
        return id_

    @staticmethod
    def shards_origin(others: Sequence[torch.Tensor]) -> Shards:
        """A page from outside the role, as the followers get it: each one's heads (rank order)."""
        return Shards([page_bytes(shard) for shard in others])

    def save_shards(self, mine: torch.Tensor, others: Sequence[torch.Tensor]) -> int:
        """`mine`, this rank's heads of a page from outside the role, is kept; each follower
        keeps its own heads (`others`, in rank order)."""
        return self.save(mine, self.shards_origin(others))

    def saved_id(self, copy: torch.Tensor) -> int:
        with self._lock:
            id_ = self._saved.get(copy.data_ptr())
        if id_ is None:
            raise TPError("a tail page copy the follower ranks do not keep")
        return id_

    def _forget(self, pointer: int, id_: int) -> None:
        with self._lock:
            if self._saved.get(pointer) == id_:
                del self._saved[pointer]
            self._ops.append(ForgetTail(id_))
