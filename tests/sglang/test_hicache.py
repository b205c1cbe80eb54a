"""The omniflow HiCache backend, built by SGLang's StorageBackendFactory, over real CPU host pools."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from engine.compute.sglang import hicache
from engine.data.kv import Capacity, KVLayout, KVStore, KVStoreConfig, Tier, page_hashes
from engine.data.kv.index import RedisKVIndex

PAGE, LAYERS, HEADS, DIM = 4, 3, 2, 8
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def host_pool(layout: str, dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPoolHost:
    device_pool = MHATokenToKVPool(
        64,
        PAGE,
        dtype,
        head_num=HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=LAYERS,
    )
    return MHATokenToKVPoolHost(
        device_pool.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device_capacity_tokens=device_pool.size,
        start_layer=0,
        end_layer=LAYERS,
        write_back_staging=device_pool.hicache_write_back_staging,
    )


def storage_config(extra: dict, layout: str = "page_first") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=layout != "layer_first",
        model_name="test",
        extra_config=extra,
    )


def create(pool: MHATokenToKVPoolHost, store: str | None = None, **options: object) -> HiCacheStorage:
    """What HiCacheController.attach_storage_backend does with `--hicache-storage-backend dynamic`."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(hicache.extra_config(options, store=store), pool.layout), pool
    )
    backend.register_mem_pool_host(pool)
    return backend


def canonical_page(pool: MHATokenToKVPoolHost, start: int) -> torch.Tensor:
    """The page at token slot `start` as (2, L, page, H, D), read through SGLang's own accessor."""
    flat = pool.get_data_page(start, flat=True)
    if pool.layout == "page_first":
        return flat.reshape(2, PAGE, LAYERS, HEADS, DIM).transpose(1, 2).contiguous()
    return flat.reshape(2, LAYERS, PAGE, HEADS, DIM).clone()


def fill(pool: MHATokenToKVPoolHost, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator).to(pool.kv_buffer.dtype))


def token_keys(n_pages: int, seed: int = 0) -> tuple[list[int], list[str]]:
    ids = [(seed * 7919 + i * 31) % 150_000 for i in range(n_pages * PAGE)]
    keys: list[str] = []
    prior = None
    for i in range(0, len(ids), PAGE):
        prior = get_hash_str(ids[i : i + PAGE], prior)
        keys.append(prior)
    return ids, keys


def test_factory_builds_our_class() -> None:
    pool = host_pool("page_first")
    backend = create(pool)
    try:
        assert isinstance(backend, hicache.OmniFlowHiCacheStorage)
        assert backend.store is not None and backend.store.layout == KVLayout(
            PAGE, LAYERS, HEADS, DIM, "bfloat16"
        )
    finally:
        backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_round_trip_bit_exact(layout: str) -> None:
    pool = host_pool(layout)
    backend = create(pool)
    try:
        fill(pool, seed=1)
        ids, keys = token_keys(5)
        host_indices = torch.arange(2 * PAGE, 7 * PAGE, dtype=torch.int64)  # pages at slots 8..27
        expected = [canonical_page(pool, 2 * PAGE + i * PAGE) for i in range(5)]
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, host_indices) == [True] * 5
        assert backend.batch_exists(keys) == 5 and backend.exists(keys[3])
        assert backend.batch_exists([*keys[:2], "f" * 64, keys[3]]) == 2
        # Our keys for the same tokens are SGLang's keys: the store holds exactly those pages.
        assert page_hashes(ids, PAGE) == keys
        for key, page in zip(keys, expected, strict=True):
            assert torch.equal(
                backend.store.get(key, promote=False).view(torch.int16), page.view(torch.int16)
            )
        pool.kv_buffer.zero_()
        target = torch.arange(10 * PAGE, 15 * PAGE, dtype=torch.int64)
        assert backend.batch_get_v1(keys, target) == [True] * 5
        for i, page in enumerate(expected):
            assert torch.equal(
                canonical_page(pool, 10 * PAGE + i * PAGE).view(torch.int16), page.view(torch.int16)
            )
        assert backend.batch_get_v1([keys[0], "0" * 64], target[: 2 * PAGE]) == [True, False]
    finally:
        backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_interface_as_the_cache_controller_uses_it(layout: str) -> None:
    """_generic_page_set / _generic_page_get: flat pages in the pool's own order."""
    pool = host_pool(layout)
    backend = create(pool)
    try:
        fill(pool, seed=2)
        _, keys = token_keys(3, seed=2)
        starts = [PAGE, 5 * PAGE, 9 * PAGE]
        originals = [pool.get_data_page(s).clone() for s in starts]
        assert backend.batch_set(keys, [pool.get_data_page(s) for s in starts])
        pool.kv_buffer.zero_()
        fetched = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        for start, data, original in zip(starts, fetched, originals, strict=True):
            assert data is not None
            pool.set_from_flat_data_page(start, data)
            assert torch.equal(pool.get_data_page(start).view(torch.int16), original.view(torch.int16))
        assert backend.get("1" * 64) is None
        assert backend.set(keys[0], originals[0])  # already held: fine
    finally:
        backend.close()


