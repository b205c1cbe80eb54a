"""The Redis registry: shared across processes and hosts."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Sequence

import redis.asyncio as aioredis
import redis.exceptions as redis_exc
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from engine.flow.discovery.records import (
    _T,
    FENCE_TTL_S,
    FencedWorkerError,
    RegistryClosedError,
    RegistryError,
    RegistryEvent,
    RegistryEventKind,
    RegistryUnavailableError,
    RegistryWatch,
    UnknownWorkerError,
    WorkerInfo,
    WorkerLoad,
    WorkerSnapshot,
    _register_events,
)

log = logging.getLogger(__name__)

_CLEAN_INDEX_LUA = """
local removed = 0
for i = 2, #ARGV do
  if redis.call('EXISTS', ARGV[1] .. ARGV[i]) == 0 then
    removed = removed + redis.call('SREM', KEYS[1], ARGV[i])
  end
end
return removed
"""


# Registers unless the id is fenced, in one step, so that a registration and a `fence` racing
# each other end fenced either way. KEYS: the worker's record, its fence, its role's index, the
# roles set and, when the worker moves between roles, its old role's index.
_REGISTER_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('SADD', KEYS[4], ARGV[4])
if #KEYS == 5 then
  redis.call('SREM', KEYS[5], ARGV[3])
end
return 1
"""


