"""KVStore: eviction and demotion order per policy, round trips, locks, prefetch, metrics."""

from __future__ import annotations

import pytest
import torch
from kv_factories import StoreFactory, make_keys, make_page, same_bytes, small_layout

from engine.data.kv.errors import KVCapacityError, KVLockError, KVPageNotFound, KVTimeoutError
from engine.data.kv.policy import EvictionPolicy
from engine.data.kv.store import KVEvent, KVStore, KVStoreConfig, WritePolicy
from engine.data.kv.tier import Capacity, Tier

LAYOUT = small_layout()
NAMES = "ABCDEFGHIJ"
KEYS = dict(zip(NAMES, make_keys(len(NAMES)), strict=True))
PAGES = {name: make_page(LAYOUT, seed) for seed, name in enumerate(NAMES)}
BY_KEY = {key: name for name, key in KEYS.items()}


def record(store: KVStore) -> list[tuple[str, str, str]]:
    events: list[tuple[str, str, str]] = []

    def listener(event: KVEvent) -> None:
        events.append((event.kind.value, BY_KEY[event.page], event.tier.label))

    store.add_listener(listener)
    return events


def put(store: KVStore, *names: str) -> None:
    for name in names:
        store.put(KEYS[name], PAGES[name])


def get(store: KVStore, *names: str) -> None:
    for name in names:
        page = store.get(KEYS[name])
        assert page is not None and same_bytes(page, PAGES[name])


def where(store: KVStore, *names: str) -> dict[str, tuple[str, ...]]:
    return {name: tuple(t.label for t in store.tiers_of(KEYS[name])) for name in names}


# Device holds 3, host 3, disk 10. Puts A B C, then uses A twice, B once, C once:
# LRU order is A B C (A least recent), LFU counts are A=3 B=2 C=2.
EXPECTED_EVENTS = {
    EvictionPolicy.LRU: [
        ("demoted", "A", "host"), ("evicted", "A", "device"), ("stored", "D", "device"),
        ("demoted", "B", "host"), ("evicted", "B", "device"), ("stored", "E", "device"),
        ("demoted", "C", "host"), ("evicted", "C", "device"), ("stored", "F", "device"),
        ("demoted", "A", "disk"), ("evicted", "A", "host"),
        ("demoted", "D", "host"), ("evicted", "D", "device"), ("stored", "G", "device"),
    ],
    EvictionPolicy.LFU: [
        ("demoted", "B", "host"), ("evicted", "B", "device"), ("stored", "D", "device"),
        ("demoted", "D", "host"), ("evicted", "D", "device"), ("stored", "E", "device"),
        ("demoted", "E", "host"), ("evicted", "E", "device"), ("stored", "F", "device"),
        ("demoted", "D", "disk"), ("evicted", "D", "host"),
        ("demoted", "F", "host"), ("evicted", "F", "device"), ("stored", "G", "device"),
    ],
}  # fmt: skip
EXPECTED_PLACES = {
    EvictionPolicy.LRU: {"A": ("disk",), "B": ("host",), "C": ("host",), "D": ("host",),
                         "E": ("device",), "F": ("device",), "G": ("device",)},
    EvictionPolicy.LFU: {"A": ("device",), "B": ("host",), "C": ("device",), "D": ("disk",),
                         "E": ("host",), "F": ("host",), "G": ("device",)},
}  # fmt: skip


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_exact_eviction_and_demotion_order(make_store: StoreFactory, policy: EvictionPolicy) -> None:
    store = make_store(device=3, host=3, disk=10, policy=policy)
    put(store, "A", "B", "C")
    get(store, "A", "A", "B", "C")
    events = record(store)
    put(store, "D", "E", "F", "G")
    assert events == EXPECTED_EVENTS[policy]
    assert where(store, *"ABCDEFG") == EXPECTED_PLACES[policy]


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_lower_tier_hit_promotes_and_keeps_the_lower_copy(
    make_store: StoreFactory, policy: EvictionPolicy
) -> None:
    store = make_store(device=2, host=2, disk=10, policy=policy)
    put(store, "A", "B", "C", "D", "E")  # A, B, C went down; A and B are on disk
    assert where(store, "A", "C") == {"A": ("disk",), "C": ("host",)}
    events = record(store)
    get(store, "A")
    assert events[-1] == ("promoted", "A", "device")
    assert where(store, "A")["A"] == ("device", "disk")
    metrics = store.metrics()
    assert metrics["device.promotions"] == 1
    assert metrics["disk.hit_pages"] == 1


