"""The node directory: the machines (nodes) that host role workers, what they have, what is free.

A node agent announces its `NodeRecord` more often than `ttl_s`; a node whose announcements
stop is *lost* once the lease lapses. Redis layout under `<namespace>:`:

* ``node:<name>``: the record's JSON, ``SET ... PX ttl``: the key's TTL is the liveness lease;
* ``nodes``: a hash, name -> the last record announced (no TTL), so a node whose lease lapsed
  is still known, and listed as lost, until it is forgotten (`forget`);
* ``since``: Redis's clock when `remembered_s` first found the directory without it (no TTL):
  a flush takes it with the nodes, and the next reading marks the directory's memory anew.

Redis keeps the directory in memory only: a flush, or a restart without persistence, forgets
every node, live or lost. A node the directory does not know is therefore not lost by the
directory's word; the studio keeps each node's heartbeats durably and judges those
(`studio.workflows.deployments.liveness`), with `up_s`: how long this Redis has been up, i.e.
how long its agents have had to announce themselves to it, and `remembered_s`: how long the
directory has kept its memory (``since``), which a flush resets too.

Records are msgspec JSON; nothing is pickled. Synchronous (the node agent's thread and the
studio's views call it); every call is bounded by `op_timeout_s` and raises
`NodeDirectoryError` when Redis cannot be reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import redis
import redis.exceptions as redis_exc

from engine.spec.resources import Amounts


class NodeDirectoryError(RuntimeError):
    """Redis could not be reached, or answered with something that is not a node record."""


class GpuInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    index: int
    model: str
    memory_gb: float


class NodeRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One node as its agent describes it. `total` counts what the node offers deployments
    (its GPUs, CPUs, memory, or the operator's overrides); `free` is `total` less what the
    deployments placed on it take; `hosting` is deployment id -> role -> replicas there."""

    name: str
    address: str
    total: Amounts
    free: Amounts
    gpus: tuple[GpuInfo, ...] = ()
    labels: dict[str, str] = {}
    hosting: dict[str, dict[str, int]] = {}
    agent_pid: int = 0
    started_at: float = 0.0
    seen_at: float = 0.0
    """Wall-clock time of this announcement."""
    ttl_s: float = 0.0
    users_root: str = ""
    """Where the node's processes keep their owners' folders (`<its data dir>/users`): the studio
    reads it to hide paths a run's nodes wrote there (`studio.workflows.runs.outputs`); the nodes
    list never shows it."""
    model_roots: tuple[str, ...] = ()
    """The node's model directories and model cache: the studio cuts them out of the errors its
    processes report (a checkpoint they could not load), as it does its own; never listed either."""

    @property
    def gpu_memory_gb(self) -> float:
        """Memory of its smallest GPU (0 without GPUs)."""
        return min((g.memory_gb for g in self.gpus), default=0.0)


@dataclass(frozen=True, slots=True)
class NodeState:
    record: NodeRecord
    live: bool
    """False: its lease lapsed (lost), its last record is shown."""


_DECODER = msgspec.json.Decoder(NodeRecord)

# Marks the directory's memory as starting now unless it has a mark: Redis's TIME, then the mark.
_REMEMBERED = """
local now = redis.call('TIME')
redis.call('SET', KEYS[1], now[1] .. '.' .. string.format('%06d', tonumber(now[2])), 'NX')
return {now[1], now[2], redis.call('GET', KEYS[1])}
"""


