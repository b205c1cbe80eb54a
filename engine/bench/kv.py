"""Paged KV cache: tier throughput against memcpy and raw file writes, and hit rates on a trace.

Throughput (GB/s, median of `--repeats` timed passes after one warm-up pass, each pass
moving `--pages` pages of a Llama-8B-like layout, 2 MiB per page by default):

* `device_put_gbps`: `KVStore.put` into the device tier (GPU if present, else CPU).
* `host_get_gbps`: `KVStore.get(promote=False)` of pages held in the shared-memory
  host tier, into warm buffers.
* `disk_write_gbps` / `disk_read_gbps`: the disk tier writing pages (checksum, payload,
  record; no fsync) and reading them back with checksum verification (page cache warm);
  `disk_read_cold_gbps` reads after the file was synced and dropped from the page cache.
* anchors, measured in the same run on the same bytes, before and after the tiers (the
  faster of the two kept): `memcpy_gbps` (numpy `copyto`
  into a warm buffer) and `raw_disk_write_gbps` (plain sequential `pwrite` of the
  same bytes into one file in the same directory, no fsync, like the tier).

Hit rates on a synthetic multi-turn chat trace (conversations sharing a system
prompt, turns visited in random interleaved order; each request looks up its
prompt's pages, locks the cached prefix, stores the rest and its answer), with a
device tier a tenth of the trace's working set: `hit_rate_device_only` (device tier
alone), `hit_rate_tiered` (plus host and disk tiers) and `hit_rate_unlimited` (a
device tier that holds everything).

Goals: device and host >= 0.7 x memcpy; disk write >= 0.5 x raw write;
`hit_rate_tiered` >= 0.95 x `hit_rate_unlimited`.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from engine.data.kv.disk import DiskTier
from engine.data.kv.keys import PageHash, page_hashes
from engine.data.kv.layout import KVLayout
from engine.data.kv.store import DiskTierConfig, KVStore, KVStoreConfig, WritePolicy
from engine.data.kv.tier import Capacity

GB = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=int, default=32, help="pages moved per timed pass")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes (median reported)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--dir", default=None, help="directory for the disk tier (default: a temp dir)")
    parser.add_argument("--conversations", type=int, default=64, help="trace: conversations")
    parser.add_argument("--turns", type=int, default=8, help="trace: turns per conversation")
    parser.add_argument("--seed", type=int, default=0)


def _median_gbps(
    nbytes: int, run: Callable[[], None], repeats: int, reset: Callable[[], None] | None = None
) -> float:
    rates: list[float] = []
    for attempt in range(repeats + 1):  # the first pass warms caches and faults pages in
        if reset is not None:
            reset()
        started = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        if attempt:
            rates.append(nbytes / elapsed / GB)
    return statistics.median(rates)


def _keys(n: int, tag: int) -> list[PageHash]:
    return page_hashes(list(range(tag * 1_000_000, tag * 1_000_000 + n)), 1)


def _sources(layout: KVLayout, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randint(0, 255, (n, layout.page_nbytes), dtype=torch.uint8, generator=gen)
    pages = pages.view(layout.torch_dtype).view(n, *layout.page_shape)
    return pages.pin_memory() if torch.cuda.is_available() else pages


def bench_memcpy(src: torch.Tensor, repeats: int) -> float:
    flat = src.reshape(-1).view(torch.uint8).numpy()
    dst = np.empty_like(flat)
    return _median_gbps(flat.nbytes, lambda: np.copyto(dst, flat), repeats)


def bench_device_put(layout: KVLayout, src: torch.Tensor, repeats: int) -> float:
    n = src.shape[0]
    keys = _keys(n, 1)
    config = KVStoreConfig(layout, device_capacity=Capacity(pages=n))
    with KVStore(config) as store:

        def clear() -> None:
            for key in keys:
                if store.contains(key):
                    store.remove(key)

        def put_all() -> None:
            for key, page in zip(keys, src, strict=True):
                store.put(key, page)

        return _median_gbps(n * layout.page_nbytes, put_all, repeats, reset=clear)


def bench_host_get(layout: KVLayout, src: torch.Tensor, repeats: int) -> float:
    n = src.shape[0]
    keys = _keys(n + 1, 2)
    config = KVStoreConfig(
        layout,
        device_capacity=Capacity(pages=1),
        host_capacity=Capacity(pages=n + 1),
        write=WritePolicy.WRITE_THROUGH,
        device="cpu",
    )
    dst = torch.empty_like(src, device="cpu")
    with KVStore(config) as store:
        for key, page in zip(keys, [*src, src[0]], strict=True):
            store.put(key, page)  # the first n keys now live in the host tier only

        def get_all() -> None:
            for i, key in enumerate(keys[:n]):
                store.get(key, out=dst[i], promote=False)

        rate = _median_gbps(n * layout.page_nbytes, get_all, repeats)
        assert torch.equal(dst.view(torch.uint8), src.cpu().view(torch.uint8))
        return rate


def bench_disk(layout: KVLayout, src: torch.Tensor, repeats: int, directory: Path) -> dict[str, float]:
    n = src.shape[0]
    keys = _keys(n, 3)
    host_src = src.cpu()
    dst = torch.empty_like(host_src)
    # Anchors are taken before and after what they anchor and the faster kept: on a
    # shared machine one slow pass must not flatter the ratio.
    raw_before = bench_raw_write(host_src, repeats, directory)
    tier = DiskTier(layout, n, directory / "tier")
    try:

        def clear() -> None:
            for key in keys:
                if key in tier:
                    tier.remove(key)

        def write_all() -> None:
            for key, page in zip(keys, host_src, strict=True):
                tier.write(key, page)

        def read_all() -> None:
            for i, key in enumerate(keys):
                if not tier.read_into(key, dst[i]):
                    raise RuntimeError("disk tier read back a corrupt page during the benchmark")

        write = _median_gbps(n * layout.page_nbytes, write_all, repeats, reset=clear)
        read = _median_gbps(n * layout.page_nbytes, read_all, repeats)

        def drop_cache() -> None:
            tier.sync()
            fd = os.open(tier.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

        cold = _median_gbps(n * layout.page_nbytes, read_all, repeats, reset=drop_cache)
        assert torch.equal(dst.view(torch.uint8), host_src.view(torch.uint8))
    finally:
        tier.close()

    raw = max(raw_before, bench_raw_write(host_src, repeats, directory))
    return {
        "disk_write_gbps": write,
        "disk_read_gbps": read,
        "disk_read_cold_gbps": cold,
        "raw_disk_write_gbps": raw,
    }


def bench_raw_write(host_src: torch.Tensor, repeats: int, directory: Path) -> float:
    """The anchor: the same pages written by plain sequential `pwrite` into one file, no fsync."""
    pages = [memoryview(p.reshape(-1).view(torch.uint8).numpy()) for p in host_src]
    fd = os.open(directory / "raw.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        def raw_write() -> None:
            offset = 0
            for data in pages:
                while data:
                    written = os.pwrite(fd, data, offset)
                    data, offset = data[written:], offset + written

        return _median_gbps(sum(len(p) for p in pages), raw_write, repeats)
    finally:
        os.close(fd)


# -- hit rates on a synthetic multi-turn trace -----------------------------------------------


def make_trace(conversations: int, turns: int, page_size: int, seed: int) -> list[list[PageHash]]:
    """Prompts (as page keys) of a chat trace, in the order requests arrive.

    Every conversation starts with the same 4-page system prompt; each turn adds a
    3-page user message to the history and the request's prompt is the whole history;
    the 3-page answer joins the history for the next turn. Requests of different
    conversations interleave at random.
    """
    rng = random.Random(seed)
    system = [rng.randrange(32_000) for _ in range(4 * page_size)]
    histories = [list(system) for _ in range(conversations)]
    remaining = [turns] * conversations
    prompts: list[list[PageHash]] = []
    while any(remaining):
        conv = rng.choice([c for c, left in enumerate(remaining) if left])
        remaining[conv] -= 1
        histories[conv] += [rng.randrange(32_000) for _ in range(3 * page_size)]
        prompt = page_hashes(histories[conv], page_size)
        histories[conv] += [rng.randrange(32_000) for _ in range(3 * page_size)]
        answer = page_hashes(histories[conv], page_size)
        prompts.append(prompt)
        prompts.append(answer)  # stored after the request, never looked up itself
    return prompts


def replay(store: KVStore, trace: list[list[PageHash]], page: torch.Tensor) -> float:
    looked = hit = 0
    for i in range(0, len(trace), 2):
        prompt, answer = trace[i], trace[i + 1]
        cached = store.lookup(prompt).prefix_pages
        looked += len(prompt)
        hit += cached
        store.lock(prompt[:cached])
        for key in answer[cached:]:  # the prompt's misses, then the answer's pages
            store.put(key, page)
        store.unlock(prompt[:cached])
    return hit / looked if looked else 0.0


def bench_hit_rates(args: argparse.Namespace, directory: Path) -> dict[str, float]:
    layout = KVLayout(page_size=args.page_size, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
    trace = make_trace(args.conversations, args.turns, args.page_size, args.seed)
    working_set = len({key for request in trace for key in request})
    device_pages = max(1, working_set // 10)
    page = torch.zeros(layout.page_shape, dtype=layout.torch_dtype)

    def run(config: KVStoreConfig) -> float:
        with KVStore(config) as store:
            return replay(store, trace, page)

    device_only = run(KVStoreConfig(layout, device_capacity=Capacity(pages=device_pages), device="cpu"))
    tiered = run(
        KVStoreConfig(
            layout,
            device_capacity=Capacity(pages=device_pages),
            host_capacity=Capacity(pages=max(1, working_set // 3)),
            disk=DiskTierConfig(directory / "trace", Capacity(pages=working_set + device_pages)),
            device="cpu",
        )
    )
    unlimited = run(KVStoreConfig(layout, device_capacity=Capacity(pages=working_set), device="cpu"))
    return {
        "trace_working_set_pages": float(working_set),
        "trace_device_pages": float(device_pages),
        "hit_rate_device_only": device_only,
        "hit_rate_tiered": tiered,
        "hit_rate_unlimited": unlimited,
    }


def run(args: argparse.Namespace) -> dict[str, float]:
    layout = KVLayout(args.page_size, args.layers, args.kv_heads, args.head_dim, args.dtype)
    directory = Path(tempfile.mkdtemp(prefix="omniflow-kv-bench-", dir=args.dir))
    try:
        src = _sources(layout, args.pages, args.seed)
        memcpy_before = bench_memcpy(src.cpu(), args.repeats)
        result: dict[str, float] = {
            "page_mib": layout.page_nbytes / 2**20,
            "device_put_gbps": bench_device_put(layout, src, args.repeats),
            "host_get_gbps": bench_host_get(layout, src, args.repeats),
        }
        result["memcpy_gbps"] = max(memcpy_before, bench_memcpy(src.cpu(), args.repeats))
        result.update(bench_disk(layout, src, args.repeats, directory))
        result.update(bench_hit_rates(args, directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result["device_vs_memcpy"] = result["device_put_gbps"] / result["memcpy_gbps"]
    result["host_vs_memcpy"] = result["host_get_gbps"] / result["memcpy_gbps"]
    result["disk_write_vs_raw"] = result["disk_write_gbps"] / result["raw_disk_write_gbps"]
    result["disk_read_vs_raw_write"] = result["disk_read_gbps"] / result["raw_disk_write_gbps"]
    unlimited = result["hit_rate_unlimited"]
    result["tiered_vs_unlimited"] = result["hit_rate_tiered"] / unlimited if unlimited else 0.0
    return result
