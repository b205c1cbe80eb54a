"""Factories for the KV cache tests: small layouts, seeded pages, stores that clean up."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.data.kv.host import SHM_DIR
from engine.data.kv.keys import PageHash, page_hashes
from engine.data.kv.layout import KVLayout
from engine.data.kv.policy import EvictionPolicy
from engine.data.kv.store import DiskTierConfig, KVStore, KVStoreConfig, WritePolicy
from engine.data.kv.tier import Capacity

SHM_PREFIX = "omniflow-kv-"


def small_layout(dtype: str = "bfloat16") -> KVLayout:
    return KVLayout(page_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype)


def make_page(layout: KVLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.page_shape, generator=gen).to(layout.torch_dtype)


def make_keys(n: int, page_size: int = 4, start: int = 1000) -> list[PageHash]:
    return page_hashes(list(range(start, start + n * page_size)), page_size)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, for bit-exact comparisons (NaN-safe, dtype-agnostic)."""
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(raw(a), raw(b))


def shm_segments() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX)}


StoreFactory = Callable[..., KVStore]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[StoreFactory]:
    """Build stores with pages capacities; every store is closed at teardown."""
    stores: list[KVStore] = []

    def factory(
        device: int = 3,
        host: int | None = 3,
        disk: int | None = 10,
        policy: EvictionPolicy = EvictionPolicy.LRU,
        write: WritePolicy = WritePolicy.WRITE_BACK,
        layout: KVLayout | None = None,
        disk_dir: Path | None = None,
    ) -> KVStore:
        config = KVStoreConfig(
            layout=layout or small_layout(),
            device_capacity=Capacity(pages=device),
            host_capacity=Capacity(pages=host) if host else None,
            disk=DiskTierConfig(disk_dir or tmp_path / "kv", Capacity(pages=disk)) if disk else None,
            eviction=policy,
            write=write,
        )
        store = KVStore(config)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    before = shm_segments()
    yield
    leaked = shm_segments() - before
    assert not leaked, f"host KV segments left in {SHM_DIR}: {sorted(leaked)}"
