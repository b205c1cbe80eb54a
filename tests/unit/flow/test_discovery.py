"""Discovery records and the in-process registry (fake clock, no sleeping)."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.flow.discovery import (
    FencedWorkerError,
    InProcessRegistry,
    RedisRegistry,
    RegistryClosedError,
    RegistryEvent,
    RegistryEventKind,
    RegistryWatch,
    UnknownWorkerError,
    WorkerInfo,
    WorkerLoad,
    WorkerSnapshot,
    make_registry,
)

ADDED, UPDATED, REMOVED = RegistryEventKind.ADDED, RegistryEventKind.UPDATED, RegistryEventKind.REMOVED
TTL = 3.0


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def info(worker_id: str, role: str = "llm", **kw: object) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"tcp://127.0.0.1:{5000 + len(worker_id)}", host="h", pid=1, **kw)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def registry(clock: FakeClock):
    reg = InProcessRegistry(ttl_s=TTL, clock=clock)
    yield reg
    await reg.close()


async def drain(watch: RegistryWatch) -> list[tuple[RegistryEventKind, str, str]]:
    """Events already queued on ``watch``, as (kind, worker_id, role)."""
    out = []
    while True:
        try:
            event = await asyncio.wait_for(anext(watch), timeout=0.05)
        except TimeoutError:
            return out
        out.append((event.kind, event.worker_id, event.role))


# --- records ----------------------------------------------------------------------------------


def test_records_round_trip_through_json() -> None:
    snapshot = WorkerSnapshot(
        info("w1", capacity=4, model="tiny-llm", device="cuda:0", meta={"tp": 2}),
        WorkerLoad(outstanding=3, queue_depth=1, busy=True, metrics={"kv_hit_rate": 0.5}),
        last_heartbeat=1234.5,
    )
    assert WorkerSnapshot.from_dict(json.loads(json.dumps(snapshot.to_dict()))) == snapshot
    event = RegistryEvent(UPDATED, "w1", "llm", snapshot)
    assert RegistryEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event
    removed = RegistryEvent(REMOVED, "w1", "llm")
    assert RegistryEvent.from_dict(removed.to_dict()) == removed


def test_worker_info_defaults_and_validation() -> None:
    w = WorkerInfo("w1", "llm", "tcp://127.0.0.1:5555")
    assert (w.capacity, w.model, w.device, w.meta) == (1, None, "cpu", {})
    assert w.host and w.pid > 0
    hash(w)  # frozen handles are hashable even with a dict in meta
    with pytest.raises(ValueError, match="capacity"):
        WorkerInfo("w1", "llm", "tcp://x", capacity=0)
    with pytest.raises(ValueError, match="worker_id"):
        WorkerInfo("", "llm", "tcp://x")


@pytest.mark.parametrize(
    ("field", "value"),
    [("capacity", "2"), ("capacity", True), ("pid", None), ("meta", []), ("model", 3)],
)
def test_worker_info_from_dict_rejects_bad_fields(field: str, value: object) -> None:
    data = info("w1").to_dict()
    data[field] = value
    with pytest.raises(ValueError, match=field):
        WorkerInfo.from_dict(data)


def test_from_dict_rejects_missing_fields() -> None:
    data = info("w1").to_dict()
    del data["address"]
    with pytest.raises(ValueError, match="address"):
        WorkerInfo.from_dict(data)
    with pytest.raises(ValueError, match="metrics"):
        WorkerLoad.from_dict({"outstanding": 0, "queue_depth": 0, "busy": False})


# --- in-process registry ----------------------------------------------------------------------


async def test_register_lists_live_workers_sorted_and_by_role(registry: InProcessRegistry, clock: FakeClock):
    await registry.register(info("w2"))
    await registry.register(info("w1"), WorkerLoad(outstanding=2))
    await registry.register(info("v1", role="vision_encoder"))
    listed = await registry.workers()
    assert [s.worker_id for s in listed] == ["v1", "w1", "w2"]
    assert [s.worker_id for s in await registry.workers("llm")] == ["w1", "w2"]
    assert await registry.workers("tts") == []
    w1 = listed[1]
    assert w1.info == info("w1")
    assert w1.load == WorkerLoad(outstanding=2)
    assert w1.last_heartbeat == clock.now


async def test_heartbeat_updates_load_and_renews_the_lease(registry: InProcessRegistry, clock: FakeClock):
    await registry.register(info("w1"))
    for step in range(5):  # 5 * 2 s = 10 s > TTL: alive only because of the heartbeats
        clock.advance(2.0)
        snap = await registry.heartbeat("w1", WorkerLoad(outstanding=step))
        assert snap.last_heartbeat == clock.now
    (listed,) = await registry.workers()
    assert listed.load == WorkerLoad(outstanding=4)
    assert listed.last_heartbeat == clock.now


async def test_heartbeat_of_an_unknown_worker_raises(registry: InProcessRegistry):
    with pytest.raises(UnknownWorkerError) as exc:
        await registry.heartbeat("ghost", WorkerLoad())
    assert exc.value.worker_id == "ghost"


async def test_worker_expires_after_ttl_and_must_reregister(registry: InProcessRegistry, clock: FakeClock):
    await registry.register(info("w1"))
    await registry.register(info("w2"))
    clock.advance(TTL - 0.01)
    await registry.heartbeat("w2", WorkerLoad())
    assert [s.worker_id for s in await registry.workers()] == ["w1", "w2"]
    clock.advance(0.01)  # w1 reaches its TTL exactly: no longer live
    assert [s.worker_id for s in await registry.workers()] == ["w2"]
    with pytest.raises(UnknownWorkerError):
        await registry.heartbeat("w1", WorkerLoad())
    await registry.register(info("w1"))
    assert [s.worker_id for s in await registry.workers()] == ["w1", "w2"]


async def test_deregister(registry: InProcessRegistry):
    await registry.register(info("w1"))
    assert await registry.deregister("w1") is True
    assert await registry.deregister("w1") is False
    assert await registry.workers() == []


async def test_a_fenced_id_is_removed_and_refused_until_its_fence_ends(clock: FakeClock):
    registry = InProcessRegistry(ttl_s=TTL, clock=clock, fence_ttl_s=100.0)
    try:
        await registry.register(info("w1"))
        await registry.register(info("w2"))
        watch = registry.watch()
        assert await registry.fence("w1") is True
        assert await registry.fence("w1") is False  # no record left; still fenced
        assert [s.worker_id for s in await registry.workers()] == ["w2"]
        assert await drain(watch) == [(REMOVED, "w1", "llm")]
        with pytest.raises(UnknownWorkerError):
            await registry.heartbeat("w1", WorkerLoad())
        with pytest.raises(FencedWorkerError) as refused:
            await registry.register(info("w1"))
        assert refused.value.worker_id == "w1" and "fenced" in str(refused.value)
        assert await drain(watch) == []  # a refused registration says nothing
        await registry.fence("never-registered")
        with pytest.raises(FencedWorkerError):
            await registry.register(info("never-registered"))
        assert await registry.fenced(["w1", "w2", "never-registered"]) == {"w1", "never-registered"}
        clock.advance(100.0)  # the fence ends (the heartbeats of w2 ended long ago too)
        assert await registry.fenced(["w1", "never-registered"]) == set()
        await registry.register(info("w1"))
        assert [s.worker_id for s in await registry.workers()] == ["w1"]
        await watch.aclose()
    finally:
        await registry.close()


async def test_watch_reports_changes_after_the_call_in_order(registry: InProcessRegistry, clock: FakeClock):
    await registry.register(info("before"))
    watch = registry.watch()
    await registry.register(info("w1"))
    await registry.heartbeat("w1", WorkerLoad())  # unchanged load: no event
    await registry.heartbeat("w1", WorkerLoad(outstanding=1))
    await registry.register(info("w1", capacity=2))  # re-register in place
    await registry.register(info("w1", role="vision_encoder"))  # moves role
    await registry.deregister("w1")
    assert await drain(watch) == [
        (ADDED, "w1", "llm"),
        (UPDATED, "w1", "llm"),
        (UPDATED, "w1", "llm"),
        (REMOVED, "w1", "llm"),
        (ADDED, "w1", "vision_encoder"),
        (REMOVED, "w1", "vision_encoder"),
    ]
    await watch.aclose()


async def test_watch_events_carry_snapshots(registry: InProcessRegistry):
    watch = registry.watch()
    snap = await registry.register(info("w1"))
    await registry.deregister("w1")
    added = await anext(watch)
    removed = await anext(watch)
    assert added == RegistryEvent(ADDED, "w1", "llm", snap)
    assert removed == RegistryEvent(REMOVED, "w1", "llm", None)
    await watch.aclose()


async def test_watch_filters_by_role(registry: InProcessRegistry):
    watch = registry.watch("vision_encoder")
    await registry.register(info("w1"))
    await registry.register(info("v1", role="vision_encoder"))
    await registry.deregister("w1")
    assert await drain(watch) == [(ADDED, "v1", "vision_encoder")]
    await watch.aclose()


async def test_expiry_is_reported_on_the_next_read(registry: InProcessRegistry, clock: FakeClock):
    await registry.register(info("w1"))
    watch = registry.watch()
    clock.advance(TTL + 1)
    assert await registry.workers() == []
    assert await drain(watch) == [(REMOVED, "w1", "llm")]
    await watch.aclose()


async def test_expiry_reaches_a_watcher_when_nobody_reads(clock: FakeClock):
    reg = InProcessRegistry(ttl_s=TTL, clock=clock, sweep_interval_s=0.01)
    await reg.register(info("w1"))
    async with reg.watch() as watch:
        clock.advance(TTL)
        event = await asyncio.wait_for(anext(watch), timeout=2.0)
        assert (event.kind, event.worker_id, event.snapshot) == (REMOVED, "w1", None)
    await reg.close()


async def test_closing_a_watch_ends_iteration(registry: InProcessRegistry):
    watch = registry.watch()
    waiter = asyncio.ensure_future(anext(watch))
    await asyncio.sleep(0)  # let the waiter block on the empty queue
    await watch.aclose()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiter, timeout=1.0)
    await registry.register(info("w1"))
    assert [e async for e in watch] == []


async def test_closing_the_registry_ends_watches_and_refuses_calls(clock: FakeClock):
    reg = InProcessRegistry(ttl_s=TTL, clock=clock)
    watch = reg.watch()
    await reg.close()
    assert [e async for e in watch] == []
    with pytest.raises(RegistryClosedError):
        await reg.register(info("w1"))
    with pytest.raises(RegistryClosedError):
        reg.watch()


# --- factory ----------------------------------------------------------------------------------


async def test_make_registry_picks_the_implementation_by_url():
    assert isinstance(make_registry(None), InProcessRegistry)
    assert isinstance(make_registry("memory://", ttl_s=1.5), InProcessRegistry)
    redis_reg = make_registry("redis://127.0.0.1:6379/0", namespace="t", ttl_s=1.0)
    assert isinstance(redis_reg, RedisRegistry)
    assert (redis_reg.namespace, redis_reg.ttl_s) == ("t", 1.0)
    await redis_reg.close()  # never connected: closing must not need a server
    with pytest.raises(ValueError, match="etcd://somewhere"):
        make_registry("etcd://somewhere")


def test_ttl_must_be_positive():
    with pytest.raises(ValueError, match="ttl_s"):
        InProcessRegistry(ttl_s=0)
