"""Rank 0's page bookkeeping: `MirroredCache`, the engine's `PagedKVCache` over its heads' pages.

What the cache writes into pages and tail pages goes to the journal (`journal.py`), so the
follower ranks mirror it on their own heads. Pages from outside the role land through a
`ShardSource`: pages pulled whole already and split by head (`kv.split_page`), of which rank
0's store takes its own heads while the journal gives each follower its heads as the page's
origin (`Shards`). Two paths bring such pages:

* a decode's handoff (`handoff.py`), pulled whole from the prefill worker;
* prefix matching: a prompt whose next pages no tier holds asks the cache's `peers` (e.g. the
  worker the distributed KV index names) for them, as on any `llm` role, off the engine thread
  (`PagedKVCache._pull`); here they come whole, in the whole model's layout
  (`kv.pull_whole_from`), are split on the pull thread, and land on the engine thread at the
  sequence's next match (`PulledRun.landing`), so every rank's copy enters KV memory with the
  next pass. A holder that is dead, silent or lacks the pages costs at most the pull's timeout,
  then the prompt is computed as if no peer had them. Unlike on a TP-1 engine, whose pulls land
  in its store on the pull thread, the pages of a sequence that ends before its pull lands
  (aborted) are dropped with it.

Every rank's disk tier is a file of its own, so a page rank 0 promotes from its disk intact may
be corrupt on a follower's. After prefix matching (or a handoff's admission) promoted pages from
the disk tier, `MirroredCache` asks every rank which of them its disk found corrupt
(`BroadcastForward.check`, one collective, only when something came from the disk); a page
corrupt anywhere is dropped from every tier of every rank, and the match is made again without
it: a miss from that page on, computed again, never a failed group. `corrupt_pages` counts them
(`tp.corrupt_pages` in the unit's metrics).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from engine.compute.llm.cache import PagedKVCache, PulledRun
from engine.compute.llm.errors import HandoffError
from engine.compute.llm.sequence import Sequence as Seq
from engine.compute.llm.transfer import KVHandoff
from engine.compute.tp.journal import KVJournal
from engine.compute.tp.kv import pull_whole_from, split_page
from engine.compute.tp.messages import SetTail, Tail
from engine.data.kv.errors import KVTransferError
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.source import PageSource
from engine.data.kv.store import KVStore

log = logging.getLogger(__name__)


class ShardSource:
    """A `PageSource` of pages pulled whole already: it stores rank 0's heads of each (the
    followers get theirs in the next pass). Used on the engine thread."""

    def __init__(self, journal: KVJournal, pages: dict[PageHash, list[torch.Tensor]]) -> None:
        self._journal = journal
        self._pages = pages
        """Each page's heads, by rank."""

    def pull(self, store: KVStore, pages: Sequence[PageHash], timeout_s: float) -> int:
        del timeout_s  # the bytes are here
        have = store.resident_run(pages)
        for page in pages[have:]:
            shards = self._pages.get(page)
            if shards is None:
                break
            self._journal.expect([page], [self._journal.shards_origin(shards[1:])])
            try:
                store.put(page, shards[0])
            finally:
                self._journal.settle([page])
            have += 1
        return have


class MirroredCache(PagedKVCache):
    """Rank 0's `PagedKVCache` (see the module docstring). `peers` serve whole pages, in `whole`'s
    layout; `tp_size` is the group's size (how the pages split by head)."""

    def __init__(self, journal: KVJournal, store: KVStore, layout: KVLayout, max_running: int,
                 prefix_cache: bool = True, peers: Sequence[PageSource] = (), *, whole: KVLayout,
                 tp_size: int) -> None:
        super().__init__(store, layout, max_running, prefix_cache, peers)
        self.journal = journal
        self.whole = whole
        self.tp_size = tp_size
        journal.tails = self.tails
        self.check_pages: Callable[[Sequence[PageHash]], list[PageHash]] | None = None
        """Which of some pages just promoted from the disk tier a rank found corrupt
        (`BroadcastForward.check`; set once the engine has its runner)."""
        self.corrupt_pages = 0
        """Pages a follower's disk tier found corrupt, dropped from every rank (read by the heartbeat)."""

    # -- pages promoted from the disk tier: intact on every rank, or dropped ------------------------

    def match_prefix(self, seq: Seq) -> bool:
        while True:
            done = super().match_prefix(seq)
            if not self._drop_corrupt(seq):
                return done

    def import_handoff(self, seq: Seq, handoff: KVHandoff, source: PageSource | None) -> None:
        corrupt = False
        try:
            super().import_handoff(seq, handoff, source)
        finally:  # also when the import failed: no page corrupt on a rank may stay where a match finds it
            corrupt = self._drop_corrupt(seq)
        if corrupt:
            raise HandoffError(f"handoff {handoff.handoff_id}: KV pages held on the disk tier here are corrupt on"
                               " a follower rank (dropped)")

    def _drop_corrupt(self, seq: Seq) -> bool:
        """Check the pages promoted from the disk tier since the last check; when some are corrupt
        on a rank: let go of what `seq` holds (it matches again) and drop them everywhere. Whether
        it did."""
        promoted = self.journal.take_from_disk()
        if not promoted or self.check_pages is None:
            return False
        corrupt = self.check_pages(promoted)
        if not corrupt:
            return False
        log.warning("%d KV pages promoted from the disk tier are corrupt on a follower rank (first %s):"
                    " dropped on every rank, computed again", len(corrupt), corrupt[0][:16])
        self.corrupt_pages += len(corrupt)
        self.unmatch(seq)
        for page in corrupt:
            # Promoted for `seq` just now, on this thread: no other sequence holds it.
            self.store.remove(page)
        return True

    def _pull(self, missing: Sequence[PageHash]) -> PulledRun:
        """On the pull thread: the next pages of a prompt, whole from the first peer that has
        some, split by head; they land on the engine thread (`ShardSource`)."""
        before = self.store.resident_run(missing)
        rest = missing[before:]
        for peer in self.peers:
            try:
                pages = pull_whole_from(peer, rest, self.whole, self.pull_timeout_s, account=self.store)
            except KVTransferError:
                continue  # counted in the store's pull failures; recomputing is always possible
            if pages:
                heads = self.whole.num_kv_heads
                split = {page: split_page(data, heads, self.tp_size)
                         for page, data in zip(rest[: len(pages)], pages, strict=True)}
                return PulledRun(before + len(pages), before, ShardSource(self.journal, split))
        return PulledRun(before, before)

    def _adopt(self, seq: Seq, pages: Sequence[PageHash], data: Sequence[torch.Tensor] | torch.Tensor) -> None:
        journal = self.journal
        journal.expect(pages, [journal.origin_of(page) for page in data])
        try:
            super()._adopt(seq, pages, data)
        finally:
            journal.settle(pages)

    def _write_tail(self, slot: int, data: torch.Tensor) -> None:
        origin = self.journal.origin_of(data)
        super()._write_tail(slot, data)
        self.journal.record(SetTail(slot, origin))

    def copy_tail(self, seq: Seq) -> torch.Tensor | None:
        copy = super().copy_tail(seq)
        if copy is not None:
            assert seq.tail_slot is not None
            self.journal.save(copy, Tail(seq.tail_slot))
        return copy