@pytest.mark.parametrize("write", list(WritePolicy))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "uint8"])
def test_bit_exact_round_trip_through_every_tier(
    make_store: StoreFactory, write: WritePolicy, dtype: str
) -> None:
    layout = small_layout(dtype)
    store = make_store(device=2, host=2, disk=8, write=write, layout=layout)
    keys = make_keys(6)
    pages = [make_page(layout, 100 + i) if dtype != "uint8" else torch.randint(0, 256, layout.page_shape,
             dtype=torch.uint8) for i in range(6)]  # fmt: skip
    for key, page in zip(keys, pages, strict=True):
        store.put(key, page)
    seen = {tier: 0 for tier in Tier}
    for key, page in zip(keys, pages, strict=True):
        for tier in store.tiers_of(key):
            seen[tier] += 1
        copy = store.get(key, promote=False)  # read from wherever it lives now
        assert copy is not None and same_bytes(copy, page)
    assert all(seen.values()), seen
    for key, page in zip(keys, pages, strict=True):  # and promoted back up through the device tier
        copy = store.get(key)
        assert copy is not None and same_bytes(copy, page)
        assert Tier.DEVICE in store.tiers_of(key)


def test_write_through_stores_in_every_tier_at_once(make_store: StoreFactory) -> None:
    store = make_store(device=2, host=2, disk=4, write=WritePolicy.WRITE_THROUGH)
    events = record(store)
    put(store, "A")
    assert events == [("stored", "A", "device"), ("stored", "A", "host"), ("stored", "A", "disk")]
    put(store, "B", "C")
    # The host copy is already there: evicting A from the device copies nothing.
    assert ("demoted", "A", "host") in events
    assert store.metrics()["host.bytes_written"] == 3 * LAYOUT.page_nbytes


def test_write_back_writes_lower_tiers_only_on_eviction(make_store: StoreFactory) -> None:
    store = make_store(device=2, host=2, disk=4)
    put(store, "A", "B")
    assert where(store, "A", "B") == {"A": ("device",), "B": ("device",)}
    assert store.metrics()["host.bytes_written"] == 0


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_locked_pages_are_never_evicted(make_store: StoreFactory, policy: EvictionPolicy) -> None:
    store = make_store(device=2, host=None, disk=None, policy=policy)
    put(store, "A", "B")
    slots = store.lock([KEYS["A"]])
    assert slots == [0]
    assert same_bytes(store.view(KEYS["A"]), PAGES["A"])
    assert same_bytes(store.device_pool[slots[0]], PAGES["A"])
    put(store, "C")  # A is least recently used and least frequent, but locked
    assert where(store, "A", "B", "C") == {"A": ("device",), "B": (), "C": ("device",)}
    store.lock([KEYS["C"]])
    with pytest.raises(KVCapacityError, match="device tier is full: capacity 2 pages, 2 locked") as err:
        put(store, "D")
    assert (err.value.tier, err.value.capacity_pages, err.value.locked_pages) == ("device", 2, 2)
    store.unlock([KEYS["C"]])
    put(store, "D")
    assert where(store, "A", "C", "D") == {"A": ("device",), "C": (), "D": ("device",)}


