"""KV layout geometry and the eviction trackers' exact order."""

from __future__ import annotations

import pytest
import torch

from engine.data.kv.errors import KVConfigError, KVLayoutError
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.policy import EvictionPolicy, LFUTracker, LRUTracker, make_tracker
from engine.data.kv.tier import Capacity


def test_page_geometry() -> None:
    layout = KVLayout(page_size=16, num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert layout.dtype == "bfloat16"
    assert layout.page_shape == (2, 32, 16, 8, 128)
    assert layout.page_nbytes == 2 * 32 * 16 * 8 * 128 * 2
    assert layout.fingerprint() == "p16-l32-h8-d128-bfloat16"
    assert KVLayout.from_dict(layout.to_dict()) == layout


def test_check_page_accepts_raw_bytes_and_rejects_mismatches() -> None:
    layout = KVLayout(4, 2, 2, 8, "float16")
    page = torch.zeros(layout.page_shape, dtype=torch.float16)
    assert layout.check_page(page) is page
    assert layout.check_page(torch.zeros(layout.page_nbytes, dtype=torch.uint8)).shape == layout.page_shape
    with pytest.raises(KVLayoutError):
        layout.check_page(page.float())
    with pytest.raises(KVLayoutError):
        layout.check_page(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(KVConfigError):
        KVLayout(0, 1, 1, 1)
    with pytest.raises(KVConfigError):
        KVLayout(1, 1, 1, 1, "complex64")


def test_capacity_in_pages_or_bytes() -> None:
    assert Capacity(pages=5).in_pages(100) == 5
    assert Capacity(bytes=350).in_pages(100) == 3
    with pytest.raises(KVConfigError):
        Capacity()
    with pytest.raises(KVConfigError):
        Capacity(pages=1, bytes=1)
    with pytest.raises(KVConfigError):
        Capacity(bytes=50).in_pages(100)


P = [PageHash(c) for c in "abcde"]


def test_lru_order() -> None:
    lru = LRUTracker()
    for page in P[:4]:
        lru.insert(page)
    lru.touch(P[0])
    lru.touch(P[2])
    assert list(lru.order()) == [P[1], P[3], P[0], P[2]]
    lru.remove(P[3])
    assert list(lru.order()) == [P[1], P[0], P[2]]


def test_lfu_order_breaks_ties_by_recency() -> None:
    lfu = LFUTracker()
    for page in P[:4]:
        lfu.insert(page)
    lfu.touch(P[0])
    lfu.touch(P[0])
    lfu.touch(P[2])
    lfu.touch(P[1])
    # counts: a=3, b=2, c=2, d=1; among b and c, c was used first
    assert list(lfu.order()) == [P[3], P[2], P[1], P[0]]
    lfu.insert(P[4], frequency=5)
    assert list(lfu.order())[-1] == P[4]
    assert lfu.frequency(P[0]) == 3


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_every_policy_removes_and_reports(policy: EvictionPolicy) -> None:
    tracker = make_tracker(policy)
    tracker.insert(P[0])
    tracker.insert(P[1])
    assert len(tracker) == 2 and P[0] in tracker
    tracker.remove(P[0])
    assert list(tracker.order()) == [P[1]] and P[0] not in tracker
