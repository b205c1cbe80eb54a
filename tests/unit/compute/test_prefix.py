"""The page-aligned radix tree and multimodal cache keys."""

from __future__ import annotations

import pytest
import torch

from engine.compute.prefix import (
    MultimodalItem,
    PrefixLockError,
    RadixCache,
    cache_key,
    content_hash,
    sentinel_id,
)
from engine.data.kv.keys import ExtraKeys, page_hashes
from engine.data.kv.layout import KVLayout
from engine.data.kv.store import KVStore, KVStoreConfig
from engine.data.kv.tier import Capacity

P = 4
NS = ("model-a", None)


def pages_of(key, ns=NS):
    return page_hashes(key, P, extra_keys=ExtraKeys(model_id=ns[0], tenant_salt=ns[1]))


def insert(tree: RadixCache, key, ns=NS):
    return tree.insert(key, pages_of(key, ns), ns)


def test_match_is_page_aligned_and_returns_the_page_keys():
    tree = RadixCache(P)
    key = list(range(10))  # two full pages and a partial one
    insert(tree, key)
    assert tree.num_pages == 2
    match = tree.match(list(range(10)) + [99], NS)
    assert match.pages == tuple(pages_of(key)[:2]) and match.num_tokens == 8
    assert tree.match(list(range(7)), NS).num_pages == 1
    assert tree.match([0, 1, 2, 99, 4, 5, 6, 7], NS).num_pages == 0
    assert tree.match(list(range(10)), NS, max_pages=1).num_pages == 1


def test_diverging_insert_splits_the_node_and_keeps_lock_counts():
    tree = RadixCache(P)
    a = insert(tree, list(range(12)))
    tree.lock(a)
    b_key = list(range(8)) + [50, 51, 52, 53]
    b = insert(tree, b_key)
    shared = b.parent
    assert shared is a.parent and shared.key == tuple(range(8))
    assert shared.lock_ref == 1 and a.lock_ref == 1 and b.lock_ref == 0
    tree.lock(b)
    assert shared.lock_ref == 2
    tree.unlock(a)
    tree.unlock(b)
    assert (shared.lock_ref, a.lock_ref, b.lock_ref) == (0, 0, 0)
    with pytest.raises(PrefixLockError):
        tree.unlock(b)


def test_evict_takes_least_recently_used_unlocked_leaves_first():
    tree = RadixCache(P)
    first = insert(tree, [1] * 8)
    second = insert(tree, [2] * 8)
    third = insert(tree, [3] * 8)
    tree.lock(third)
    tree.match([1] * 8, NS)  # touch: `second` is now the oldest
    assert tree.evict(2) == second.pages
    assert tree.evict(100) == first.pages  # the locked one stays
    assert tree.match([3] * 8, NS).num_pages == 2 and tree.match([1] * 8, NS).num_pages == 0
    tree.unlock(third)
    assert tree.evict(1) == third.pages and tree.num_pages == 0


def test_parent_becomes_evictable_after_its_children():
    tree = RadixCache(P)
    insert(tree, [1] * 4 + [2] * 4)
    insert(tree, [1] * 4 + [3] * 4)
    dropped = tree.evict(3)
    assert len(dropped) == 3 and tree.num_pages == 0


def test_namespaces_never_share():
    tree = RadixCache(P)
    insert(tree, list(range(8)), ns=("model-a", None))
    assert tree.match(list(range(8)), ("model-b", None)).num_pages == 0
    assert tree.match(list(range(8)), ("model-a", "tenant-1")).num_pages == 0
    assert tree.match(list(range(8)), ("model-a", None)).num_pages == 2


def test_pages_gone_from_every_tier_are_forgotten_with_their_descendants():
    layout = KVLayout(page_size=P, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    store = KVStore(KVStoreConfig(layout=layout, device_capacity=Capacity(pages=2), device="cpu"))
    tree = RadixCache(P)
    store.add_listener(tree.store_listener())
    try:
        key = list(range(8))
        hashes = pages_of(key)
        for h in hashes:
            store.put(h, torch.zeros(layout.page_shape))
        insert(tree, key)
        store.put(pages_of([9] * 4)[0], torch.zeros(layout.page_shape))  # evicts page 0 (no lower tier)
        assert tree.match(key, NS).num_pages == 0
        assert hashes[0] not in tree and hashes[1] not in tree
    finally:
        store.close()


def test_demoted_pages_stay_matchable():
    layout = KVLayout(page_size=P, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    config = KVStoreConfig(layout=layout, device_capacity=Capacity(pages=1), host_capacity=Capacity(pages=4),
                           device="cpu")
    store = KVStore(config)
    tree = RadixCache(P)
    store.add_listener(tree.store_listener())
    try:
        key = list(range(8))
        for h in pages_of(key):
            store.put(h, torch.zeros(layout.page_shape))
        insert(tree, key)
        assert tree.match(key, NS).num_pages == 2  # page 0 now lives in the host tier only
    finally:
        store.close()


def test_same_picture_hits_and_a_different_picture_of_the_same_size_never_does():
    picture = torch.arange(48, dtype=torch.uint8).reshape(4, 4, 3)
    other = picture.flip(0)
    text = list(range(100, 106))
    item = MultimodalItem("image", content_hash("image", picture), start=6, length=6)
    key1 = cache_key(text + [259] * 6 + [1, 2, 3, 4], [item])
    assert key1[6:12] == [sentinel_id(item.item_hash)] * 6 and sentinel_id(item.item_hash) >= 2**62
    tree = RadixCache(P)
    insert(tree, key1)
    # A later turn with the same picture: the whole prefix (text + picture) hits.
    again = cache_key(text + [259] * 6 + [1, 2, 3, 4, 5, 6], [item])
    assert tree.match(again, NS).num_tokens == 16
    # Same size, other content: only the page before the picture is shared.
    different = MultimodalItem("image", content_hash("image", other), start=6, length=6)
    assert different.item_hash != item.item_hash
    assert tree.match(cache_key(text + [259] * 6 + [1, 2, 3, 4], [different]), NS).num_tokens == 4
    # The same bytes as audio are another item.
    assert content_hash("audio", picture) != item.item_hash


def test_cache_key_rejects_items_past_the_prompt():
    with pytest.raises(ValueError, match="runs past"):
        cache_key([1, 2, 3], [MultimodalItem("audio", "ab" * 32, start=2, length=5)])
