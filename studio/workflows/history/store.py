"""Where each worker's metric points are kept: bounded, and forgotten with the worker.

A `HistoryStore` keeps, per (deployment, worker), the last `HistoryLimits.cap` points (the
window, `OMNIFLOW_METRICS_HISTORY_S`, at the sampling interval) and what the worker is; a
worker that no sample mentions for a whole window is forgotten. Points are msgpack-encoded
`MetricPoint`s (a few hundred bytes each). Two implementations:

* `MemoryHistory` -- in this process (the embedded mode, no Redis), behind a lock;
* `RedisHistory` -- in Redis under `<OMNIFLOW_REDIS_PREFIX>:metrics:` (the distributed mode),
  so every web process serves the same history, written by one sampler for the cluster:

  - `points:<deployment>:<worker>`: a list, oldest first, trimmed to `cap` at each append;
  - `meta:<deployment>:<worker>`: the worker's `WorkerMeta`;
  - `workers:<deployment>`: a sorted set, worker id -> time of its last point;
  - `deployments`: a sorted set, deployment id -> time of its last point;
  - `sampler`: the sampler lease (who writes; see `hold_sampler`).

  Each key expires a window after its last write, the sorted sets drop members older than the
  window at each append, and a deployment none of whose workers had a point for a window is
  forgotten whole: memory stays bounded whatever workers come and go.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import redis
import redis.exceptions as redis_exc

from studio.workflows.history.points import MetricPoint, WorkerSeries


class HistoryUnavailable(RuntimeError):
    """The store cannot be read or written (Redis down or too slow)."""


class WorkerMeta(msgspec.Struct, frozen=True):
    """What a series is about (from the worker's registration)."""

    worker_id: str
    deployment: str
    role: str
    device: str
    host: str
    model: str | None = None


@dataclass(frozen=True, slots=True)
class HistoryLimits:
    window_s: float
    """How far back points are kept."""
    interval_s: float
    """The sampling interval: one point per worker per interval."""

    @property
    def cap(self) -> int:
        """The most points one worker's series holds."""
        return math.ceil(self.window_s / self.interval_s) + 1

    def points_in(self, span_s: float) -> int:
        """How many of the newest points cover `span_s` (at most `cap`)."""
        return min(self.cap, math.ceil(span_s / self.interval_s) + 2)


@dataclass(frozen=True, slots=True)
class Sample:
    meta: WorkerMeta
    point: MetricPoint


_encode = msgspec.msgpack.Encoder().encode
_decode_point = msgspec.msgpack.Decoder(MetricPoint).decode
_decode_meta = msgspec.msgpack.Decoder(WorkerMeta).decode


def _newest(encoded: Sequence[bytes], since: float) -> list[MetricPoint]:
    """The points at or after `since`, oldest first, from `encoded` (oldest first)."""
    out: list[MetricPoint] = []
    for raw in reversed(encoded):
        point = _decode_point(raw)
        if point.t < since:
            break
        out.append(point)
    out.reverse()
    return out


def _series(meta: WorkerMeta, points: list[MetricPoint]) -> WorkerSeries:
    return WorkerSeries(worker_id=meta.worker_id, deployment=meta.deployment, role=meta.role, device=meta.device,
                        host=meta.host, model=meta.model, points=points)


class HistoryStore(Protocol):
    limits: HistoryLimits

    def append(self, t: float, samples: Sequence[Sample]) -> None:
        """Add one point per sampled worker, all taken at `t`; forget what the window left."""

    def deployments(self, since: float) -> set[str]:
        """Deployments with a point at or after `since`."""

    def series(self, deployments: Collection[str], since: float, worker: str | None = None) -> list[WorkerSeries]:
        """The series of those deployments' workers (or of `worker` alone) with points at or after
        `since`, each holding only those points; ordered by deployment, role and worker."""

    def hold_sampler(self, owner: str, ttl_s: float) -> bool:
        """Take or renew the sampler lease for `owner` (for `ttl_s`); False while another holds it."""

    def release_sampler(self, owner: str) -> None:
        """Give the lease up, if `owner` holds it."""

    def close(self) -> None: ...


def _ordered(series: list[WorkerSeries]) -> list[WorkerSeries]:
    return sorted(series, key=lambda s: (s.deployment, s.role, s.worker_id))


@dataclass(slots=True)
class _Kept:
    meta: WorkerMeta
    points: deque[bytes]
    last: float = 0.0


@dataclass(slots=True)
class MemoryHistory:
    """The history in this process's memory (one studio process: the embedded mode)."""

    limits: HistoryLimits
    _kept: dict[tuple[str, str], _Kept] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def append(self, t: float, samples: Sequence[Sample]) -> None:
        with self._lock:
            for sample in samples:
                key = (sample.meta.deployment, sample.meta.worker_id)
                kept = self._kept.get(key)
                if kept is None:
                    kept = self._kept[key] = _Kept(sample.meta, deque(maxlen=self.limits.cap))
                kept.meta = sample.meta
                kept.points.append(_encode(sample.point))
                kept.last = t
            horizon = t - self.limits.window_s
            for key in [k for k, kept in self._kept.items() if kept.last < horizon]:
                del self._kept[key]

    def deployments(self, since: float) -> set[str]:
        with self._lock:
            return {deployment for (deployment, _), kept in self._kept.items() if kept.last >= since}

    def series(self, deployments: Collection[str], since: float, worker: str | None = None) -> list[WorkerSeries]:
        wanted = set(deployments)
        with self._lock:
            chosen = [(kept.meta, list(kept.points)) for (deployment, worker_id), kept in self._kept.items()
                      if deployment in wanted and (worker is None or worker_id == worker) and kept.last >= since]
        return _ordered([_series(meta, _newest(points, since)) for meta, points in chosen])

    def hold_sampler(self, owner: str, ttl_s: float) -> bool:
        return True  # one process: its sampler is the only one

    def release_sampler(self, owner: str) -> None:
        return None

    def close(self) -> None:
        return None


# Take the lease when it is free, renew it when it is ours; never take another's.
_HOLD = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not current then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# Forget the deployments no point mentioned for a window: their workers' series and index.
_FORGET = """
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
for _, deployment in ipairs(stale) do
  local workers = ARGV[2] .. ':workers:' .. deployment
  for _, worker in ipairs(redis.call('ZRANGE', workers, 0, -1)) do
    redis.call('DEL', ARGV[2] .. ':points:' .. deployment .. ':' .. worker, ARGV[2] .. ':meta:' .. deployment .. ':' .. worker)
  end
  redis.call('DEL', workers)
  redis.call('ZREM', KEYS[1], deployment)
end
return #stale
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisHistory:
    """The history in Redis, shared by every studio process of the cluster (see the module doc)."""

    def __init__(self, url: str, prefix: str, limits: HistoryLimits, *, op_timeout_s: float = 2.0) -> None:
        self.limits = limits
        self.prefix = f"{prefix}:metrics"
        self._client = redis.Redis.from_url(url, socket_timeout=op_timeout_s, socket_connect_timeout=op_timeout_s)
        self._hold = self._client.register_script(_HOLD)
        self._release = self._client.register_script(_RELEASE)
        self._forget = self._client.register_script(_FORGET)

    def _points_key(self, deployment: str, worker: str) -> str:
        return f"{self.prefix}:points:{deployment}:{worker}"

    def _meta_key(self, deployment: str, worker: str) -> str:
        return f"{self.prefix}:meta:{deployment}:{worker}"

    def _workers_key(self, deployment: str) -> str:
        return f"{self.prefix}:workers:{deployment}"

    @property
    def _deployments_key(self) -> str:
        return f"{self.prefix}:deployments"

    @property
    def sampler_key(self) -> str:
        return f"{self.prefix}:sampler"

    def append(self, t: float, samples: Sequence[Sample]) -> None:
        window_ms = math.ceil(self.limits.window_s * 1000)
        horizon = t - self.limits.window_s
        cap = self.limits.cap
        pipe = self._client.pipeline(transaction=False)
        deployments = {sample.meta.deployment for sample in samples}
        for sample in samples:
            meta = sample.meta
            points = self._points_key(meta.deployment, meta.worker_id)
            pipe.rpush(points, _encode(sample.point))
            pipe.ltrim(points, -cap, -1)
            pipe.pexpire(points, window_ms)
            pipe.set(self._meta_key(meta.deployment, meta.worker_id), _encode(meta), px=window_ms)
            pipe.zadd(self._workers_key(meta.deployment), {meta.worker_id: t})
        for deployment in deployments:
            pipe.zremrangebyscore(self._workers_key(deployment), "-inf", f"({horizon}")
            pipe.pexpire(self._workers_key(deployment), window_ms)
        if deployments:
            pipe.zadd(self._deployments_key, dict.fromkeys(deployments, t))
            pipe.pexpire(self._deployments_key, window_ms)
        self._forget(keys=[self._deployments_key], args=[horizon, self.prefix], client=pipe)
        try:
            pipe.execute()
        except redis_exc.RedisError as exc:
            raise HistoryUnavailable(f"writing the metrics history to Redis failed: {exc}") from exc

    def deployments(self, since: float) -> set[str]:
        try:
            found = self._client.zrangebyscore(self._deployments_key, since, "+inf")
        except redis_exc.RedisError as exc:
            raise HistoryUnavailable(f"reading the metrics history from Redis failed: {exc}") from exc
        return {d.decode() for d in found}

    def series(self, deployments: Collection[str], since: float, worker: str | None = None) -> list[WorkerSeries]:
        wanted = sorted(deployments)
        if not wanted:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for deployment in wanted:
                pipe.zrangebyscore(self._workers_key(deployment), since, "+inf")
            members = pipe.execute()
            keys = [(deployment, w.decode()) for deployment, found in zip(wanted, members, strict=True)
                    for w in found if worker is None or w.decode() == worker]
            if not keys:
                return []
            span = self.limits.points_in(max(0.0, time.time() - since))
            pipe = self._client.pipeline(transaction=False)
            for deployment, worker_id in keys:
                pipe.get(self._meta_key(deployment, worker_id))
                pipe.lrange(self._points_key(deployment, worker_id), -span, -1)
            read = pipe.execute()
        except redis_exc.RedisError as exc:
            raise HistoryUnavailable(f"reading the metrics history from Redis failed: {exc}") from exc
        out = []
        for index in range(len(keys)):
            raw_meta, encoded = read[2 * index], read[2 * index + 1]
            if raw_meta is None:  # expired between the two reads
                continue
            out.append(_series(_decode_meta(raw_meta), _newest(encoded, since)))
        return _ordered(out)

    def hold_sampler(self, owner: str, ttl_s: float) -> bool:
        try:
            return bool(self._hold(keys=[self.sampler_key], args=[owner, math.ceil(ttl_s * 1000)]))
        except redis_exc.RedisError as exc:
            raise HistoryUnavailable(f"taking the metrics sampler lease failed: {exc}") from exc

    def release_sampler(self, owner: str) -> None:
        try:
            self._release(keys=[self.sampler_key], args=[owner])
        except redis_exc.RedisError as exc:
            raise HistoryUnavailable(f"releasing the metrics sampler lease failed: {exc}") from exc

    def close(self) -> None:
        self._client.close()