def test_lock_is_all_or_nothing_and_nests(make_store: StoreFactory) -> None:
    store = make_store(device=2, host=2, disk=None)
    put(store, "A", "B", "C")  # A demoted to host
    with pytest.raises(KVPageNotFound):
        store.lock([KEYS["B"], KEYS["J"]])
    assert store.lock_count(KEYS["B"]) == 0
    store.lock([KEYS["A"], KEYS["A"]])  # promotes A from host
    assert store.lock_count(KEYS["A"]) == 2
    store.unlock([KEYS["A"]])
    assert store.lock_count(KEYS["A"]) == 1
    with pytest.raises(KVLockError):
        store.unlock([KEYS["B"]])
    with pytest.raises(KVLockError):
        store.view(KEYS["C"])
    with pytest.raises(KVLockError):
        store.remove(KEYS["A"])


def test_unlock_is_all_or_nothing(make_store: StoreFactory) -> None:
    store = make_store(device=2, host=2, disk=None)
    put(store, "A", "B")
    store.lock([KEYS["A"]])
    with pytest.raises(KVLockError, match="unlock of pages that are not locked"):
        store.unlock([KEYS["A"], KEYS["B"]])  # B holds no lock: A keeps its own
    with pytest.raises(KVLockError):
        store.unlock([KEYS["A"], KEYS["A"]])  # two given back, one held
    assert (store.lock_count(KEYS["A"]), store.lock_count(KEYS["B"])) == (1, 0)
    store.unlock([KEYS["A"]])
    assert store.lock_count(KEYS["A"]) == 0


def test_capacity_error_when_a_lock_needs_more_room_than_there_is(make_store: StoreFactory) -> None:
    store = make_store(device=2, host=4, disk=None)
    put(store, "A", "B", "C", "D")
    with pytest.raises(KVCapacityError):
        store.lock([KEYS[n] for n in "ABC"])
    assert all(store.lock_count(KEYS[n]) == 0 for n in "ABCD")


def test_capacity_in_bytes() -> None:
    config = KVStoreConfig(LAYOUT, device_capacity=Capacity(bytes=3 * LAYOUT.page_nbytes + 7))
    with KVStore(config) as store:
        assert store.metrics()["device.capacity_pages"] == 3


def test_prefetch_promotes_in_the_background(make_store: StoreFactory) -> None:
    store = make_store(device=3, host=4, disk=None)
    put(store, "A", "B", "C", "D", "E")  # A and B went to host
    handle = store.prefetch([KEYS["A"], KEYS["E"], KEYS["J"]], lock=True)
    result = handle.wait(timeout=10)
    assert (result.loaded, result.resident, result.missing, result.locked) == (1, 1, (KEYS["J"],), 2)
    assert handle.done()
    assert Tier.DEVICE in store.tiers_of(KEYS["A"])
    assert store.lock_count(KEYS["A"]) == 1 and store.lock_count(KEYS["E"]) == 1


def test_prefetch_timeout_is_a_typed_error(make_store: StoreFactory) -> None:
    store = make_store(device=3, host=4, disk=None)
    put(store, "A", "B", "C", "D")
    with store._mutex:  # hold the store so the prefetch cannot finish
        handle = store.prefetch([KEYS["A"]])
        with pytest.raises(KVTimeoutError):
            handle.wait(timeout=0.05)
    assert handle.wait(timeout=10).loaded == 1


def test_metrics_count_lookups_hits_and_bytes(make_store: StoreFactory) -> None:
    store = make_store(device=2, host=2, disk=4)
    put(store, "A", "B", "C", "D")  # A, B in host; C, D on device
    result = store.lookup([KEYS[n] for n in "DCAJ"])
    assert result.prefix_pages == 3
    assert result.tiers == (Tier.DEVICE, Tier.DEVICE, Tier.HOST)
    m = store.metrics()
    assert (m["device.lookups"], m["device.hit_pages"], m["device.hit_rate"]) == (4, 2, 0.5)
    assert (m["host.lookups"], m["host.hit_pages"]) == (2, 1)
    assert (m["disk.lookups"], m["disk.hit_pages"]) == (1, 0)
    assert m["device.evictions"] == 2 and m["host.demotions"] == 2
    assert m["device.bytes_used"] == 2 * LAYOUT.page_nbytes
    assert m["host.capacity_bytes"] == 2 * LAYOUT.page_nbytes
    assert m["host.bytes_transferred"] == 2 * LAYOUT.page_nbytes
    assert m["host.transfer_latency_ms"] > 0
    assert all(isinstance(v, int | float) for v in m.values())


