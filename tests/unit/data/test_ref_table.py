"""`RefTable`: ref ids, leases, and the entries a sweep takes out, in exact state."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.data.ref_table import RefTable, StoredTensor, generation_of
from engine.data.wire import RefId, TensorHeader

HEADER = TensorHeader("uint8", (8,), (1,), 8)


def make_table() -> RefTable:
    return RefTable("tcp://127.0.0.1:1", "h", default_lease_s=10.0, max_lease_s=100.0, wall_clock=lambda: 1.7e9)


def add(table: RefTable, expires: float) -> StoredTensor:
    ref = table.new_ref(table.next_id(), HEADER, 10.0, "cpu")
    stored = StoredTensor(ref, HEADER, np.zeros(8, np.uint8), None, expires)
    table.add(stored)
    return stored


def test_ids_count_up_within_an_epoch_and_name_their_generation() -> None:
    table = make_table()
    ids = [table.next_id() for _ in range(3)]
    epochs = {i.split(".")[0] for i in ids}
    assert len(epochs) == 1 and [i.split(".")[1] for i in ids] == ["0", "1", "2"]
    assert [generation_of(i) for i in ids] == [1, 2, 3]
    assert generation_of(RefId("ab12.41")) == 42


def test_a_ref_carries_its_owner_host_and_lease_end() -> None:
    table = make_table()
    ref = table.new_ref(RefId("e.7"), HEADER, 25.0, "cpu")
    assert (ref.owner, ref.id, ref.host, ref.dtype, ref.shape, ref.nbytes, ref.lease_expires_at, ref.shm) == (
        "tcp://127.0.0.1:1", "e.7", "h", "uint8", (8,), 8, 1.7e9 + 25.0, None)
    assert table.new_ref(RefId("e.8"), HEADER, math.inf, "cuda:0").lease_expires_at == math.inf


@pytest.mark.parametrize("lease", [0.0, -1.0, 100.5])
def test_a_lease_outside_the_range_is_refused(lease: float) -> None:
    with pytest.raises(ValueError, match=rf"lease must be in \(0, 100.0\] seconds, got {lease}"):
        make_table().lease_seconds(lease)


def test_default_lease() -> None:
    assert make_table().lease_seconds(None) == 10.0


def test_expired_takes_out_each_ended_lease_once_in_order() -> None:
    table = make_table()
    late, early, extended, kept = add(table, 5.0), add(table, 3.0), add(table, 1.0), add(table, math.inf)
    table.extend(extended, 4.0)  # two heap items for it now, both ended by 6
    assert table.expired(2.0) == []
    assert table.expired(6.0) == [early, extended, late]
    assert len(table) == 1 and kept.ref.id in table and table.live_bytes == 8
    assert table.expired(1e12) == []  # a kept entry (no lease) never expires


def test_remove_and_clear_keep_the_byte_count() -> None:
    table = make_table()
    first, _second = add(table, 5.0), add(table, 5.0)
    table.remove(first)
    assert (len(table), table.live_bytes, table.get(first.ref.id)) == (1, 8, None)
    table.clear()
    assert (len(table), table.live_bytes, table.expired(10.0)) == (0, 0, [])
