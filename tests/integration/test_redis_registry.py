"""RedisRegistry against the real Redis at REDIS_URL.

These tests fail (never skip) when Redis is unreachable. Each test uses its own namespace and
deletes its keys afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from engine.flow.discovery import (
    FencedWorkerError,
    RedisRegistry,
    RegistryEvent,
    RegistryEventKind,
    RegistryUnavailableError,
    RegistryWatch,
    UnknownWorkerError,
    WorkerInfo,
    WorkerLoad,
)

pytestmark = pytest.mark.redis

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
TTL = 0.5
ADDED, UPDATED, REMOVED = RegistryEventKind.ADDED, RegistryEventKind.UPDATED, RegistryEventKind.REMOVED


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.02
) -> None:
    """Poll ``predicate`` until it holds; fail the test if it does not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


async def next_event(watch: RegistryWatch, timeout: float = 3.0) -> tuple[RegistryEventKind, str, str]:
    event = await asyncio.wait_for(anext(watch), timeout)
    return (event.kind, event.worker_id, event.role)


def info(worker_id: str, role: str = "llm", **kw: object) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"tcp://127.0.0.1:{6000 + len(worker_id)}", **kw)


@pytest.fixture
async def raw() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(
        REDIS_URL, decode_responses=True, socket_connect_timeout=2, socket_timeout=2
    )
    try:
        await client.ping()
    except (OSError, aioredis.ConnectionError, aioredis.TimeoutError) as exc:
        pytest.fail(f"Redis at REDIS_URL={REDIS_URL} is unreachable: {exc}")
    yield client
    await client.aclose()


@pytest.fixture
async def namespace(raw: aioredis.Redis) -> AsyncIterator[str]:
    ns = f"omniflow-test-{uuid.uuid4().hex[:12]}"
    yield ns
    keys = [key async for key in raw.scan_iter(match=f"{ns}:*")]
    if keys:
        await raw.delete(*keys)


@pytest.fixture
async def registry(namespace: str) -> AsyncIterator[RedisRegistry]:
    reg = RedisRegistry(REDIS_URL, namespace=namespace, ttl_s=TTL, poll_interval_s=0.1)
    yield reg
    await reg.close()


async def test_register_list_heartbeat_deregister(registry: RedisRegistry):
    await registry.register(info("w2", capacity=2, model="tiny-llm"))
    snap = await registry.register(info("w1"), WorkerLoad(outstanding=1))
    await registry.register(info("v1", role="vision_encoder"))
    assert [s.worker_id for s in await registry.workers()] == ["v1", "w1", "w2"]
    llm = await registry.workers("llm")
    assert [s.worker_id for s in llm] == ["w1", "w2"]
    assert llm[0] == snap
    assert llm[1].info == info("w2", capacity=2, model="tiny-llm")

    beat = await registry.heartbeat("w1", WorkerLoad(outstanding=3, metrics={"kv_hit_rate": 0.25}))
    (w1,) = [s for s in await registry.workers("llm") if s.worker_id == "w1"]
    assert w1 == beat
    assert w1.load.metrics == {"kv_hit_rate": 0.25}
    assert w1.last_heartbeat >= snap.last_heartbeat

    assert await registry.deregister("w1") is True
    assert await registry.deregister("w1") is False
    assert [s.worker_id for s in await registry.workers()] == ["v1", "w2"]
    with pytest.raises(UnknownWorkerError):
        await registry.heartbeat("w1", WorkerLoad())


async def test_records_are_json_with_a_ttl(registry: RedisRegistry, raw: aioredis.Redis, namespace: str):
    await registry.register(info("w1"))
    key = f"{namespace}:worker:w1"
    stored = json.loads(await raw.get(key))  # plain JSON, no pickle
    assert stored["info"]["worker_id"] == "w1"
    assert 0 < await raw.pttl(key) <= TTL * 1000
    assert await raw.smembers(f"{namespace}:role:llm") == {"w1"}


async def test_heartbeats_keep_a_worker_alive_past_its_ttl(registry: RedisRegistry):
    await registry.register(info("w1"))
    start = time.monotonic()
    while time.monotonic() - start < 2 * TTL:
        await registry.heartbeat("w1", WorkerLoad())
        await asyncio.sleep(TTL / 5)
    assert [s.worker_id for s in await registry.workers()] == ["w1"]


async def test_worker_whose_heartbeats_stop_disappears(
    registry: RedisRegistry, raw: aioredis.Redis, namespace: str
):
    await registry.register(info("dead"))
    await registry.register(info("alive"))
    registered = time.monotonic()

    async def only_alive() -> bool:
        if time.monotonic() - registered > TTL / 3:
            await registry.heartbeat("alive", WorkerLoad())
        return [s.worker_id for s in await registry.workers("llm")] == ["alive"]

    await wait_until(only_alive, timeout=3 * TTL)
    assert time.monotonic() - registered >= TTL * 0.9  # not gone before its lease ran out
    # The stale index entry was cleaned on read, and the dead worker must re-register.
    assert await raw.smembers(f"{namespace}:role:llm") == {"alive"}
    with pytest.raises(UnknownWorkerError):
        await registry.heartbeat("dead", WorkerLoad())