class RedisRegistry:
    """A :class:`Registry` in Redis, shared by every process using the same ``namespace``.

    ``ttl_s`` is the liveness lease: a worker must heartbeat more often. ``op_timeout_s`` bounds
    every Redis call (socket connect and read timeouts plus an overall deadline); an unreachable
    or silent server raises :class:`RegistryUnavailableError`. ``poll_interval_s`` (default
    ``ttl_s / 2``) is how often a watch re-reads membership to notice expired workers, so an
    expiry is reported within ``ttl_s + poll_interval_s``. A fenced id stays refused for
    ``fence_ttl_s`` (its tombstone key's TTL).

    The index clean-up script touches keys not passed in KEYS, so this targets a single Redis
    node, not Redis Cluster.
    """

    def __init__(
        self,
        url: str,
        namespace: str = "omniflow",
        ttl_s: float = 3.0,
        *,
        op_timeout_s: float = 2.0,
        poll_interval_s: float | None = None,
        fence_ttl_s: float = FENCE_TTL_S,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if not fence_ttl_s > 0:
            raise ValueError(f"fence_ttl_s must be > 0, got {fence_ttl_s}")
        if not namespace or ":" in namespace:
            raise ValueError(f"namespace must be non-empty and contain no ':', got {namespace!r}")
        self.url = url
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.op_timeout_s = op_timeout_s
        self.poll_interval_s = poll_interval_s if poll_interval_s is not None else ttl_s / 2
        self._ttl_ms = max(1, math.ceil(ttl_s * 1000))
        self.fence_ttl_s = fence_ttl_s
        self._fence_ttl_ms = max(1, math.ceil(fence_ttl_s * 1000))
        # One quick retry absorbs a dropped pooled connection; more would only delay the error.
        self._client: aioredis.Redis = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=op_timeout_s,
            socket_connect_timeout=op_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), retries=1),
        )
        self._clean_index = self._client.register_script(_CLEAN_INDEX_LUA)
        self._register_unfenced = self._client.register_script(_REGISTER_LUA)
        self._watches: set[_RedisWatch] = set()
        self._closed = False

    # Keys ------------------------------------------------------------------------------------

    @property
    def channel(self) -> str:
        """The pub/sub channel carrying this namespace's events."""
        return f"{self.namespace}:events"

    def _worker_prefix(self) -> str:
        return f"{self.namespace}:worker:"

    def _worker_key(self, worker_id: str) -> str:
        return self._worker_prefix() + worker_id

    def _fence_key(self, worker_id: str) -> str:
        return f"{self.namespace}:fenced:{worker_id}"

    def _role_key(self, role: str) -> str:
        return f"{self.namespace}:role:{role}"

    def _roles_key(self) -> str:
        return f"{self.namespace}:roles"

    # Plumbing --------------------------------------------------------------------------------

    async def _call(self, awaitable: Awaitable[_T]) -> _T:
        """Await a Redis call under the operation deadline, mapping failures to registry errors."""
        if self._closed:
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # never started; closing avoids a "never awaited" warning
            raise RegistryClosedError("registry is closed")
        try:
            async with asyncio.timeout(self.op_timeout_s):
                return await awaitable
        except (redis_exc.ConnectionError, redis_exc.TimeoutError, TimeoutError, OSError) as exc:
            raise RegistryUnavailableError(f"Redis at {self.url} is unavailable: {exc}") from exc
        except redis_exc.RedisError as exc:
            raise RegistryError(f"Redis at {self.url} failed: {exc}") from exc

    async def _get_snapshot(self, worker_id: str) -> WorkerSnapshot | None:
        raw = await self._call(self._client.get(self._worker_key(worker_id)))
        return None if raw is None else _decode_snapshot(raw, worker_id)

    async def _publish(self, events: list[RegistryEvent]) -> None:
        for event in events:
            await self._call(self._client.publish(self.channel, json.dumps(event.to_dict())))

    # Registry --------------------------------------------------------------------------------

    async def register(self, info: WorkerInfo, load: WorkerLoad | None = None) -> WorkerSnapshot:
        snapshot = WorkerSnapshot(info, load if load is not None else WorkerLoad(), time.time())
        old = await self._get_snapshot(info.worker_id)
        keys = [self._worker_key(info.worker_id), self._fence_key(info.worker_id), self._role_key(info.role),
                self._roles_key()]
        if old is not None and old.role != info.role:
            keys.append(self._role_key(old.role))
        stored = await self._call(self._register_unfenced(
            keys=keys, args=[json.dumps(snapshot.to_dict()), self._ttl_ms, info.worker_id, info.role]))
        if not stored:
            raise FencedWorkerError(info.worker_id)
        await self._publish(_register_events(old, snapshot))
        return snapshot

    async def heartbeat(self, worker_id: str, load: WorkerLoad) -> WorkerSnapshot:
        old = await self._get_snapshot(worker_id)
        if old is None:
            raise UnknownWorkerError(worker_id)
        snapshot = WorkerSnapshot(old.info, load, time.time())
        # XX: never resurrect a record that expired between the GET and this SET.
        stored = await self._call(
            self._client.set(
                self._worker_key(worker_id), json.dumps(snapshot.to_dict()), px=self._ttl_ms, xx=True
            )
        )
        if not stored:
            raise UnknownWorkerError(worker_id)
        if load != old.load:
            await self._publish([RegistryEvent(RegistryEventKind.UPDATED, worker_id, old.role, snapshot)])
        return snapshot

    async def deregister(self, worker_id: str) -> bool:
        old = await self._get_snapshot(worker_id)
        if old is None:
            return False
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._worker_key(worker_id))
        pipe.srem(self._role_key(old.role), worker_id)
        deleted, _ = await self._call(pipe.execute())
        if not deleted:
            return False  # expired or removed by someone else in the meantime
        await self._publish([RegistryEvent(RegistryEventKind.REMOVED, worker_id, old.role)])
        return True

    async def fence(self, worker_id: str) -> bool:
        old = await self._get_snapshot(worker_id)
        pipe = self._client.pipeline(transaction=True)
        pipe.set(self._fence_key(worker_id), str(time.time()), px=self._fence_ttl_ms)
        pipe.delete(self._worker_key(worker_id))
        if old is not None:
            pipe.srem(self._role_key(old.role), worker_id)
        _, deleted, *_ = await self._call(pipe.execute())
        if old is None or not deleted:
            return False
        await self._publish([RegistryEvent(RegistryEventKind.REMOVED, worker_id, old.role)])
        return True

    async def fenced(self, worker_ids: Sequence[str]) -> set[str]:
        if not worker_ids:
            return set()
        tombstones = await self._call(self._client.mget([self._fence_key(w) for w in worker_ids]))
        return {w for w, tombstone in zip(worker_ids, tombstones, strict=True) if tombstone is not None}

    async def workers(self, role: str | None = None) -> list[WorkerSnapshot]:
        if role is None:
            roles = sorted(await self._call(self._client.smembers(self._roles_key())))
        else:
            roles = [role]
        if not roles:
            return []
        pipe = self._client.pipeline(transaction=False)
        for r in roles:
            pipe.smembers(self._role_key(r))
        members: list[set[str]] = await self._call(pipe.execute())
        ids_by_role = {r: sorted(ids) for r, ids in zip(roles, members, strict=True)}
        all_ids = [wid for r in roles for wid in ids_by_role[r]]
        if not all_ids:
            return []
        raws: list[str | None] = await self._call(self._client.mget([self._worker_key(w) for w in all_ids]))
        found: dict[str, WorkerSnapshot] = {}
        stale: dict[str, list[str]] = {}
        position = 0
        for r in roles:
            for wid in ids_by_role[r]:
                raw = raws[position]
                position += 1
                snapshot = None if raw is None else _decode_snapshot(raw, wid)
                if snapshot is None:
                    stale.setdefault(r, []).append(wid)
                elif snapshot.role == r:  # else: a move between roles in flight; listed under its new role
                    found[wid] = snapshot
        for r, ids in stale.items():
            await self._call(self._clean_index(keys=[self._role_key(r)], args=[self._worker_prefix(), *ids]))
        return [found[wid] for wid in sorted(found)]

    def watch(self, role: str | None = None) -> RegistryWatch:
        if self._closed:
            raise RegistryClosedError("registry is closed")
        watch = _RedisWatch(self, role)
        self._watches.add(watch)
        return watch

    async def close(self) -> None:
        if self._closed:
            return
        for watch in list(self._watches):
            await watch.aclose()
        self._closed = True
        await self._client.aclose()