def test_shared_store_both_directions_and_layout_checked() -> None:
    layout = KVLayout(PAGE, LAYERS, HEADS, DIM, "bfloat16")
    store = KVStore(
        KVStoreConfig(
            layout=layout,
            device_capacity=Capacity(pages=2),
            host_capacity=Capacity(pages=32),
            device="cpu",
            pin_host=False,
        )
    )
    hicache.register_store("shared", store)
    pool = host_pool("page_first_direct")
    backend = create(pool, store="shared")
    try:
        # A page Omni-Flow computed, under our key for its tokens, is a HiCache hit for SGLang.
        ids, keys = token_keys(2, seed=3)
        ours = torch.randn(layout.page_shape).to(torch.bfloat16)
        store.put(page_hashes(ids, PAGE)[0], ours)
        assert backend.batch_exists(keys) == 1
        assert backend.batch_get_v1(keys[:1], torch.arange(0, PAGE)) == [True]
        assert torch.equal(pool.kv_buffer[:, 0].view(torch.int16), ours.view(torch.int16))
        # A page SGLang backs up is in our store.
        fill(pool, seed=4)
        assert backend.batch_set_v1(keys[1:], torch.arange(3 * PAGE, 4 * PAGE)) == [True]
        got = store.get(keys[1], promote=False)
        assert got is not None and torch.equal(got.view(torch.int16), pool.kv_buffer[:, 3].view(torch.int16))
        # A host pool of another geometry is refused.
        with pytest.raises(Exception, match="does not match"):
            other = hicache.OmniFlowHiCacheStorage(storage_config(hicache.extra_config(store="shared")))
            other.register_mem_pool_host(host_pool("page_first", dtype=torch.float16))
    finally:
        backend.close()
        hicache.unregister_store("shared")
        assert not store._closed  # the backend does not close a store it was handed
        store.close()


def test_disk_tier_keeps_pages_across_backends(tmp_path: Path) -> None:
    pool = host_pool("layer_first")
    page_bytes = 2 * LAYERS * PAGE * HEADS * DIM * 2
    options = {
        "host_capacity_bytes": 2 * page_bytes,
        "disk_path": str(tmp_path / "kv.bin"),
        "disk_capacity_bytes": 64 * page_bytes,
    }
    backend = create(pool, **options)
    fill(pool, seed=5)
    _, keys = token_keys(6, seed=5)
    expected = [canonical_page(pool, i * PAGE) for i in range(6)]
    assert backend.batch_set_v1(keys, torch.arange(0, 6 * PAGE)) == [True] * 6
    assert backend.store.tiers_of(keys[0]) == (Tier.DISK,)  # the host tier only holds two pages
    backend.close()
    restarted = create(pool, **options)
    try:
        pool.kv_buffer.zero_()
        assert restarted.batch_exists(keys) == 6
        assert restarted.batch_get_v1(keys, torch.arange(8 * PAGE, 14 * PAGE)) == [True] * 6
        for i, page in enumerate(expected):
            assert torch.equal(canonical_page(pool, (8 + i) * PAGE).view(torch.int16), page.view(torch.int16))
    finally:
        restarted.close()


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,  # its log: it says when it accepts connections
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        redis_ready(proc, time.monotonic() + 10)
        RedisKVIndex.from_url(url).client.ping()
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


def redis_ready(proc: subprocess.Popen, deadline: float) -> None:
    """Read redis-server's log until its own readiness line, waiting on the pipe up to `deadline`."""
    fd = proc.stdout.fileno()
    log = b""
    while b"Ready to accept connections" not in log:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"redis-server not ready in time: {log.decode(errors='replace')}")
        if select.select([fd], [], [], remaining)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"redis-server exited ({proc.wait()}): {log.decode(errors='replace')}")
            log += chunk


def test_pages_sglang_writes_are_published_to_the_kv_index(redis_url: str) -> None:
    pool = host_pool("page_first")
    backend = create(pool, redis_url=redis_url, worker_id="sglang-0", index_namespace="t:kv")
    try:
        fill(pool, seed=6)
        ids, keys = token_keys(3, seed=6)
        assert backend.batch_set_v1(keys, torch.arange(0, 3 * PAGE)) == [True] * 3
        backend.flush_index()
        index = RedisKVIndex.from_url(redis_url, namespace="t:kv")
        # The KV-aware router, hashing the prompt with our keys, finds SGLang's worker.
        assert index.lookup(page_hashes(ids, PAGE)) == {"sglang-0": 3}
    finally:
        backend.close()
