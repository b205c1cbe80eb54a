"""Rank 0's engine: the ordinary `LLMEngine` over its shard, with the pieces that lead the group.

`lead()` joins the group, shards the model, meets the followers (agreeing on the disk pages
every rank recovered), and builds the engine with a `MirroredCache` (which pulls a prefix its
peers hold whole, `cache.py`) and a `BroadcastForward` over a `KVJournal` of its store (see
`unit.py`). The `llm` unit of a tensor-parallel role drives it as it drives any engine; tests
and `omniflow bench tp` drive it directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from engine.compute.llm.cache import PagedKVCache
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine, engine_layout, own_store
from engine.compute.models.loader import LoadedModel
from engine.compute.tp.cache import MirroredCache
from engine.compute.tp.follower import rank_config
from engine.compute.tp.group import TPError, TPGroup
from engine.compute.tp.journal import KVJournal
from engine.compute.tp.link import FollowerLink
from engine.compute.tp.messages import TPHello
from engine.compute.tp.runner import BroadcastForward
from engine.compute.tp.seat import TPSeat, join_group, shard_to_device
from engine.data.kv.layout import KVLayout
from engine.data.kv.source import PageSource
from engine.data.kv.store import KVStore
from engine.spec.graph import RoleSpec


def agree_on_disk(store: KVStore, hellos: list[TPHello]) -> list[str]:
    """The recovered disk pages every rank holds: rank 0's store drops the others (the followers
    drop theirs when the setup says which)."""
    common = set(store.resident_pages())
    for hello in hellos:
        common &= set(hello.disk_pages)
    for page in list(store.resident_pages()):
        if page not in common:
            store.remove(page)
    return sorted(common)


@dataclass(slots=True)
class Leader:
    """Rank 0's engine and what it holds for the group. `close()` ends the engine, then the group."""

    engine: LLMEngine
    group: TPGroup
    link: FollowerLink
    store: KVStore
    journal: KVJournal
    whole: KVLayout
    """The whole model's KV layout (pages that leave or enter the role)."""

    @property
    def forward(self) -> BroadcastForward:
        forward = self.engine.forward
        assert isinstance(forward, BroadcastForward)
        return forward

    def close(self) -> None:
        self.engine.close()
        self.close_group()

    def close_group(self) -> None:
        """Stop the followers and leave the group (the engine closed already, or never built)."""
        self.link.close()
        self.group.close()
        self.journal.close()
        self.store.close()


def lead(role: RoleSpec, model: LoadedModel, config: EngineConfig, seat: TPSeat,
         peers: Sequence[PageSource] = ()) -> Leader:
    """Rank 0 of `role`'s group at `seat`, over `model` (whole: sharded here) as `config` says;
    `peers`: where prefix matching pulls the pages no tier holds, whole (the whole model's layout),
    as an `llm` role's engine does (`engine.data.kv.source.IndexPageSource`)."""
    if seat.rank != 0 or seat.size < 2:
        raise TPError(f"rank 0 leads a group of 2 or more, not rank {seat.rank} of {seat.size}")
    with contextlib.ExitStack() as undo:
        group, device = join_group(role, seat)
        undo.callback(group.close)
        shard = shard_to_device(model, group, device)
        link = FollowerLink(group, seat.address, seat.size, what=f"{role.kind} role {role.name!r}", keys=seat.keys)
        undo.callback(link.close)
        store = own_store(rank_config(config, 0), engine_layout(shard, config), device)
        undo.callback(store.close)
        link.meet(partial(agree_on_disk, store))
        journal = KVJournal(store)
        whole = KVLayout(config.page_size, model.num_layers, model.num_kv_heads, model.head_dim, store.layout.dtype)

        def cache(store: KVStore, layout: KVLayout) -> PagedKVCache:
            return MirroredCache(journal, store, layout, config.max_running, config.prefix_cache, peers,
                                 whole=whole, tp_size=seat.size)

        forward = partial(BroadcastForward, journal=journal, send=link.broadcast, group=group)
        engine = LLMEngine(shard, config, store=store, make_cache=cache, make_forward=forward)
        mirrored, runner = engine.cache, engine.forward
        assert isinstance(mirrored, MirroredCache) and isinstance(runner, BroadcastForward)
        mirrored.check_pages = runner.check
        undo.pop_all()
    return Leader(engine, group, link, store, journal, whole)


__all__ = ["Leader", "agree_on_disk", "lead"]
