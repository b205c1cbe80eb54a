"""A worker's KV cache on the wire: serve its pages, publish them, hand the unit the transfer plane.

A compute unit that keeps a paged KV cache says so by providing `KVHostUnit` (the `llm`
unit does); for such a unit the worker process

* serves the unit's `kv_store` to other workers (`KVPageServer` on the worker's `Peer`: a
  decode worker pulls a prompt's pages from the prefill worker this way, and any worker
  pulls a prefix that another one computed), unless the unit serves its pages itself
  (`KVServingUnit`: then the index names the unit's peer);
* with a Redis registry, publishes the store's residency to the distributed KV index
  (`RedisKVIndex`, namespace `kv_index_namespace(registry namespace)`), with a liveness
  key of its own, so that `pull_missing` and the KV-aware load balancer find the pages;
* opens the index before the unit is built (`open_index`), so the unit gets it, with the
  worker's `Peer`, in its `UnitContext` (`engine.compute.context.TransferSeat`);
* adds `meta["kv"]` to the worker's registration (what a router needs to hash a prompt
  the way the unit does: model id, page size; see `engine.flow.kvroute`) and the store's
  tier and pull metrics (`kv.*`) to its heartbeats.

Units without a KV cache get a `KVHosting` that does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Protocol, runtime_checkable

from engine.data.kv.errors import KVIndexError
from engine.data.kv.index import KVIndexPublisher, RedisKVIndex
from engine.data.kv.pull import KVPageServer
from engine.data.kv.store import KVStore
from engine.data.peer import Peer
from engine.flow.kvroute import KV_META_KEY, kv_index_namespace

log = logging.getLogger(__name__)

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@runtime_checkable
class KVServingUnit(Protocol):
    """A `KVHostUnit` that serves its pages itself, on a peer of its own (rank 0 of a
    tensor-parallel `llm` role: its store holds only its heads, and it serves pages whole)."""

    def serve_kv(self) -> Peer:
        """The peer whose server answers other workers' page requests (published in the index)."""
        ...


@runtime_checkable
class KVHostUnit(Protocol):
    """A compute unit with a paged KV cache that other workers may read."""

    @property
    def kv_store(self) -> KVStore: ...

    def kv_meta(self) -> dict[str, Any]:
        """JSON-able facts a router needs to hash prompts like the unit: `model_id`, `page_size`."""
        ...


def open_index(registry_url: str | None, namespace: str) -> RedisKVIndex | None:
    """The distributed KV index of a worker registered at `registry_url` (namespace
    `kv_index_namespace(namespace)`), or None without a Redis registry."""
    if registry_url is None or not registry_url.startswith(_REDIS_SCHEMES):
        return None
    return RedisKVIndex.from_url(registry_url, namespace=kv_index_namespace(namespace))


class _IndexLiveness(threading.Thread):
    """Keeps the worker's liveness key in the KV index fresh (lookups ignore workers without one)."""

    def __init__(self, index: RedisKVIndex, worker_id: str, address: str, heartbeat_s: float, ttl_s: float) -> None:
        super().__init__(name="omniflow-kv-index-liveness", daemon=True)
        self._index = index
        self._worker_id = worker_id
        self._address = address
        self._heartbeat_s = heartbeat_s
        self._ttl_s = ttl_s
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.wait(self._heartbeat_s):
            try:
                self._index.heartbeat(self._worker_id, self._address, self._ttl_s)
            except KVIndexError as exc:
                log.warning("KV index heartbeat failed (will retry): %s", exc)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self.join(timeout_s)


class KVHosting:
    """What the worker runs for its unit's KV cache; see the module docstring. `close()` undoes it
    (the store and the peer stay: they belong to the unit and the worker)."""

    def __init__(self) -> None:
        self.meta: dict[str, Any] = {}
        self._store: KVStore | None = None
        self._server: KVPageServer | None = None
        self._index: RedisKVIndex | None = None
        self._publisher: KVIndexPublisher | None = None
        self._liveness: _IndexLiveness | None = None
        self._worker_id = ""
        """The worker its pages are published under (none: a unit without a KV cache)."""

    @classmethod
    def start(
        cls,
        unit: object,
        peer: Peer,
        worker_id: str,
        *,
        index: RedisKVIndex | None,
        heartbeat_s: float,
        ttl_s: float,
    ) -> KVHosting:
        """Host `unit`'s KV cache, served on `peer` (a `KVServingUnit`: on its own; a unit without a
        KV cache: nothing, and `index` is closed here)."""
        hosting = cls()
        if not isinstance(unit, KVHostUnit):
            if index is not None:
                index.client.close()
            return hosting
        hosting._worker_id = worker_id
        store = hosting._store = unit.kv_store
        if isinstance(unit, KVServingUnit):
            peer = unit.serve_kv()
        else:
            hosting._server = KVPageServer(store, peer.server)
        if index is not None:
            hosting._index = index
            try:
                index.register_worker(worker_id, peer.address, ttl_s)
            except KVIndexError as exc:  # the liveness thread registers it once Redis answers
                log.warning("KV index unavailable at start (%s); publishing when it answers", exc)
            hosting._liveness = _IndexLiveness(index, worker_id, peer.address, heartbeat_s, ttl_s)
            hosting._liveness.start()
            hosting._publisher = KVIndexPublisher(index, worker_id)
            hosting._publisher.attach(store)
            hosting._publisher.start()
        hosting.meta = {KV_META_KEY: {**unit.kv_meta(), "index": index.namespace if index is not None else None}}
        return hosting

    def metrics(self) -> dict[str, float]:
        """The store's tier and pull metrics as `kv.<name>` (empty without a KV cache)."""
        if self._store is None:
            return {}
        return {f"kv.{name}": value for name, value in self._store.metrics().items()}

    def close(self) -> None:
        """Stop serving and publishing; the index forgets this worker's pages."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._liveness is not None:
            self._liveness.stop()
            self._liveness = None
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        if self._index is not None:
            if self._worker_id:
                with contextlib.suppress(KVIndexError):
                    self._index.drop_worker(self._worker_id)
            self._index.client.close()
            self._index = None