class NodeDirectory:
    """The node records of one Redis namespace."""

    def __init__(self, url: str, namespace: str, *, op_timeout_s: float = 2.0) -> None:
        if not namespace or ":" in namespace:
            raise ValueError(f"namespace must be non-empty and contain no ':', got {namespace!r}")
        self.namespace = namespace
        self._client = redis.Redis.from_url(url, socket_timeout=op_timeout_s, socket_connect_timeout=op_timeout_s)
        self._remembered = self._client.register_script(_REMEMBERED)

    def _key(self, name: str) -> str:
        return f"{self.namespace}:node:{name}"

    @property
    def _known(self) -> str:
        return f"{self.namespace}:nodes"

    def announce(self, record: NodeRecord) -> None:
        """Publish `record` for `record.ttl_s` (> 0) and remember it as the node's last."""
        if not record.ttl_s > 0:
            raise ValueError(f"a node record needs a positive ttl_s, not {record.ttl_s}")
        data = msgspec.json.encode(record)
        try:
            with self._client.pipeline(transaction=False) as pipe:
                pipe.set(self._key(record.name), data, px=max(1, math.ceil(record.ttl_s * 1000)))
                pipe.hset(self._known, record.name, data)
                pipe.execute()
        except redis_exc.RedisError as exc:
            raise NodeDirectoryError(f"announcing node {record.name!r} failed: {exc}") from exc

    def withdraw(self, name: str) -> None:
        """The node stops on purpose: its lease ends now (it stays known, as lost)."""
        try:
            self._client.delete(self._key(name))
        except redis_exc.RedisError as exc:
            raise NodeDirectoryError(f"withdrawing node {name!r} failed: {exc}") from exc

    def forget(self, name: str) -> None:
        """Drop the node altogether (live or not)."""
        try:
            with self._client.pipeline(transaction=False) as pipe:
                pipe.delete(self._key(name))
                pipe.hdel(self._known, name)
                pipe.execute()
        except redis_exc.RedisError as exc:
            raise NodeDirectoryError(f"forgetting node {name!r} failed: {exc}") from exc

    def known(self) -> list[NodeState]:
        """Every node announced and not forgotten, by name; live ones with their current record."""
        try:
            last = self._client.hgetall(self._known)
            names = sorted(n.decode() for n in last)
            current = self._client.mget([self._key(n) for n in names]) if names else []
        except redis_exc.RedisError as exc:
            raise NodeDirectoryError(f"reading the node directory failed: {exc}") from exc
        out = []
        for name, now in zip(names, current, strict=True):
            raw = now if now is not None else last[name.encode()]
            try:
                record = _DECODER.decode(raw)
            except msgspec.DecodeError as exc:
                raise NodeDirectoryError(f"node {name!r} has a malformed record: {exc}") from exc
            out.append(NodeState(record, live=now is not None))
        return out

    def up_s(self) -> float:
        """How long Redis has been up, in whole seconds (INFO's ``uptime_in_seconds``): a restart
        forgets every node, so a node this directory does not know has had at most this long to
        announce itself again. A flush does not reset it."""
        try:
            info = self._client.info("server")
        except redis_exc.RedisError as exc:
            raise NodeDirectoryError(f"reading how long Redis has been up failed: {exc}") from exc
        try:
            return float(info["uptime_in_seconds"])
        except (KeyError, TypeError, ValueError) as exc:
            raise NodeDirectoryError(f"Redis's INFO server has no uptime_in_seconds: {exc!r}") from exc

    def remembered_s(self) -> float:
        """How long the directory has kept its memory, by Redis's clock: since the first reading
        after Redis started empty or was flushed, which marks it (see the module docstring). A node
        the directory does not know has had at least this long to announce itself again. A
        restart with persistence keeps the mark: `up_s` tells that one."""
        try:
            seconds, micros, since = self._remembered(keys=[f"{self.namespace}:since"])
        except redis_exc.RedisError as exc:
            raise NodeDirectoryError(f"reading how long the node directory has remembered failed: {exc}") from exc
        try:
            remembered = float(seconds) + int(micros) / 1e6 - float(since)
        except (TypeError, ValueError) as exc:
            raise NodeDirectoryError(f"the node directory's memory mark is not a time: {since!r}") from exc
        return max(remembered, 0.0)

    def live(self) -> list[NodeRecord]:
        return [s.record for s in self.known() if s.live]

    def close(self) -> None:
        self._client.close()
