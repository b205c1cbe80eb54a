"""The distributed KV index: which worker holds which page, in which tier, kept in Redis.

Keys, under a namespace `ns` (default `omniflow:kv`):

* `ns:p:<page>`   hash: worker id -> fastest tier holding the page there (0 device,
  1 host, 2 disk). Redis deletes the key when its last worker field goes.
* `ns:wp:<worker>` set: the pages a worker has published (to clean up after it).
* `ns:alive:<worker>` string with a TTL: the worker's address while it heartbeats.
* `ns:workers`    set: every worker that registered (to find the ones that vanished).

A worker's store reports residency changes as events; `KVIndexPublisher` buffers
them and writes them in batches (one pipeline per batch) from a background thread,
so the store never waits on Redis. `lookup(pages)` answers, per live worker, how many
leading pages it holds: the input of the KV-aware load balancer. A worker whose
liveness key has expired is ignored by lookups and removed by `reap_dead_workers`.
Every Redis call runs under the client's socket timeout; failures raise `KVIndexError`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from engine.data.kv.errors import KVIndexError
from engine.data.kv.events import KVEvent
from engine.data.kv.keys import PageHash
from engine.data.kv.tier import Tier

if TYPE_CHECKING:
    from engine.data.kv.store import KVStore

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "omniflow:kv"


@dataclass(frozen=True, slots=True)
class WorkerPrefix:
    """How many leading pages of a lookup a worker holds, and in which tier each one is."""

    worker_id: str
    pages: int
    tiers: tuple[Tier, ...]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class RedisKVIndex:
    """Page -> (worker, tier) map in Redis. Safe to share between threads (redis-py pools)."""

    def __init__(
        self, client: redis.Redis, namespace: str = DEFAULT_NAMESPACE, batch_size: int = 512
    ) -> None:
        if batch_size <= 0:
            raise ValueError("batch_size must be positive")
        self.client = client
        self.namespace = namespace
        self.batch_size = batch_size

    @classmethod
    def from_url(cls, url: str, namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 2.0) -> RedisKVIndex:
        client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        return cls(client, namespace)

    # -- key names ------------------------------------------------------------------

    def page_key(self, page: str) -> str:
        return f"{self.namespace}:p:{page}"

    def worker_pages_key(self, worker_id: str) -> str:
        return f"{self.namespace}:wp:{worker_id}"

    def alive_key(self, worker_id: str) -> str:
        return f"{self.namespace}:alive:{worker_id}"

    @property
    def workers_key(self) -> str:
        return f"{self.namespace}:workers"

    # -- workers ----------------------------------------------------------------------

    def register_worker(self, worker_id: str, address: str = "", ttl_s: float = 10.0) -> None:
        """Announce a live worker; call `heartbeat` more often than `ttl_s` to stay alive."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.sadd(self.workers_key, worker_id)
            pipe.set(self.alive_key(worker_id), address, px=max(1, int(ttl_s * 1000)))
            pipe.execute()
        except redis.RedisError as exc:
            raise KVIndexError(f"registering worker {worker_id} failed: {exc}") from exc

    def heartbeat(self, worker_id: str, address: str = "", ttl_s: float = 10.0) -> None:
        self.register_worker(worker_id, address, ttl_s)

    def alive_workers(self) -> dict[str, str]:
        """Registered workers whose liveness key has not expired, with their addresses."""
        try:
            workers = sorted(_text(w) for w in self.client.smembers(self.workers_key))
            if not workers:
                return {}
            addresses = self.client.mget([self.alive_key(w) for w in workers])
        except redis.RedisError as exc:
            raise KVIndexError(f"listing workers failed: {exc}") from exc
        return {w: _text(a) for w, a in zip(workers, addresses, strict=True) if a is not None}

    def _alive(self, workers: Iterable[str]) -> set[str]:
        candidates = sorted(set(workers))
        if not candidates:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for worker in candidates:
            pipe.exists(self.alive_key(worker))
        return {w for w, exists in zip(candidates, pipe.execute(), strict=True) if exists}

    # -- updates -----------------------------------------------------------------------

    def publish(self, worker_id: str, updates: Mapping[PageHash, Tier | None]) -> None:
        """Record where a worker holds pages now (`None`: it no longer holds the page)."""
        items = list(updates.items())
        try:
            for batch in _chunks(items, self.batch_size):
                pipe = self.client.pipeline(transaction=False)
                added = [page for page, tier in batch if tier is not None]
                removed = [page for page, tier in batch if tier is None]
                for page, tier in batch:
                    if tier is None:
                        pipe.hdel(self.page_key(page), worker_id)
                    else:
                        pipe.hset(self.page_key(page), worker_id, int(tier))
                if added:
                    pipe.sadd(self.worker_pages_key(worker_id), *added)
                if removed:
                    pipe.srem(self.worker_pages_key(worker_id), *removed)
                pipe.execute()
        except redis.RedisError as exc:
            raise KVIndexError(f"publishing {len(items)} page updates of {worker_id} failed: {exc}") from exc

    def drop_worker(self, worker_id: str) -> int:
        """Remove every trace of a worker (it vanished or shut down); returns pages forgotten."""
        forgotten = 0
        try:
            pages = [_text(p) for p in self.client.sscan_iter(self.worker_pages_key(worker_id), count=1000)]
            for batch in _chunks(pages, self.batch_size):
                pipe = self.client.pipeline(transaction=False)
                for page in batch:
                    pipe.hdel(self.page_key(page), worker_id)
                forgotten += sum(int(n) for n in pipe.execute())
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(self.worker_pages_key(worker_id), self.alive_key(worker_id))
            pipe.srem(self.workers_key, worker_id)
            pipe.execute()
        except redis.RedisError as exc:
            raise KVIndexError(f"dropping worker {worker_id} failed: {exc}") from exc
        return forgotten

    def reap_dead_workers(self) -> list[str]:
        """Drop every registered worker whose liveness key expired; returns their ids."""
        try:
            registered = {_text(w) for w in self.client.smembers(self.workers_key)}
            dead = sorted(registered - self._alive(registered))
        except redis.RedisError as exc:
            raise KVIndexError(f"finding dead workers failed: {exc}") from exc
        for worker in dead:
            self.drop_worker(worker)
        return dead

    # -- queries ---------------------------------------------------------------------------

    def lookup_detailed(self, pages: Sequence[PageHash], chunk: int = 64) -> dict[str, WorkerPrefix]:
        """Per live worker, the run of leading `pages` it holds (workers holding none are left out)."""
        runs: dict[str, list[Tier]] = {}
        active: set[str] | None = None
        try:
            for batch in _chunks(list(pages), chunk):
                pipe = self.client.pipeline(transaction=False)
                for page in batch:
                    pipe.hgetall(self.page_key(page))
                for fields in pipe.execute():
                    holders = {_text(w): Tier(int(t)) for w, t in fields.items()}
                    if active is None:
                        active = self._alive(holders)
                        runs = {w: [] for w in active}
                    else:
                        active &= holders.keys()
                    if not active:
                        break
                    for worker in active:
                        runs[worker].append(holders[worker])
                if not active:
                    break
        except redis.RedisError as exc:
            raise KVIndexError(f"index lookup of {len(pages)} pages failed: {exc}") from exc
        return {w: WorkerPrefix(w, len(t), tuple(t)) for w, t in sorted(runs.items()) if t}

    def lookup(self, pages: Sequence[PageHash]) -> dict[str, int]:
        """Per live worker, the length of the longest cached prefix run of `pages`."""
        return {w: prefix.pages for w, prefix in self.lookup_detailed(pages).items()}

    def clear(self) -> int:
        """Delete every key of this namespace (tests and administration)."""
        try:
            keys = list(self.client.scan_iter(match=f"{self.namespace}:*", count=1000))
            for batch in _chunks(keys, 1000):
                self.client.delete(*batch)
        except redis.RedisError as exc:
            raise KVIndexError(f"clearing namespace {self.namespace} failed: {exc}") from exc
        return len(keys)


