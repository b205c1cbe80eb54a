"""Fixtures for the KV cache tests: stores that close themselves, a shared-memory leak check."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kv_factories import StoreFactory, shm_segments, small_layout

from engine.data.kv.host import SHM_DIR
from engine.data.kv.layout import KVLayout
from engine.data.kv.policy import EvictionPolicy
from engine.data.kv.store import DiskTierConfig, KVStore, KVStoreConfig, WritePolicy
from engine.data.kv.tier import Capacity


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
