"""The distributed KV index against the real Redis at REDIS_URL (fails loudly if it is down)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.data.kv.errors import KVIndexError
from engine.data.kv.index import KVIndexPublisher, RedisKVIndex
from engine.data.kv.keys import PageHash, page_hashes
from engine.data.kv.layout import KVLayout
from engine.data.kv.store import DiskTierConfig, KVStore, KVStoreConfig
from engine.data.kv.tier import Capacity, Tier

pytestmark = pytest.mark.redis

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
PAGES = page_hashes(list(range(64)), 8)  # 8 pages
LAYOUT = KVLayout(page_size=8, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16")


@pytest.fixture
def index() -> Iterator[RedisKVIndex]:
    idx = RedisKVIndex.from_url(REDIS_URL, namespace=f"test-kv-{uuid.uuid4().hex[:12]}", timeout_s=2.0)
    idx.client.ping()  # no skip: a missing Redis is a failure here
    yield idx
    idx.clear()
    assert not list(idx.client.scan_iter(match=f"{idx.namespace}:*"))
    idx.client.close()


def holds(index: RedisKVIndex, worker: str, tiers: dict[int, Tier]) -> None:
    index.register_worker(worker, address=f"tcp://{worker}:5555", ttl_s=30)
    index.publish(worker, {PAGES[i]: tier for i, tier in tiers.items()})


def test_lookup_returns_longest_prefix_run_per_worker(index: RedisKVIndex) -> None:
    holds(index, "w1", {0: Tier.DEVICE, 1: Tier.DEVICE, 2: Tier.HOST, 3: Tier.DISK, 4: Tier.HOST})
    holds(index, "w2", {0: Tier.HOST, 1: Tier.HOST, 3: Tier.DEVICE})  # gap at page 2
    holds(index, "w3", {1: Tier.DEVICE, 2: Tier.DEVICE})  # does not hold the first page
    assert index.lookup(PAGES) == {"w1": 5, "w2": 2}
    detailed = index.lookup_detailed(PAGES)
    assert detailed["w1"].tiers == (Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.HOST)
    assert index.lookup(PAGES[:1]) == {"w1": 1, "w2": 1}
    assert index.lookup(PAGES[5:]) == {}
    assert index.lookup([]) == {}
    # Long lookups span several pipelines.
    assert index.lookup_detailed(PAGES, chunk=2)["w1"].pages == 5


def test_updates_move_and_remove_pages(index: RedisKVIndex) -> None:
    holds(index, "w1", {0: Tier.DEVICE, 1: Tier.DEVICE, 2: Tier.DEVICE})
    index.publish("w1", {PAGES[1]: None, PAGES[0]: Tier.DISK})
    assert index.lookup_detailed(PAGES)["w1"].tiers == (Tier.DISK,)
    assert index.client.hgetall(index.page_key(PAGES[1])) == {}
    assert index.client.smembers(index.worker_pages_key("w1")) == {PAGES[0], PAGES[2]}


def test_vanished_worker_is_ignored_then_cleaned_up(index: RedisKVIndex) -> None:
    holds(index, "w1", {0: Tier.DEVICE, 1: Tier.DEVICE, 2: Tier.HOST})
    holds(index, "w2", {0: Tier.HOST})
    assert 0 < index.client.pttl(index.alive_key("w1")) <= 30_000
    assert index.alive_workers() == {"w1": "tcp://w1:5555", "w2": "tcp://w2:5555"}
    index.client.delete(index.alive_key("w1"))  # its heartbeat lapsed: the TTL key is gone
    assert index.lookup(PAGES) == {"w2": 1}
    assert index.alive_workers() == {"w2": "tcp://w2:5555"}
    assert index.reap_dead_workers() == ["w1"]
    for page in PAGES[:3]:
        assert "w1" not in index.client.hgetall(index.page_key(page))
    assert not index.client.exists(index.worker_pages_key("w1"))
    assert index.client.smembers(index.workers_key) == {"w2"}
    assert index.drop_worker("w2") == 1
    assert index.lookup(PAGES) == {}


def test_publisher_follows_a_real_store(index: RedisKVIndex, tmp_path: Path) -> None:
    config = KVStoreConfig(
        LAYOUT,
        device_capacity=Capacity(pages=2),
        host_capacity=Capacity(pages=2),
        disk=DiskTierConfig(tmp_path, Capacity(pages=2)),
    )
    index.register_worker("w1", ttl_s=30)
    with KVStore(config) as store:
        store.put(PAGES[0], torch.zeros(LAYOUT.page_shape, dtype=torch.float16))
        publisher = KVIndexPublisher(index, "w1", interval_s=0.01, batch_size=4)
        publisher.attach(store)  # the page stored before attaching is published too
        publisher.start()
        for page in PAGES[1:7]:
            store.put(page, torch.ones(LAYOUT.page_shape, dtype=torch.float16))
        publisher.close()  # flushes what is pending
        assert publisher.pending() == 0 and publisher.failures == 0
        expected = store.resident_pages()  # 2 on device, 2 in host, 2 on disk: PAGES[0] fell out
    assert set(expected) == set(PAGES[1:7])
    published = {
        PageHash(page): Tier(int(index.client.hget(index.page_key(page), "w1")))
        for page in index.client.smembers(index.worker_pages_key("w1"))
    }
    assert published == expected
    assert index.lookup(PAGES) == {}  # page 0 was evicted from the last tier
    assert index.lookup(PAGES[1:]) == {"w1": 6}
    assert index.lookup_detailed(PAGES[1:])["w1"].tiers == tuple(expected[p] for p in PAGES[1:7])


def free_port() -> int:
    """A local TCP port that nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_redis_is_a_typed_error() -> None:
    idx = RedisKVIndex.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    with pytest.raises(KVIndexError):
        idx.lookup(PAGES)
    with pytest.raises(KVIndexError):
        idx.publish("w1", {PAGES[0]: Tier.DEVICE})