async def test_a_fenced_id_is_removed_and_refused_while_its_tombstone_lasts(
    raw: aioredis.Redis, namespace: str
):
    registry = RedisRegistry(REDIS_URL, namespace=namespace, ttl_s=TTL, poll_interval_s=0.1, fence_ttl_s=1.0)
    try:
        await registry.register(info("w1"))
        await registry.register(info("w2"))
        async with registry.watch() as watch:
            assert await registry.fence("w1") is True
            assert await next_event(watch) == (REMOVED, "w1", "llm")
        assert await registry.fence("w1") is False  # no record left; still fenced
        assert [s.worker_id for s in await registry.workers()] == ["w2"]
        assert await raw.smembers(f"{namespace}:role:llm") == {"w2"}
        assert 0 < await raw.pttl(f"{namespace}:fenced:w1") <= 1000
        assert await registry.fenced(["w1", "w2"]) == {"w1"} and await registry.fenced([]) == set()
        with pytest.raises(UnknownWorkerError):
            await registry.heartbeat("w1", WorkerLoad())
        with pytest.raises(FencedWorkerError) as refused:
            await registry.register(info("w1"))
        assert refused.value.worker_id == "w1"
        assert await raw.exists(f"{namespace}:worker:w1") == 0  # refused whole: no record, no index entry
        assert await raw.smembers(f"{namespace}:role:llm") == {"w2"}
        # a record merely lost (expired, flushed) is not fenced: it registers again
        await raw.delete(f"{namespace}:worker:w2")
        with pytest.raises(UnknownWorkerError):
            await registry.heartbeat("w2", WorkerLoad())
        await registry.register(info("w2"))
        assert [s.worker_id for s in await registry.workers()] == ["w2"]

        async def fence_ended() -> bool:
            return await raw.exists(f"{namespace}:fenced:w1") == 0

        await wait_until(fence_ended, timeout=3.0)
        assert await registry.fenced(["w1"]) == set()
        await registry.register(info("w1"))
        assert "w1" in [s.worker_id for s in await registry.workers()]
    finally:
        await registry.close()


async def test_a_registration_moving_roles_leaves_the_old_role_index(registry: RedisRegistry, raw: aioredis.Redis,
                                                                     namespace: str):
    await registry.register(info("w1", role="llm"))
    await registry.register(info("w1", role="vision_encoder"))
    assert await raw.smembers(f"{namespace}:role:llm") == set()
    assert [(s.worker_id, s.role) for s in await registry.workers()] == [("w1", "vision_encoder")]


async def test_namespaces_are_isolated(registry: RedisRegistry, raw: aioredis.Redis):
    other_ns = f"omniflow-test-{uuid.uuid4().hex[:12]}"
    other = RedisRegistry(REDIS_URL, namespace=other_ns, ttl_s=TTL)
    try:
        await other.register(info("elsewhere"))
        assert await registry.workers() == []
    finally:
        await other.close()
        await raw.delete(*[k async for k in raw.scan_iter(match=f"{other_ns}:*")])


async def test_watch_sees_added_updated_and_removed_from_another_client(
    registry: RedisRegistry, namespace: str
):
    await registry.register(info("before"))
    publisher = RedisRegistry(REDIS_URL, namespace=namespace, ttl_s=TTL)
    try:
        async with registry.watch() as watch:
            snap = await publisher.register(info("w1"))
            await publisher.heartbeat("w1", WorkerLoad(outstanding=2))
            await publisher.deregister("w1")
            added = await asyncio.wait_for(anext(watch), 3.0)
            assert added == RegistryEvent(ADDED, "w1", "llm", snap)
            assert await next_event(watch) == (UPDATED, "w1", "llm")
            assert await next_event(watch) == (REMOVED, "w1", "llm")
    finally:
        await publisher.close()


async def test_watch_filters_by_role(registry: RedisRegistry):
    async with registry.watch("vision_encoder") as watch:
        await registry.register(info("w1"))
        await registry.register(info("v1", role="vision_encoder"))
        assert await next_event(watch) == (ADDED, "v1", "vision_encoder")
        await registry.deregister("w1")
        await registry.deregister("v1")
        assert await next_event(watch) == (REMOVED, "v1", "vision_encoder")


async def test_watch_reports_expiry_without_keyspace_notifications(registry: RedisRegistry):
    async with registry.watch() as watch:
        await registry.register(info("w1"))
        assert await next_event(watch) == (ADDED, "w1", "llm")
        started = time.monotonic()
        event = await asyncio.wait_for(anext(watch), timeout=3 * TTL)
        assert (event.kind, event.worker_id, event.snapshot) == (REMOVED, "w1", None)
        assert time.monotonic() - started < TTL + 0.75  # lease + a few poll intervals


async def test_closed_watch_stops_iterating(registry: RedisRegistry):
    watch = registry.watch()
    await watch.start()
    await watch.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(watch)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_redis_raises_quickly():
    reg = RedisRegistry(f"redis://127.0.0.1:{closed_port()}/0", namespace="down", ttl_s=TTL, op_timeout_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(RegistryUnavailableError):
            await reg.register(info("w1"))
        with pytest.raises(RegistryUnavailableError):
            await reg.workers()
        watch = reg.watch()
        with pytest.raises(RegistryUnavailableError):
            await watch.start()
        with pytest.raises(StopAsyncIteration):  # a watch that failed to start is closed
            await anext(watch)
        assert time.monotonic() - started < 3.0
    finally:
        await reg.close()


async def test_silent_server_times_out_instead_of_hanging():
    # A socket that accepts connections but never answers: every call must hit its timeout.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    reg = RedisRegistry(f"redis://127.0.0.1:{port}/0", namespace="silent", ttl_s=TTL, op_timeout_s=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(RegistryUnavailableError):
            await reg.workers()
        assert time.monotonic() - started < 2.0
    finally:
        await reg.close()
        server.close()
