"""Disk tier: survives a restart, detects torn and corrupted pages, guards its file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from kv_factories import StoreFactory, make_keys, make_page, same_bytes, small_layout

from engine.data.kv.disk import Checksum, DiskTier, page_checksum
from engine.data.kv.errors import KVConfigError
from engine.data.kv.store import DiskTierConfig, KVStore, KVStoreConfig, WritePolicy
from engine.data.kv.tier import Capacity, Tier

LAYOUT = small_layout()
KEYS = make_keys(5)
PAGES = [make_page(LAYOUT, 7 + i) for i in range(5)]


def damage(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def disk_tier(store: KVStore) -> DiskTier:
    tier = store._tiers.levels[Tier.DISK].tier
    assert isinstance(tier, DiskTier)
    return tier


def test_pages_survive_a_restart_in_lru_order(make_store: StoreFactory, tmp_path: Path) -> None:
    first = make_store(device=1, host=None, disk=3, write=WritePolicy.WRITE_THROUGH, disk_dir=tmp_path)
    for key, page in zip(KEYS[:3], PAGES[:3], strict=True):
        first.put(key, page)
    first.close()

    second = make_store(device=1, host=None, disk=3, write=WritePolicy.WRITE_THROUGH, disk_dir=tmp_path)
    assert disk_tier(second).recovered_pages == 3
    assert second.lookup(KEYS[:3]).tiers == (Tier.DISK, Tier.DISK, Tier.DISK)
    for key, page in zip(KEYS[:3], PAGES[:3], strict=True):
        copy = second.get(key, promote=False)
        assert copy is not None and same_bytes(copy, page)
    second.put(KEYS[3], PAGES[3])  # the disk is full: the oldest write (KEYS[0]) goes
    assert second.tiers_of(KEYS[0]) == ()
    assert second.tiers_of(KEYS[3]) == (Tier.DEVICE, Tier.DISK)


def test_evicted_pages_do_not_come_back_after_restart(make_store: StoreFactory, tmp_path: Path) -> None:
    first = make_store(device=1, host=None, disk=2, disk_dir=tmp_path)
    for key, page in zip(KEYS[:4], PAGES[:4], strict=True):
        first.put(key, page)
    resident = set(first.resident_pages())
    first.close()
    second = make_store(device=1, host=None, disk=2, disk_dir=tmp_path)
    assert set(second.resident_pages()) == resident - {KEYS[3]}  # the device page was never written down


@pytest.mark.parametrize("checksum", list(Checksum))
@pytest.mark.parametrize("byte", [0, 301, LAYOUT.page_nbytes - 1])
def test_corrupted_page_is_a_miss_never_data(tmp_path: Path, checksum: Checksum, byte: int) -> None:
    store = KVStore(
        KVStoreConfig(
            LAYOUT,
            device_capacity=Capacity(pages=1),
            disk=DiskTierConfig(tmp_path, Capacity(pages=4), checksum=checksum),
            write=WritePolicy.WRITE_THROUGH,
        )
    )
    try:
        check_corruption_is_a_miss(store, byte)
    finally:
        store.close()


def check_corruption_is_a_miss(store: KVStore, byte: int) -> None:
    store.put(KEYS[0], PAGES[0])
    store.put(KEYS[1], PAGES[1])  # KEYS[0] now only on disk
    tier = disk_tier(store)
    with open(tier.path, "rb") as f:
        f.seek(tier.payload_offset(KEYS[0]) + byte)
        original = f.read(1)
    damage(tier.path, tier.payload_offset(KEYS[0]) + byte, bytes([original[0] ^ 0x10]))
    assert store.get(KEYS[0]) is None
    assert store.tiers_of(KEYS[0]) == ()
    assert store.metrics()["disk.dropped_corrupt"] == 1
    assert store.lookup([KEYS[0]]).prefix_pages == 0


def test_torn_page_and_broken_record_are_misses_after_restart(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    store = make_store(device=1, host=None, disk=4, write=WritePolicy.WRITE_THROUGH, disk_dir=tmp_path)
    for key, page in zip(KEYS[:3], PAGES[:3], strict=True):
        store.put(key, page)
    tier = disk_tier(store)
    path, torn_at = tier.path, tier.payload_offset(KEYS[1]) + LAYOUT.page_nbytes // 2
    record_at = tier.record_offset(KEYS[2])
    store.close()
    # A write torn halfway: the second half of the page never reached the file.
    damage(path, torn_at, bytes(LAYOUT.page_nbytes // 2))
    # A record whose bytes were damaged: its own checksum fails.
    damage(path, record_at + 20, b"\x00\x00\x00\x00")

    again = make_store(device=1, host=None, disk=4, disk_dir=tmp_path)
    assert disk_tier(again).discarded_records == 1
    assert again.tiers_of(KEYS[2]) == ()
    assert again.tiers_of(KEYS[1]) == (Tier.DISK,)  # the record is intact, the payload is not
    assert again.get(KEYS[1]) is None
    copy = again.get(KEYS[0])
    assert copy is not None and same_bytes(copy, PAGES[0])


def test_second_open_of_the_same_directory_is_refused(tmp_path: Path) -> None:
    first = DiskTier(LAYOUT, 4, tmp_path)
    try:
        with pytest.raises(KVConfigError, match="in use by another process"):
            DiskTier(LAYOUT, 4, tmp_path)
    finally:
        first.close()
    DiskTier(LAYOUT, 4, tmp_path).close()


def test_different_capacity_is_refused_and_other_layouts_get_their_own_file(tmp_path: Path) -> None:
    DiskTier(LAYOUT, 4, tmp_path).close()
    with pytest.raises(KVConfigError, match="another layout or capacity"):
        DiskTier(LAYOUT, 8, tmp_path)
    other = DiskTier(small_layout("float16"), 8, tmp_path)  # its own file, named by its layout
    other.close()
    assert len(list(tmp_path.glob("kv-*.seg"))) == 2


@pytest.mark.parametrize("nbytes", [8192, 8192 + 13])
def test_blocksum_checksum_catches_flips_zeroed_and_swapped_blocks(nbytes: int) -> None:
    gen = torch.Generator().manual_seed(3)
    page = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    good = page_checksum(Checksum.BLOCKSUM64, memoryview(page.numpy()))

    def differs(mutated: torch.Tensor) -> bool:
        return page_checksum(Checksum.BLOCKSUM64, memoryview(mutated.numpy())) != good

    for position in (0, 4095, 4096, nbytes - 1):
        for bit in (0, 7):
            flipped = page.clone()
            flipped[position] ^= 1 << bit
            assert differs(flipped)
    torn = page.clone()
    torn[4096:] = 0
    assert differs(torn)
    swapped = page.clone()
    swapped[:4096], swapped[4096:8192] = page[4096:8192].clone(), page[:4096].clone()
    assert differs(swapped)
    assert differs(page[:-1].clone())
