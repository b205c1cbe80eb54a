"""Re-sharding KV pages by head between tensor-parallel sizes (pure functions, bit-exact)."""

from __future__ import annotations

import pytest
import torch

from engine.compute.tp import TPError, kv_heads_of, merge_pages, reshard_pages, shard_layout, split_page
from engine.data.kv.layout import KVLayout


def _pages(n: int, heads: int) -> torch.Tensor:
    layout = KVLayout(4, 3, heads, 8, "float32")
    return torch.randn((n, *layout.page_shape), generator=torch.Generator().manual_seed(heads))


def test_heads_split_evenly_and_replicate_below_the_rank_count() -> None:
    assert [list(kv_heads_of(4, 2, r)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(kv_heads_of(1, 2, r)) for r in range(2)] == [[0], [0]]
    assert [list(kv_heads_of(2, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]
    with pytest.raises(TPError):
        kv_heads_of(3, 2, 0)
    assert shard_layout(KVLayout(16, 4, 2, 16, "float32"), 2, 1) == KVLayout(16, 4, 1, 16, "float32")


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_tp2_shards_merge_bit_exactly_into_the_tp1_pages(heads: int) -> None:
    whole = _pages(3, heads)
    shards = split_page(whole, heads, 2)
    assert all(s.shape[-2] == len(kv_heads_of(heads, 2, r)) for r, s in enumerate(shards))
    merged = reshard_pages(shards, heads, 1)[0]
    assert torch.equal(merged, whole)
    if heads == 2:  # the concat of the two ranks' head shards is the TP-1 page
        assert torch.equal(torch.cat(shards, dim=-2), whole)
    # 1 -> 2 -> 4 -> 1, one page at a time as well
    four = reshard_pages(shards, heads, 4) if heads != 1 else split_page(whole, heads, 4)
    assert torch.equal(merge_pages(four, heads), whole)
    assert torch.equal(merge_pages([s[0] for s in shards], heads), whole[0])


def test_mismatched_shards_are_refused() -> None:
    whole = _pages(1, 4)
    with pytest.raises(TPError):
        merge_pages([whole, whole], 4)
    with pytest.raises(TPError):
        split_page(whole, 2, 2)
