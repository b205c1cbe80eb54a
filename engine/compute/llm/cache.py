"""The runner's side of the paged KV cache: which pages each sequence holds, and its tail page.

`PagedKVCache` ties three things together for the engine:

* the process's `KVStore` (full pages, named by the hash chain; locked while in use so
  they stay in the device tier at a fixed slot),
* a small pool of *tail pages* owned by the runner, one per running sequence, holding
  the K/V of its last, partial page (store pages are immutable and keyed by their
  tokens, which a partial page does not have yet),
* the prefix tree (`engine.compute.prefix.RadixCache`) mapping cache keys to pages.

A page that fills is hashed (`page_hashes`, continuing the sequence's chain), put into
the store, locked and inserted into the tree, so requests admitted later reuse it even
while its sequence still runs.

A prompt whose next pages no tier holds asks its peers (`PageSource`s, e.g. the workers the
distributed KV index names) for them off the engine thread: the sequence waits in a pulling
state (`Sequence.pull`, vLLM's waiting-for-remote-KV) while the batch runs on, and takes the
pages at the first step after they arrived (or computes them, if no peer had them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from engine.compute.llm.errors import HandoffError
from engine.compute.llm.sequence import Sequence
from engine.compute.llm.transfer import KVHandoff
from engine.compute.prefix.radix import RadixCache, RadixNode
from engine.data.kv.errors import KVPageNotFound, KVTransferError
from engine.data.kv.keys import PageHash, page_hashes
from engine.data.kv.layout import KVLayout
from engine.data.kv.source import PageSource
from engine.data.kv.store import KVStore


@dataclass(frozen=True, slots=True)
class PulledRun:
    """What a pull from peers found (on the pull thread): the store holds the first `pages` of
    the asked run, `before` of which it held already. With `landing`, those it lacks are not in
    it yet: the engine thread puts them in from `landing` first (a tensor-parallel rank 0's
    pages, which its follower ranks must mirror in step with its engine)."""

    pages: int = 0
    before: int = 0
    landing: PageSource | None = None


@dataclass(frozen=True, slots=True)
class PendingPull:
    """Pages of a prompt being pulled from peers for a sequence, and what `future` found."""

    pages: tuple[PageHash, ...]
    future: Future[PulledRun]


class PullThread:
    """The one thread a cache pulls peers' pages on (started with the first pull), and the pulls in
    flight, by id of the sequence waiting for each."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pulls: dict[int, Future[PulledRun]] = {}

    def submit(self, seq: Sequence, pull: Callable[[], PulledRun]) -> Future[PulledRun]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-pull")
        future = self._pulls[id(seq)] = self._pool.submit(pull)
        return future

    def forget(self, seq: Sequence) -> None:
        self._pulls.pop(id(seq), None)

    @property
    def busy(self) -> bool:
        return bool(self._pulls)

    def wait(self, timeout_s: float) -> None:
        """Block until a pull in flight ends, or `timeout_s`."""
        if self._pulls:
            wait(list(self._pulls.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class PagedKVCache:
    """Page bookkeeping of one engine over a (possibly shared) `KVStore`."""

    def __init__(
        self,
        store: KVStore,
        layout: KVLayout,
        max_running: int,
        prefix_cache: bool = True,
        peers: Seq[PageSource] = (),
        pull_timeout_s: float = 10.0,
    ) -> None:
        self.store = store
        self.layout = layout
        self.page_size = layout.page_size
        self.tails = torch.zeros((max_running, *layout.page_shape), dtype=layout.torch_dtype, device=store.device)
        self._free_tails = list(range(max_running - 1, -1, -1))
        self.tree = RadixCache(layout.page_size) if prefix_cache else None
        self._listener = self.tree.store_listener() if self.tree is not None else None
        if self._listener is not None:
            store.add_listener(self._listener)
        self.peers = list(peers)
        self.pull_timeout_s = pull_timeout_s
        self.pulled_pages = 0
        self._pulls = PullThread()
        self._unindexed = store.config.disk is not None
        """The store may hold pages the tree does not know: those its disk tier recovered."""

    @property
    def free_tail_slots(self) -> int:
        return len(self._free_tails)

    def close(self) -> None:
        self._pulls.close()
        if self._listener is not None:
            self.store.remove_listener(self._listener)
            self._listener = None

    # -- admission ------------------------------------------------------------------------

    def attach(self, seq: Sequence) -> None:
        """Give an admitted `seq` its tail page."""
        seq.tail_slot = self._free_tails.pop()

    def match_prefix(self, seq: Sequence) -> bool:
        """Lock the longest cached prefix of `seq`'s key (promoting pages from lower tiers) and
        set `num_computed` to it; True when done. False when its next pages are being pulled
        from peers: ask again at a later step (`pulling` says whether any pull is in flight).

        At least the last token is left to compute: its logits give the next token. Done
        just before the sequence's first prefill, so it sees pages that sequences ahead
        of it in the same step have just computed.
        """
        if seq.pull is not None:
            if not seq.pull.future.done():
                return False
            self._take_pulled(seq)
        else:
            limit = (len(seq.token_ids) - 1) // self.page_size
            if self.tree is not None and limit:
                self._match(seq, limit)
                chain: list[PageHash] = []
                if len(seq.pages) < limit and (self._unindexed or self.peers):
                    # The prompt's page keys, hashed once for both searches beyond the tree.
                    chain = page_hashes(seq.key_ids[: limit * self.page_size], self.page_size,
                                        extra_keys=seq.extra_keys)
                if len(seq.pages) < limit and self._unindexed:
                    self._resident(seq, chain)
                if len(seq.pages) < limit:
                    self.store.record_miss()  # the search for the next page of the prompt found nothing
                    if self.peers:
                        self._start_pull(seq, tuple(chain[len(seq.pages):]))
                        return False
        seq.num_computed = len(seq.pages) * self.page_size
        seq.matched = True
        return True

    @property
    def pulling(self) -> bool:
        return self._pulls.busy

    def wait_pulls(self, timeout_s: float) -> None:
        """Block until a pull in flight ends, or `timeout_s` (an engine with nothing else to do)."""
        self._pulls.wait(timeout_s)

    def _match(self, seq: Sequence, limit: int) -> None:
        assert self.tree is not None
        while True:
            match = self.tree.match(seq.key_ids, seq.namespace, max_pages=limit)
            try:
                slots = self.store.lock(match.pages, lookup=True) if match.pages else []
            except KVPageNotFound as exc:
                # A page the tree knew is in no tier any more (e.g. found corrupt): forget it, retry.
                self.tree.forget(exc.args[0])
                continue
            break
        self.tree.lock(match.node)
        seq.node = match.node
        seq.pages = list(match.pages)
        seq.slots = slots

    def _resident(self, seq: Sequence, chain: Seq[PageHash]) -> None:
        """Take the next pages of the prompt (`chain`: its page keys) that a tier holds though
        the tree does not know them: pages the disk tier recovered when the engine started."""
        missing = chain[len(seq.pages) :]
        run = self.store.resident_run(missing)
        if run:
            self._take(seq, missing[:run], lookup=True)

    def _start_pull(self, seq: Sequence, missing: tuple[PageHash, ...]) -> None:
        seq.pull = PendingPull(missing, self._pulls.submit(seq, functools.partial(self._pull, missing)))

    def _pull(self, missing: Seq[PageHash]) -> PulledRun:
        """On the pull thread: ask each peer in turn for `missing` until one has some."""
        for peer in self.peers:
            before = self.store.resident_run(missing)
            try:
                got = peer.pull(self.store, missing, self.pull_timeout_s)
            except KVTransferError:
                continue  # the source counted the failure; recomputing is always possible
            if got:
                return PulledRun(got, before)
        return PulledRun()

    def _take_pulled(self, seq: Sequence) -> None:
        assert seq.pull is not None
        pull, seq.pull = seq.pull, None
        self._pulls.forget(seq)
        pulled = pull.future.result()
        run = pull.pages[: pulled.pages]
        got = len(run)
        if pulled.landing is not None and run:
            got = pulled.landing.pull(self.store, run, self.pull_timeout_s)
        if got:
            self.pulled_pages += max(0, got - pulled.before)
            self._take(seq, run[:got])

    def _adopt(self, seq: Sequence, pages: Seq[PageHash], data: Seq[torch.Tensor]) -> None:
        """Store `pages` as the next full pages of `seq`, lock them and record them in the tree."""
        if not pages:
            return
        try:
            for page, tensor in zip(pages, data, strict=True):
                # Lock each page as it lands: putting the next one may evict unlocked pages.
                self.store.put(page, tensor)
                seq.slots.extend(self.store.lock([page]))
                seq.pages.append(page)
        finally:
            self._insert(seq)

    def _take(self, seq: Sequence, pages: Seq[PageHash], *, lookup: bool = False) -> int:
        """Lock `pages` (in the store, just brought by a source or found there) as the next full
        pages of `seq` and record them in the tree (`lookup`: counted as hits in the tier
        metrics). Stops at a page that is gone again (evicted to make room for a later one of
        the same pull); returns how many were taken."""
        taken = 0
        try:
            for page in pages:
                try:
                    seq.slots.extend(self.store.lock([page], lookup=lookup))
                except KVPageNotFound:
                    break
                seq.pages.append(page)
                taken += 1
        finally:
            self._insert(seq)
        return taken

    def _insert(self, seq: Sequence) -> None:
        if self.tree is None:
            return
        node = self.tree.insert(seq.key_ids, seq.pages, seq.namespace)
        if node is not seq.node:
            self.tree.lock(node)
            if seq.node is not None:
                self.tree.unlock(seq.node)
            seq.node = node

    def import_handoff(self, seq: Sequence, handoff: KVHandoff, source: PageSource | None) -> None:
        """Admit a prefilled prompt: bring the pages this store lacks from `source`, lock them all,
        restore the tail. Afterwards the whole prompt is computed (release `seq` on failure).

        The caller may have brought the pages in already (the `llm` unit pulls them off the
        engine thread); then `source` is only asked again for pages evicted meanwhile."""
        try:
            pages = list(handoff.page_hashes)
            have = self.store.resident_run(pages)
            if have < len(pages):
                if source is None:
                    raise HandoffError(f"handoff {handoff.handoff_id}: {len(pages) - have} pages missing and no source")
                try:
                    got = source.pull(self.store, pages, self.pull_timeout_s)
                except KVTransferError as exc:
                    raise HandoffError(f"handoff {handoff.handoff_id}: pulling pages failed: {exc}") from exc
                self.pulled_pages += max(0, got - have)
                have = got
                if have < len(pages):
                    raise HandoffError(
                        f"handoff {handoff.handoff_id}: the source holds only {have} of {len(pages)} pages"
                    )
            if self._take(seq, pages) < len(pages):
                raise HandoffError(f"handoff {handoff.handoff_id}: pages were evicted before they could be locked")
            if handoff.tail_len:
                assert handoff.tail is not None and seq.tail_slot is not None
                self._write_tail(seq.tail_slot, handoff.tail)
        finally:
            seq.matched = True
        seq.num_computed = len(pages) * self.page_size + handoff.tail_len

    # -- growth ---------------------------------------------------------------------------

    def tail_len(self, seq: Sequence) -> int:
        return seq.num_computed - len(seq.pages) * self.page_size

    def tail(self, seq: Sequence) -> torch.Tensor | None:
        return self.tails[seq.tail_slot] if seq.tail_slot is not None and self.tail_len(seq) else None

    def _commit(self, seq: Sequence, data: Seq[torch.Tensor] | torch.Tensor, count: int) -> None:
        start = len(seq.pages) * self.page_size
        key = seq.key_ids[start : start + count * self.page_size]
        if seq.pages:
            new = page_hashes(key, self.page_size, prior=seq.pages[-1])
        else:
            new = page_hashes(key, self.page_size, extra_keys=seq.extra_keys)
        self._adopt(seq, new, data)

    def commit_prefill(self, seq: Sequence, fresh: torch.Tensor, tokens: int) -> None:
        """After a prefill chunk of `tokens` tokens: store the pages it filled, keep the rest as tail."""
        assert seq.tail_slot is not None
        filled = self.tail_len(seq) + tokens
        full = filled // self.page_size
        if full:
            self._commit(seq, fresh[:full], full)
        if filled % self.page_size:
            self._write_tail(seq.tail_slot, fresh[full])
        seq.num_computed += tokens

    def commit_decoded(self, seq: Sequence) -> None:
        """After a decode step wrote one token into the tail page: store the tail if it is full."""
        assert seq.tail_slot is not None
        seq.num_computed += 1
        if self.tail_len(seq) == self.page_size:
            self._commit(seq, self.tails[seq.tail_slot][None], 1)

    def restore_tail(self, seq: Sequence, tail: torch.Tensor, tokens: int) -> None:
        assert seq.tail_slot is not None and 0 < tokens < self.page_size
        self._write_tail(seq.tail_slot, tail)
        seq.num_computed = len(seq.pages) * self.page_size + tokens

    def _write_tail(self, slot: int, data: torch.Tensor) -> None:
        """Every write into a tail page but the decode forward's own (a tensor-parallel rank 0's
        cache tells its followers here)."""
        self.tails[slot].copy_(data)

    def copy_tail(self, seq: Sequence) -> torch.Tensor | None:
        tail = self.tail(seq)
        return tail.clone() if tail is not None else None

    # -- release ----------------------------------------------------------------------------

    def pin(self, pages: Seq[PageHash], node: RadixNode | None) -> None:
        """Another hold on pages a running sequence holds (a session or a handoff keeps them)."""
        if pages:
            self.store.lock(pages)
        if node is not None and self.tree is not None:
            self.tree.lock(node)

    def unpin(self, pages: Seq[PageHash], node: RadixNode | None) -> None:
        if pages:
            self.store.unlock(pages)
        if node is not None and self.tree is not None:
            self.tree.unlock(node)

    def release(self, seq: Sequence) -> None:
        """Drop every hold of `seq`: page locks, tree lock, tail page. Without a prefix cache its
        pages are freed too (nobody will look them up)."""
        pages = self.unmatch(seq)
        if self.tree is None:
            for page in pages:
                if not self.store.lock_count(page):
                    self.store.remove(page)
        if seq.tail_slot is not None:
            self._free_tails.append(seq.tail_slot)
            seq.tail_slot = None

    def unmatch(self, seq: Sequence) -> list[PageHash]:
        """Undo `seq`'s match: drop its pull, page locks and tree lock (it keeps its tail slot, and
        matches again when it is next scheduled); the pages it held."""
        if seq.pull is not None:  # what it pulls stays in the store, for whoever asks next
            self._pulls.forget(seq)
            seq.pull = None
        pages, seq.pages, seq.slots = seq.pages, [], []
        if pages:
            self.store.unlock(pages)
        if seq.node is not None and self.tree is not None:
            self.tree.unlock(seq.node)
        seq.node = None
        seq.num_computed = 0
        seq.matched = False
        return pages
