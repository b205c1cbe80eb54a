"""The LLM engine of one tensor-parallel rank.

`TPEngine` is an `LLMEngine` over a model shard (`shard_model`): its KV layout has the rank's
KV heads only, its page keys are the whole model's (same `model_id`, same token hash
chain). Every rank runs the same schedule — rank 0 hands each command to all ranks
(`engine.compute.tp.role`) and the scheduler is deterministic — so the ranks run the same
forwards in the same order and meet in the same collectives. The one input that can
differ per rank is what its own KV tiers hold; `AgreedPrefixCache` therefore agrees on a
prefix hit with `all_reduce(MIN)` before locking it, so no rank computes fewer tokens than
another. Prefix matching does not pull pages from peers (a rank whose tiers lost a page makes
every rank recompute it); a decode's handoff is pulled by every rank, each keeping its own
heads (`engine.compute.tp.unit`), before the engine admits it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.compute.llm.cache import PagedKVCache
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.sequence import Sequence
from engine.compute.models.loader import LoadedModel
from engine.compute.tp.group import TPGroup


class AgreedPrefixCache(PagedKVCache):
    """`PagedKVCache` whose prefix matches are the smallest over the group's ranks."""

    def __init__(self, *args, group: TPGroup, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def _local_hit(self, seq: Sequence, limit: int) -> int:
        if self.tree is None or not limit:
            return 0
        match = self.tree.match(seq.key_ids, seq.namespace, max_pages=limit)
        return self.store.resident_run(match.pages)

    def match_prefix(self, seq: Sequence) -> bool:
        """As `PagedKVCache.match_prefix`, never pulling from peers (a TP group has none), so
        always done at once."""
        limit = (len(seq.token_ids) - 1) // self.page_size
        agreed = self.group.min_int(self._local_hit(seq, limit))
        while True:
            if agreed:
                self._match(seq, agreed)
            # A page can vanish between the probe and the lock (found corrupt): agree again.
            got = self.group.min_int(len(seq.pages))
            if got == agreed:
                break
            self._drop_match(seq)
            agreed = got
        seq.num_computed = len(seq.pages) * self.page_size
        seq.matched = True
        return True

    def _drop_match(self, seq: Sequence) -> None:
        pages, seq.pages, seq.slots = seq.pages, [], []
        if pages:
            self.store.unlock(pages)
        if seq.node is not None and self.tree is not None:
            self.tree.unlock(seq.node)
        seq.node = None


class TPEngine(LLMEngine):
    """`LLMEngine` of one rank over its model shard, with prefix hits agreed by the group."""

    def __init__(self, shard: LoadedModel, group: TPGroup, config: EngineConfig | None = None, **kwargs) -> None:
        if kwargs.get("peers"):
            raise ValueError("a tensor-parallel engine does not pull pages from peers")
        if config is not None and config.disk_path:
            # Each rank's pages hold its own heads under the whole model's page keys: a rank
            # must never take over another rank's disk slot.
            config = dataclasses.replace(config, disk_path=str(Path(config.disk_path) / f"rank-{group.rank}"))
        self.group = group
        cfg = config or EngineConfig()
        super().__init__(shard, cfg, make_cache=lambda store, layout: AgreedPrefixCache(
            store, layout, cfg.max_running, cfg.prefix_cache, group=group), **kwargs)
