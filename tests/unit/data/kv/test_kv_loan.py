"""KVStore.lend: pages lent in place for a zero-copy send. The loan reads the slots' own bytes
(one view per run of adjacent slots), pins them against eviction, and a page removed meanwhile
leaves the store at once while its slot, and its bytes, stay until the loan is given back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_factories import StoreFactory, make_keys, make_page, raw, small_layout

from engine.data.kv.errors import KVCapacityError
from engine.data.kv.store import KVStore
from engine.data.kv.tier import Tier

LAYOUT = small_layout()
KEYS = make_keys(8)
PAGES = [make_page(LAYOUT, seed) for seed in range(8)]


def put(store: KVStore, *seeds: int) -> None:
    for seed in seeds:
        store.put(KEYS[seed], PAGES[seed])


def written(*seeds: int) -> bytes:
    """The bytes the pages were written with, end to end: the reference a loan must read."""
    return b"".join(raw(PAGES[seed]).numpy().tobytes() for seed in seeds)


def lent_bytes(runs: tuple[np.ndarray, ...]) -> bytes:
    return b"".join(run.tobytes() for run in runs)


def test_a_loan_reads_the_slots_in_place_one_view_per_run_of_adjacent_slots(make_store: StoreFactory) -> None:
    store = make_store(device=4, host=4, disk=None)
    put(store, 0, 1, 2, 3, 4, 5)  # 0 and 1 demoted to the host tier; device slots 0, 1 reused
    assert [store.tiers_of(KEYS[s]) for s in (0, 1, 2, 4)] == [(Tier.HOST,), (Tier.HOST,), (Tier.DEVICE,),
                                                                 (Tier.DEVICE,)]
    lookups = store.metrics()["device.lookups"]

    loan = store.lend([KEYS[s] for s in (0, 1, 2, 3)])

    assert loan is not None and loan.pages == tuple(KEYS[:4])
    # host slots 0-1 (one run), then device slots 2-3 (pages 2, 3 went to the slots 2, 3)
    assert [run.nbytes for run in loan.runs] == [2 * LAYOUT.page_nbytes, 2 * LAYOUT.page_nbytes]
    assert lent_bytes(loan.runs) == written(0, 1, 2, 3) and loan.nbytes == 4 * LAYOUT.page_nbytes
    assert np.shares_memory(loan.runs[1], store.device_pool.view(torch.uint8).numpy())  # no copy
    assert store.metrics()["device.lookups"] == lookups + 4  # each page looked up, and read where it is
    assert [store.tiers_of(KEYS[s]) for s in (0, 1)] == [(Tier.HOST,), (Tier.HOST,)]  # not promoted
    loan.release()
    loan.release()  # idempotent
    assert loan.released


def test_nothing_is_lent_unless_every_page_is_in_host_memory(make_store: StoreFactory) -> None:
    store = make_store(device=1, host=None, disk=4)
    put(store, 0, 1)  # page 0 only on the disk now
    assert store.lend([KEYS[1], KEYS[0]]) is None
    assert store.lend([KEYS[1], KEYS[7]]) is None  # page 7: held nowhere
    put(store, 2)  # nothing stayed pinned: page 1 is evicted as usual
    assert store.tiers_of(KEYS[1]) == (Tier.DISK,)


def test_eviction_passes_lent_pages_over_until_they_are_given_back(make_store: StoreFactory) -> None:
    store = make_store(device=2, host=None, disk=None)
    put(store, 0, 1)
    loan = store.lend([KEYS[0]])
    assert loan is not None
    put(store, 2)  # page 0 is the least recently used, but lent: page 1 goes
    assert (store.contains(KEYS[0]), store.contains(KEYS[1])) == (True, False)
    loan_2 = store.lend([KEYS[2]])
    assert loan_2 is not None
    with pytest.raises(KVCapacityError, match="2 locked"):
        put(store, 3)
    loan.release()
    loan_2.release()
    put(store, 3)
    assert store.contains(KEYS[3])


def test_a_page_removed_while_lent_keeps_its_slot_and_bytes_until_the_loan_ends(make_store: StoreFactory) -> None:
    """What makes a zero-copy send safe: a page freed (removed) mid-send is gone from the
    store at once, but no later write lands in its slot while the loan lasts."""
    store = make_store(device=3, host=None, disk=None)
    put(store, 0, 1)
    loan = store.lend([KEYS[0], KEYS[1]])
    assert loan is not None
    store.remove(KEYS[0])
    store.remove(KEYS[1])
    assert store.resident_pages() == {}
    put(store, 2, 3, 4, 5)  # only the one free slot turns over: evictions, no write into a lent slot
    assert lent_bytes(loan.runs) == written(0, 1)
    assert store.resident_pages() == {KEYS[5]: Tier.DEVICE}

    loan.release()
    put(store, 6, 7)  # the two slots are free again
    assert set(store.resident_pages()) == {KEYS[5], KEYS[6], KEYS[7]}
    assert lent_bytes(loan.runs) != written(0, 1)  # and were written: the views were the slots


def test_a_loan_outliving_its_store_is_harmless(make_store: StoreFactory) -> None:
    store = make_store(device=2, host=2, disk=None)
    put(store, 0)
    loan = store.lend([KEYS[0]])
    assert loan is not None
    store.close()
    loan.release()
    assert loan.released
