"""Rank 0's model runner: each paged forward is broadcast to the follower ranks, then run here.

`BroadcastForward` is the `PagedForward` of rank 0's engine (`LLMEngine(make_forward=...)`).
Before each forward it sends every follower one `TPPass`: the KV memory operations the engine
did since the last pass (`journal.py`), then the forward's inputs (token ids, positions, page
and tail slots, and a prefill chunk's multimodal embedding rows, `embeds.py`). Then it runs its
own shard of the forward;
the all-reduces of the row-parallel layers (`shard.py`) pair it with the followers' forwards.
Its other collectives: `gather` brings every rank's heads of some pages to rank 0 (a prefill
handoff served whole to another role, or pages the group serves to other workers); `check` asks
every rank which of the pages just promoted from the disk tier its own disk found corrupt (each
rank's disk tier is its own file: rank 0's checksums say nothing of a follower's copy).

The runner runs on the engine's thread, like the forward it replaces: the passes go out in the
order the engine makes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from engine.compute.llm.forward import DecodeBatch, DecodeBuffer, PagedForward, PrefillChunk, PrefillOutput
from engine.compute.tp.embeds import embed_rows
from engine.compute.tp.group import TPError, TPGroup
from engine.compute.tp.journal import KVJournal
from engine.compute.tp.kv import merge_pages
from engine.compute.tp.messages import (
    CheckPages,
    ChunkInputs,
    DecodeInputs,
    GatherRequest,
    PrefillInputs,
    TPPass,
)
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.store import KVStore


class BroadcastForward(PagedForward):
    """`PagedForward` of rank 0 that sends each forward's pass to the followers first."""

    def __init__(self, model: PreTrainedModel, layout: KVLayout, *, packed: bool = True,
                 packed_float32: bool = True, journal: KVJournal, send: Callable[[TPPass], None],
                 group: TPGroup) -> None:
        super().__init__(model, layout, packed=packed, packed_float32=packed_float32)
        self.journal = journal
        self._send = send
        self.tp_group = group

    def _pass(self, forward: PrefillInputs | DecodeInputs | GatherRequest | CheckPages | None) -> None:
        self._send(TPPass(self.journal.drain(), forward))

    def check(self, pages: Sequence[PageHash]) -> list[PageHash]:
        """Of `pages`, promoted from the disk tier since the last pass, those some follower's disk
        tier found corrupt (it holds garbage in their slots: drop them before a forward reads them)."""
        self._pass(CheckPages(list(pages)))
        flags = self.tp_group.all_reduce_(torch.zeros(len(pages), dtype=torch.int32, device=self.tp_group.device))
        return [page for page, bad in zip(pages, flags.tolist(), strict=True) if bad]

    def _checked(self) -> None:
        """Before a forward: pages promoted from the disk tier outside prefix matching (which checks
        its own, `MirroredCache`) must be intact on every rank, else the forward would read garbage."""
        pages = self.journal.take_from_disk()
        if pages and (bad := self.check(pages)):
            raise TPError(f"{len(bad)} KV pages promoted from the disk tier are corrupt on a follower rank"
                          f" (first {bad[0][:16]}), found only as a forward was to read them")

    def prefill_batch(self, chunks: Sequence[PrefillChunk], pool: torch.Tensor, want_logits: Sequence[bool],
                      decode_key: str | None = None) -> PrefillOutput:
        inputs = [ChunkInputs(list(c.token_ids), c.start, list(c.prefix_slots), c.tail_slot,
                              embed_rows(c.embeds, self.dtype)) for c in chunks]
        if any(c.tail is not None and c.tail_slot is None for c in chunks):
            raise TPError("a prefill chunk over a tail page that names no tail slot")
        self._checked()
        self._pass(PrefillInputs(inputs, list(want_logits), decode_key))
        output = super().prefill_batch(chunks, pool, want_logits, decode_key)
        self.journal.fresh = [fresh for _, fresh in output.results]
        return output

    def decode(self, batch: DecodeBatch, pool: torch.Tensor, tails: torch.Tensor,
               previous: DecodeBuffer | None = None) -> tuple[torch.Tensor, DecodeBuffer]:
        self._checked()
        self._pass(DecodeInputs(list(batch.token_ids), list(batch.positions), [list(s) for s in batch.page_slots],
                                list(batch.tail_slots), list(batch.keys)))
        return super().decode(batch, pool, tails, previous)

    def flush(self) -> None:
        """Send the operations not sent yet, without a forward (before the followers stop)."""
        self._pass(None)

    def gather_checked(self, pages: Sequence[PageHash], mine: Sequence[torch.Tensor],
                       num_kv_heads: int) -> tuple[torch.Tensor, list[PageHash]]:
        """Every rank's heads of `pages` (`mine`: rank 0's, read already, so that a page rank 0
        cannot read never starts a collective), merged into whole pages, and those of `pages` a
        follower's disk tier found corrupt (their heads are zeros there: not to be served)."""
        self._pass(GatherRequest(list(pages), None, check=True))
        group = self.tp_group
        shards = group.gather_tensor(torch.stack([page.to(group.device) for page in mine]))
        flags = group.all_reduce_(torch.zeros(len(pages), dtype=torch.int32, device=group.device))
        assert shards is not None
        whole = merge_pages([s.cpu() for s in shards], num_kv_heads)
        return whole, [page for page, bad in zip(pages, flags.tolist(), strict=True) if bad]

    def gather(self, store: KVStore, pages: Sequence[PageHash], tail: torch.Tensor | None,
               num_kv_heads: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every rank's heads of `pages` (in `store`: they must stay there until this returns) and
        of the saved tail copy `tail`, merged into whole pages: (stacked pages or None without
        pages, the whole tail or None without one)."""
        saved = self.journal.saved_id(tail) if tail is not None else None
        self._pass(GatherRequest(list(pages), saved))
        whole = merged_tail = None
        group = self.tp_group
        if pages:
            mine = []
            for page in pages:
                data = store.get(page, promote=False)
                if data is None:
                    raise TPError(f"rank 0: page {page} to gather is gone")
                mine.append(data)
            shards = group.gather_tensor(torch.stack(mine).to(group.device))
            assert shards is not None
            whole = merge_pages([s.cpu() for s in shards], num_kv_heads)
        if tail is not None:
            shards = group.gather_tensor(tail.to(group.device))
            assert shards is not None
            merged_tail = merge_pages([s.cpu() for s in shards], num_kv_heads)
        return whole, merged_tail
