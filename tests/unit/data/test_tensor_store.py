"""Tensor store and shared-memory segments: refs, leases, pooling and reclaim, in one process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine.data.codec import KiB, MiB, UnsupportedTensor
from engine.data.shm import (
    PAGE,
    SHM_ROOT,
    SegmentAllocator,
    SegmentGone,
    SegmentMapper,
    list_segments,
    parse_segment_name,
    process_start_token,
    reclaim_dead_segments,
    size_class,
)
from engine.data.store_memory import DATA_OFFSET
from engine.data.tensor_store import RefNotFound, StoreConfig, StoreError, TensorStore


@dataclass(slots=True)
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class FakeSend:
    done: bool = False


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_store(clock: FakeClock, **config: object) -> TensorStore:
    defaults: dict[str, object] = {"default_lease_s": 10.0, "pool_bytes": 64 * MiB, "pool_idle_s": 5.0}
    defaults.update(config)
    return TensorStore("tcp://127.0.0.1:1", StoreConfig(**defaults), host="h", clock=clock,  # type: ignore[arg-type]
                       wall_clock=lambda: 1.7e9 + clock.now)


@pytest.fixture
def store(clock: FakeClock) -> Iterator[TensorStore]:
    s = make_store(clock)
    yield s
    s.close()


def big(value: float = 1.0, n: int = 64 * 1024) -> np.ndarray:
    """Larger than the inline limit (64 KiB): lives in shared memory."""
    return np.full(n, value, np.float32)


def own_segments() -> list[str]:
    return list_segments(pid=os.getpid())


def test_put_returns_a_ref_describing_the_tensor(store: TensorStore, clock: FakeClock) -> None:
    array = np.arange(12, dtype=np.int64).reshape(3, 4)
    ref = store.put(array, lease_s=5.0)
    assert (ref.owner, ref.dtype, ref.shape, ref.nbytes, ref.host, ref.device) == (
        "tcp://127.0.0.1:1", "int64", (3, 4), 96, "h", "cpu")
    assert ref.lease_expires_at == pytest.approx(1.7e9 + clock.now + 5.0)
    entry = store.get(ref.id)
    assert entry.data.tobytes() == array.tobytes() and entry.segment is None
    assert not entry.data.flags.writeable


def test_put_copies_so_the_producer_may_reuse_its_buffer(store: TensorStore) -> None:
    array = np.zeros(4, np.float32)
    ref = store.put(array)
    array[:] = 7
    assert store.get(ref.id).data.view(np.float32).tolist() == [0, 0, 0, 0]


def test_ref_ids_are_unique_across_stores(clock: FakeClock) -> None:
    a, b = make_store(clock, use_shm=False), make_store(clock, use_shm=False)
    ids = {a.put(np.zeros(1)).id for _ in range(3)} | {b.put(np.zeros(1)).id for _ in range(3)}
    assert len(ids) == 6


def test_release_frees_once(store: TensorStore) -> None:
    ref = store.put(np.ones(3))
    assert store.release(ref.id) is True
    assert store.release(ref.id) is False
    with pytest.raises(RefNotFound):
        store.get(ref.id)


def test_sweep_frees_exactly_the_expired_leases(store: TensorStore, clock: FakeClock) -> None:
    short = store.put(np.ones(1), lease_s=1.0)
    long = store.put(np.ones(1), lease_s=3.0)
    extended = store.put(np.ones(1), lease_s=1.0)
    clock.now += 0.5
    store.extend(extended.id, 10.0)
    assert store.sweep() == []
    clock.now += 0.6
    assert store.sweep() == [short.id]
    clock.now += 2.0
    assert store.sweep() == [long.id]
    assert len(store) == 1 and extended.id in store


def test_expired_ref_is_gone_even_before_a_sweep(store: TensorStore, clock: FakeClock) -> None:
    ref = store.put(np.ones(1), lease_s=1.0)
    clock.now += 1.0
    with pytest.raises(RefNotFound):
        store.get(ref.id)
    with pytest.raises(RefNotFound):
        store.extend(ref.id, 5.0)


def test_lease_must_be_positive_and_bounded(store: TensorStore) -> None:
    with pytest.raises(ValueError):
        store.put(np.ones(1), lease_s=0)
    with pytest.raises(ValueError):
        store.put(np.ones(1), lease_s=1e9)


def test_large_tensors_live_in_named_segments(store: TensorStore) -> None:
    ref = store.put(big(3.0))
    entry = store.get(ref.id)
    assert entry.segment is not None
    owner = parse_segment_name(entry.segment.name)
    assert owner is not None and owner.pid == os.getpid() and owner.alive()
    assert own_segments() == [entry.segment.name]
    assert ref.shm is not None and ref.shm.segment == entry.segment.name and ref.shm.offset == DATA_OFFSET
    with open(os.path.join(SHM_ROOT, entry.segment.name), "rb") as f:
        raw = f.read(DATA_OFFSET + ref.nbytes)
    assert int.from_bytes(raw[:8], "little") == ref.shm.generation > 0
    assert np.frombuffer(raw[DATA_OFFSET:], np.float32).tolist() == big(3.0).tolist()
    store.release(ref.id)
    with open(os.path.join(SHM_ROOT, entry.segment.name), "rb") as f:
        assert int.from_bytes(f.read(8), "little") == 0  # in-place readers must ask the owner


def test_released_segment_is_pooled_then_reused_by_a_similar_tensor(store: TensorStore) -> None:
    first = store.put(big(1.0))
    name = store.get(first.id).segment.name  # type: ignore[union-attr]
    store.release(first.id)
    assert store.stats().pooled_segments == 1 and own_segments() == [name]
    second = store.put(big(2.0, n=64 * 1024 - 16))  # same size class
    assert store.get(second.id).segment.name == name  # type: ignore[union-attr]
    assert store.get(second.id).data.view(np.float32)[0] == 2.0
    third = store.put(big(3.0, n=4 * 64 * 1024))  # another size class: a new segment
    assert store.get(third.id).segment.name != name  # type: ignore[union-attr]


def test_pool_is_trimmed_when_idle_and_bounded_in_bytes(clock: FakeClock) -> None:
    store = make_store(clock, pool_bytes=700 * KiB, pool_idle_s=5.0)
    try:
        refs = [store.put(big(float(i))) for i in range(3)]  # 256 KiB + a page: 320 KiB segments
        for ref in refs:
            store.release(ref.id)
        stats = store.stats()
        assert (stats.pooled_segments, stats.pooled_bytes, len(own_segments())) == (2, 640 * KiB, 2)
        clock.now += 4.9
        store.sweep()
        assert len(own_segments()) == 2
        clock.now += 0.2
        store.sweep()
        assert own_segments() == [] and store.stats().segments == 0
    finally:
        store.close()


def test_segment_read_by_a_send_is_not_recycled_until_the_send_is_done(store: TensorStore) -> None:
    ref = store.put(big(1.0))
    entry = store.get(ref.id)
    send = FakeSend()
    store.serve(ref.id, lambda e: send)
    store.release(ref.id)
    assert store.stats().pooled_segments == 0
    other = store.put(big(2.0))
    assert store.get(other.id).segment is not entry.segment
    send.done = True
    store.sweep()
    assert store.stats().pooled_segments == 1


def test_reserve_then_commit_writes_in_place(store: TensorStore) -> None:
    reservation = store.reserve((256, 128), "float32")
    reservation.array[:] = 5.0
    ref = store.commit(reservation)
    assert store.get(ref.id).data.view(np.float32).sum() == 5.0 * 256 * 128
    assert store.get(ref.id).segment is reservation.segment is not None


def test_aborted_reservation_gives_its_segment_back(store: TensorStore) -> None:
    reservation = store.reserve((100_000,), "float32")
    assert store.stats().segments == 1
    store.abort(reservation)
    assert store.stats().pooled_segments == 1
    with pytest.raises(StoreError):
        store.commit(reservation)


def test_uncommitted_reservation_is_unlinked_on_close(clock: FakeClock) -> None:
    store = make_store(clock)
    store.reserve((100_000,), "float32")
    assert len(own_segments()) == 1
    store.close()
    assert own_segments() == []


def test_reserve_torch_bfloat16(store: TensorStore) -> None:
    reservation = store.reserve((4,), "bfloat16")
    reservation.torch()[:] = torch.tensor([1.5, 2.5, -3.0, 0.0], dtype=torch.bfloat16)
    with pytest.raises(UnsupportedTensor):
        _ = reservation.array
    ref = store.commit(reservation)
    assert ref.dtype == "bfloat16" and ref.nbytes == 8


def test_torch_tensors_are_stored_bit_exact(store: TensorStore) -> None:
    tensor = torch.randn(300, 100, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = store.put(tensor)
    assert store.get(ref.id).data.tobytes() == tensor.view(torch.uint8).numpy().tobytes()


def test_stats_count_live_and_pooled(store: TensorStore) -> None:
    a = store.put(big())
    store.put(np.ones(10, np.float32))
    store.release(a.id)
    stats = store.stats()
    assert (stats.live_refs, stats.live_bytes, stats.segments, stats.pooled_segments) == (1, 40, 1, 1)


def test_close_unlinks_every_segment(clock: FakeClock) -> None:
    store = make_store(clock)
    refs = [store.put(big(float(i))) for i in range(3)]
    store.release(refs[0].id)
    assert len(own_segments()) == 3
    store.close()
    assert own_segments() == [] and len(store) == 0


# --- segments -----------------------------------------------------------------------------------


def test_size_classes_are_page_aligned_with_bounded_slack() -> None:
    for n in [1, PAGE, PAGE + 1, 100_000, 1 << 20, (1 << 20) + 1, 64 << 20, 67_000_000]:
        size = size_class(n)
        assert size >= n and size % PAGE == 0
        assert size <= max(PAGE, n * 1.25 + PAGE)
    assert size_class(64 << 20) == 64 << 20


def test_segment_names_encode_pid_and_start_time() -> None:
    allocator = SegmentAllocator()
    segment = allocator.take(10_000)
    try:
        owner = parse_segment_name(segment.name)
        assert owner is not None
        assert owner.pid == os.getpid() and owner.start == process_start_token(os.getpid())
        assert parse_segment_name("omniflow-kv-12-abc") is None
        assert parse_segment_name("other-1-2-3") is None
    finally:
        segment.unlink()


def test_two_allocators_of_one_process_never_take_the_same_name() -> None:
    """Two stores in one process (a worker's and a unit's own peer) allocate side by side."""
    first, second = SegmentAllocator(pool_bytes=0), SegmentAllocator(pool_bytes=0)
    segments = [first.take(10_000), second.take(10_000), second.take(10_000), first.take(10_000)]
    try:
        assert len({s.name for s in segments}) == 4
        segments[0].array[:1] = 7
        assert segments[1].array[0] == 0  # its own file, not a second mapping of the first
    finally:
        for segment in segments:
            segment.unlink()


def dead_process_token() -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-c", "import os; print(open(f'/proc/{os.getpid()}/stat').read())"],
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    fields = out[out.rindex(")") + 2 :].split()
    return proc.pid, format(int(fields[19]), "x")


def test_reclaim_unlinks_segments_of_dead_owners_only(store: TensorStore) -> None:
    pid, start = dead_process_token()
    dead = f"omniflow-{pid}-{start}-0"
    reused_pid = f"omniflow-{os.getpid()}-{'f' * 12}-0"  # our pid, another start: pid reuse
    for name in (dead, reused_pid):
        with open(os.path.join(SHM_ROOT, name), "wb") as f:
            f.write(b"x")
    live = store.put(big())
    reclaim_dead_segments()  # another process on this host may reclaim them first: check the files
    assert not os.path.exists(os.path.join(SHM_ROOT, dead))
    assert not os.path.exists(os.path.join(SHM_ROOT, reused_pid))
    assert store.get(live.id).segment.name in own_segments()  # type: ignore[union-attr]


def test_mapper_reuses_mappings_and_drops_vanished_ones() -> None:
    allocator = SegmentAllocator(pool_bytes=0)
    mapper = SegmentMapper(max_bytes=3 * 256 * KiB)
    segments = [allocator.take(200 * KiB) for _ in range(4)]
    try:
        for i, segment in enumerate(segments):
            segment.array[:4] = i
        first = mapper.map(segments[0].name, segments[0].size)
        assert mapper.map(segments[0].name, segments[0].size) is first
        assert np.frombuffer(first, np.uint8, 4).tolist() == [0, 0, 0, 0]
        for segment in segments[1:]:
            mapper.map(segment.name, segment.size)
        assert len(mapper) == 3 and segments[0].name not in mapper  # least recently used dropped
        segments[1].unlink()
        mapper.map(segments[0].name, segments[0].size)  # a miss prunes vanished names
        assert segments[1].name not in mapper and len(mapper) == 3
        with pytest.raises(SegmentGone):
            mapper.map(segments[1].name, segments[1].size)
        assert np.frombuffer(first, np.uint8, 4).tolist() == [0, 0, 0, 0]  # still readable
    finally:
        for segment in segments:
            segment.unlink()


def lent_parts() -> tuple[np.ndarray, ...]:
    return (np.arange(100, dtype=np.uint8), np.arange(100, 228, dtype=np.uint8), np.full(28, 7, np.uint8))


def test_a_lent_tensor_is_served_from_its_parts_and_given_back_once_freed(store: TensorStore) -> None:
    parts = lent_parts()
    freed: list[int] = []
    ref = store.lend("int32", (64,), parts, lambda: freed.append(1), lease_s=5.0)
    assert (ref.dtype, ref.shape, ref.nbytes, ref.shm) == ("int32", (64,), 256, None)
    entry = store.get(ref.id)
    whole = np.concatenate(parts)
    for offset, end in [(0, 256), (90, 110), (100, 228), (120, 250), (0, 1)]:
        views = entry.byte_range(offset, end)
        assert all(any(np.shares_memory(v, p) for p in parts) for v in views)  # no copy
        assert np.concatenate(views).tobytes() == whole[offset:end].tobytes()
    assert len(entry.byte_range(90, 110)) == 2 and len(entry.byte_range(120, 250)) == 2
    assert freed == []
    assert store.release(ref.id)
    assert freed == [1]  # no send read them: given back at once
    assert not store.release(ref.id) and freed == [1]


def test_lent_parts_read_by_a_send_are_given_back_only_after_it(store: TensorStore, clock: FakeClock) -> None:
    freed: list[str] = []
    ref = store.lend("uint8", (256,), lent_parts(), lambda: freed.append("released"), lease_s=5.0)
    send = FakeSend()
    store.serve(ref.id, lambda e: send)
    store.release(ref.id)
    store.sweep()
    assert freed == []
    send.done = True
    store.sweep()
    assert freed == ["released"]

    expiring = store.lend("uint8", (256,), lent_parts(), lambda: freed.append("expired"), lease_s=5.0)
    clock.now += 5.0
    assert store.sweep() == [expiring.id] and freed == ["released", "expired"]
    store.lend("uint8", (256,), lent_parts(), lambda: freed.append("closed"), lease_s=5.0)
    store.close()
    assert freed == ["released", "expired", "closed"]


def test_lent_parts_must_be_the_tensor_bytes(store: TensorStore) -> None:
    with pytest.raises(ValueError, match="not the 256 bytes"):
        store.lend("uint8", (256,), lent_parts()[:2], lambda: None)
    with pytest.raises(ValueError, match="not the 256 bytes"):
        store.lend("float32", (64,), (np.zeros(64, np.float32),), lambda: None)