def test_resident_run_is_the_leading_run_any_tier_holds_and_counts_no_lookup(make_store: StoreFactory) -> None:
    store = make_store(device=2, host=2, disk=4)
    put(store, "A", "B", "C", "D")  # A, B in host; C, D on device
    before = store.metrics()
    assert store.resident_run([KEYS[n] for n in "DCAJB"]) == 3  # device, device, host, then a gap
    assert store.resident_run([KEYS[n] for n in "JA"]) == 0
    assert store.resident_run([]) == 0
    assert where(store, "A", "B", "C", "D") == {"A": ("host",), "B": ("host",), "C": ("device",), "D": ("device",)}
    assert store.metrics() == before


def test_lock_as_a_lookup_counts_hits_in_the_tier_that_held_each_page(make_store: StoreFactory) -> None:
    store = make_store(device=2, host=2, disk=4)
    put(store, "A", "B", "C", "D")  # A, B in host; C, D on device
    store.lock([KEYS["C"], KEYS["D"]])  # a plain lock counts nothing
    assert store.metrics()["device.lookups"] == 0
    store.unlock([KEYS["C"], KEYS["D"]])
    store.lock([KEYS["D"], KEYS["A"]], lookup=True)  # D held by the device tier, A promoted from host
    store.record_miss()  # the prefix search then found no further page
    m = store.metrics()
    assert (m["device.lookups"], m["device.hit_pages"]) == (3, 1)
    assert (m["host.lookups"], m["host.hit_pages"]) == (2, 1)
    assert (m["disk.lookups"], m["disk.hit_pages"]) == (1, 0)
    with pytest.raises(KVPageNotFound):  # a failed lock counts nothing
        store.lock([KEYS["J"]], lookup=True)
    assert store.metrics()["device.lookups"] == 3


def test_remove_and_resident_pages(make_store: StoreFactory) -> None:
    store = make_store(device=1, host=2, disk=4, write=WritePolicy.WRITE_THROUGH)
    put(store, "A", "B")
    assert store.resident_pages() == {KEYS["A"]: Tier.HOST, KEYS["B"]: Tier.DEVICE}
    events = record(store)
    store.remove(KEYS["A"])
    assert events == [("dropped", "A", "host"), ("dropped", "A", "disk")]
    assert not store.contains(KEYS["A"])
    assert store.get(KEYS["A"]) is None


def test_prefetch_and_foreground_traffic_interleave_safely(make_store: StoreFactory) -> None:
    store = make_store(device=4, host=8, disk=32)
    keys = make_keys(24, start=5000)
    pages = [make_page(LAYOUT, 500 + i) for i in range(24)]
    for key, page in zip(keys, pages, strict=True):
        store.put(key, page)
    handles = [store.prefetch(keys[i : i + 3]) for i in range(0, 24, 3)]
    for key, page in zip(reversed(keys), reversed(pages), strict=True):  # foreground reads meanwhile
        copy = store.get(key)
        assert copy is not None and same_bytes(copy, page)
    for handle in handles:
        result = handle.wait(timeout=30)
        assert result.missing == ()
    for key, page in zip(keys, pages, strict=True):
        copy = store.get(key, promote=False)
        assert copy is not None and same_bytes(copy, page)


def test_cancelled_prefetch_reports_what_it_did(make_store: StoreFactory) -> None:
    store = make_store(device=3, host=4, disk=None)
    put(store, "A", "B", "C", "D", "E")  # A and B in host
    with store._mutex:  # the job cannot start its first page before the cancel
        handle = store.prefetch([KEYS["A"], KEYS["B"]])
        handle.cancel()
    result = handle.wait(timeout=10)
    assert result.cancelled and result.loaded == 0
    assert Tier.DEVICE not in store.tiers_of(KEYS["A"])