def _decode_snapshot(raw: str, worker_id: str) -> WorkerSnapshot | None:
    """Parse a stored record; a corrupt one is logged and treated as absent rather than fatal."""
    try:
        return WorkerSnapshot.from_dict(json.loads(raw))
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring corrupt registry record for worker %r: %s", worker_id, exc)
        return None


class _RedisWatch(RegistryWatch):
    """Pub/sub events reconciled with periodic membership polls, in one sequential loop.

    ``_known`` (worker_id -> role) is what this watch has reported as live; every event is
    checked against it, so a worker is reported ADDED once, UPDATED while known, and REMOVED
    once, whether the news arrives by pub/sub or by a poll.
    """

    def __init__(self, registry: RedisRegistry, role: str | None) -> None:
        self._registry = registry
        self._role = role
        self._pubsub = registry._client.pubsub()
        self._known: dict[str, str] = {}
        self._pending: deque[RegistryEvent] = deque()
        self._started = False
        self._closed = False
        self._next_poll = 0.0

    async def start(self) -> None:
        """Subscribe, then read the baseline membership; a watch that fails to start is closed."""
        if self._started:
            return
        if self._closed:
            raise RegistryClosedError("watch is closed")
        try:
            await self._subscribe()
            self._known = {s.worker_id: s.role for s in await self._registry.workers(self._role)}
        except RegistryError:
            await self.aclose()
            raise
        self._next_poll = time.monotonic() + self._registry.poll_interval_s
        self._started = True

    async def _subscribe(self) -> None:
        call = self._registry._call
        await call(self._pubsub.subscribe(self._registry.channel))
        # Wait for the confirmation so that the server has the subscription before the baseline
        # read: every change after the baseline then reaches us by pub/sub, by poll, or both.
        deadline = time.monotonic() + self._registry.op_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RegistryUnavailableError(
                    f"no subscribe confirmation from Redis at {self._registry.url}"
                )
            message = await call(self._pubsub.get_message(timeout=remaining / 2))
            if message is not None and message.get("type") == "subscribe":
                return

    async def __anext__(self) -> RegistryEvent:
        if self._closed:
            raise StopAsyncIteration
        await self.start()
        call = self._registry._call
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            now = time.monotonic()
            if now >= self._next_poll:
                await self._poll()
                self._next_poll = time.monotonic() + self._registry.poll_interval_s
                continue
            # Stay well inside the operation deadline that _call enforces around the wait.
            wait_s = min(self._next_poll - now, self._registry.op_timeout_s / 2)
            message = await call(self._pubsub.get_message(ignore_subscribe_messages=True, timeout=wait_s))
            if message is not None and message.get("type") == "message":
                self._apply_message(message["data"])
        return self._pending.popleft()

    def _apply_message(self, data: str) -> None:
        try:
            event = RegistryEvent.from_dict(json.loads(data))
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("ignoring malformed registry event on %s: %s", self._registry.channel, exc)
            return
        if self._role is not None and event.role != self._role:
            return
        if event.kind is RegistryEventKind.REMOVED:
            if self._known.get(event.worker_id) == event.role:
                del self._known[event.worker_id]
                self._pending.append(event)
            return
        kind = RegistryEventKind.UPDATED if event.worker_id in self._known else RegistryEventKind.ADDED
        self._known[event.worker_id] = event.role
        self._pending.append(RegistryEvent(kind, event.worker_id, event.role, event.snapshot))

    async def _poll(self) -> None:
        live = {s.worker_id: s for s in await self._registry.workers(self._role)}
        for wid in sorted(self._known):
            if wid not in live or live[wid].role != self._known[wid]:
                self._pending.append(RegistryEvent(RegistryEventKind.REMOVED, wid, self._known.pop(wid)))
        for wid, snapshot in live.items():
            if wid not in self._known:
                self._known[wid] = snapshot.role
                self._pending.append(RegistryEvent(RegistryEventKind.ADDED, wid, snapshot.role, snapshot))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._registry._watches.discard(self)
        try:
            await self._pubsub.aclose()
        except (redis_exc.RedisError, OSError) as exc:
            # Closing a connection to a dead server must not mask the caller's own error.
            log.debug("error closing registry watch connection: %s", exc)