class KVIndexPublisher:
    """Feeds one store's residency changes into the index, batched, off the store's thread.

    Register it as a store listener (`attach`); it keeps the latest tier per page and a
    background thread writes them every `interval_s` or as soon as `batch_size` pages
    are pending. A failed write keeps the pages pending and is retried on the next
    round (`failures` counts them). `close` stops the thread after a last flush.
    """

    def __init__(
        self,
        index: RedisKVIndex,
        worker_id: str,
        interval_s: float = 0.05,
        batch_size: int = 512,
    ) -> None:
        self.index = index
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.batch_size = batch_size
        self.failures = 0
        self.published = 0
        self._pending: dict[PageHash, Tier | None] = {}
        self._wake = threading.Condition()
        self._flush_lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._store: KVStore | None = None

    def __call__(self, event: KVEvent) -> None:
        with self._wake:
            self._pending[event.page] = event.best
            if len(self._pending) >= self.batch_size:
                self._wake.notify()

    def attach(self, store: KVStore) -> None:
        """Publish everything the store holds now, then follow its events."""
        with self._wake:
            for page, tier in store.resident_pages().items():
                self._pending[page] = tier
        store.add_listener(self)
        self._store = store

    def start(self) -> KVIndexPublisher:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"kv-index-{self.worker_id}", daemon=True)
            self._thread.start()
        return self

    def pending(self) -> int:
        with self._wake:
            return len(self._pending)

    def flush(self) -> int:
        """Write what is pending now; returns the number of pages written. Raises `KVIndexError`."""
        with self._flush_lock:
            with self._wake:
                batch, self._pending = self._pending, {}
            if not batch:
                return 0
            try:
                self.index.publish(self.worker_id, batch)
            except KVIndexError:
                with self._wake:
                    # Newer events win over the batch that failed.
                    self._pending = {**batch, **self._pending}
                raise
            self.published += len(batch)
            return len(batch)

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._stopping and len(self._pending) < self.batch_size:
                    self._wake.wait(self.interval_s)
                stopping = self._stopping
            try:
                self.flush()
            except KVIndexError as exc:
                self.failures += 1
                log.warning("KV index publish failed (will retry): %s", exc)
            if stopping:
                return

    def close(self, timeout_s: float = 5.0) -> None:
        if self._store is not None:
            self._store.remove_listener(self)
            self._store = None
        thread, self._thread = self._thread, None
        if thread is not None:
            with self._wake:
                self._stopping = True
                self._wake.notify()
            thread.join(timeout_s)
        else:
            self.flush()
