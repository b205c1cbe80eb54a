"""The KV cache sharded with the attention heads.

A page is `(2, layers, page_size, kv_heads, head_dim)` (`engine.data.kv.layout`); a rank's
page holds only its own KV heads, `(2, layers, page_size, kv_heads_of(...), head_dim)`,
under the same page key as the whole page (keys hash tokens, model and tenant, never
heads). With fewer KV heads than ranks (GQA, e.g. 4 query heads over 1 KV head on 2
ranks) a KV head is replicated on every rank whose query heads read it.

Re-sharding between TP sizes (a TP-2 prefill role feeding a TP-1 decode role) only copies
head slices: `merge_pages` of the ranks' shards is bit-identical to the pages they came
from, and `split_page` is its inverse.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.compute.tp.group import TPError
from engine.data.kv.errors import KVTransferError
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.source import HolderPageSource, PageSource
from engine.data.kv.store import Capacity, KVStore, KVStoreConfig
from engine.data.peer import Peer


def kv_heads_of(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The (global) KV heads rank `rank` of `tp_size` holds, in order."""
    if not 0 <= rank < tp_size:
        raise TPError(f"rank {rank} is not in a group of {tp_size}")
    if num_kv_heads % tp_size == 0:
        per = num_kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    if tp_size % num_kv_heads == 0:
        head = rank // (tp_size // num_kv_heads)
        return range(head, head + 1)
    raise TPError(f"{num_kv_heads} KV heads cannot be split over {tp_size} ranks")


def kv_head_owner(num_kv_heads: int, tp_size: int, head: int) -> tuple[int, int]:
    """`(rank, local index)` of the first rank holding global KV head `head`."""
    for rank in range(tp_size):
        heads = kv_heads_of(num_kv_heads, tp_size, rank)
        if head in heads:
            return rank, head - heads.start
    raise TPError(f"KV head {head} is not one of {num_kv_heads}")


def shard_layout(layout: KVLayout, tp_size: int, rank: int) -> KVLayout:
    """The layout of rank `rank`'s pages when `layout` (the whole model's) is split `tp_size` ways."""
    heads = kv_heads_of(layout.num_kv_heads, tp_size, rank)
    return KVLayout(layout.page_size, layout.num_layers, len(heads), layout.head_dim, layout.dtype)


def split_page(pages: torch.Tensor, num_kv_heads: int, tp_size: int) -> list[torch.Tensor]:
    """Whole pages (`(..., kv_heads, head_dim)`: one page or a stack) -> each rank's head shard."""
    if pages.shape[-2] != num_kv_heads:
        raise TPError(f"pages with {pages.shape[-2]} KV heads are not whole pages of {num_kv_heads}")
    out = []
    for rank in range(tp_size):
        heads = kv_heads_of(num_kv_heads, tp_size, rank)
        out.append(pages[..., heads.start : heads.stop, :].contiguous())
    return out


def merge_pages(shards: Sequence[torch.Tensor], num_kv_heads: int) -> torch.Tensor:
    """Each rank's head shard of the same pages (rank order) -> the whole pages."""
    tp_size = len(shards)
    parts = []
    for head in range(num_kv_heads):
        rank, local = kv_head_owner(num_kv_heads, tp_size, head)
        want = len(kv_heads_of(num_kv_heads, tp_size, rank))
        if shards[rank].shape[-2] != want:
            raise TPError(f"rank {rank}'s shard has {shards[rank].shape[-2]} KV heads, expected {want}")
        parts.append(shards[rank][..., local : local + 1, :])
    return torch.cat(parts, dim=-2).contiguous()


def reshard_pages(shards: Sequence[torch.Tensor], num_kv_heads: int, tp_size: int) -> list[torch.Tensor]:
    """Pages sharded over `len(shards)` ranks -> the same pages sharded over `tp_size` ranks."""
    whole = merge_pages(shards, num_kv_heads)
    return [whole] if tp_size == 1 else split_page(whole, num_kv_heads, tp_size)


def pull_whole(peer: Peer, holder: str, pages: Sequence[PageHash], whole: KVLayout,
               timeout_s: float) -> list[torch.Tensor]:
    """The leading run of `pages` that the worker at `holder` serves whole (in `whole`'s layout).
    Raises what `fetch_pages` raises (`KVTransferError`: the holder is dead, silent or serves
    another layout)."""
    return pull_whole_from(HolderPageSource(peer, holder), pages, whole, timeout_s)


def pull_whole_from(source: PageSource, pages: Sequence[PageHash], whole: KVLayout, timeout_s: float, *,
                    account: KVStore | None = None) -> list[torch.Tensor]:
    """The leading run of `pages` that `source` has whole (in `whole`'s layout: a holder, or the
    worker the KV index names), fetched through a scratch store of this layout. `account`: a
    store whose pull metrics count the transfer (a rank's own store, whose pages are not whole),
    failures included. Raises what `source.pull` raises (`KVTransferError`)."""
    if not pages:
        return []
    scratch = KVStore(KVStoreConfig(layout=whole, device_capacity=Capacity(pages=len(pages)), device="cpu"))
    try:
        try:
            count = source.pull(scratch, pages, timeout_s)
        finally:
            if account is not None:
                _account_pulls(account, scratch.metrics())
        got = []
        for page in pages[:count]:
            data = scratch.get(page)
            if data is None:
                raise KVTransferError(f"page {page} vanished from the pull's scratch store")
            got.append(data)
        return got
    finally:
        scratch.close()


def _account_pulls(store: KVStore, metrics: dict[str, float]) -> None:
    """Count in `store` the pulls a scratch store's `metrics` show (`KVStore.metrics`' `pull.*`)."""
    paths = {name.split(".")[1]: int(value) for name, value in metrics.items()
             if name.startswith("pull.") and name.endswith(".pages") and name.count(".") == 2}
    store.record_pull(int(metrics["pull.pages"]), int(metrics["pull.bytes"]), metrics["pull.seconds"], paths=paths)
    for _ in range(int(metrics["pull.failures"])):
        store.record_pull(0, 0, 0.0, failed=True)


def pull_shards(peer: Peer, holder: str, pages: Sequence[PageHash], whole: KVLayout, tp_size: int, rank: int,
                timeout_s: float) -> list[torch.Tensor]:
    """Rank `rank`'s KV heads of the leading run of `pages` that the worker at `holder` serves
    whole (`pull_whole`, then split)."""
    heads = kv_heads_of(whole.num_kv_heads, tp_size, rank)
    return [page[..., heads.start : heads.stop, :].contiguous()
            for page in pull_whole(peer, holder, pages, whole, timeout_s)]
