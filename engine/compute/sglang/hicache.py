"""A HiCache storage backend (SGLang's L3) over our KV store's host and disk tiers.

SGLang loads it with `--hicache-storage-backend dynamic` and

    --hicache-storage-backend-extra-config '{"backend_name": "omniflow",
        "module_path": "engine.compute.sglang.hicache",
        "class_name": "OmniFlowHiCacheStorage", "interface_v1": 1, ...}'

`StorageBackendFactory` builds it as `cls(storage_config, kwargs)` and then calls
`register_mem_pool_host(host_pool)`. Pages are keyed by SGLang's own page keys, which
are our `page_hashes` keys (see `engine.data.kv.keys`), so a page SGLang writes is a
page of our `KVStore` (and of the Redis KV index) and the other way round.

`extra_config` (from `hicache_config`, which needs no SGLang) builds that config: its fixed keys
are the runner's, and options other than these are refused. Extra config keys of ours (all optional):

* `store`: the name of a store handed over in-process with `register_store` (a
  worker that already has a `KVStore`); otherwise the backend builds its own when the
  host pool is registered, with
* `host_capacity_bytes` (default 1 GiB), `disk_path` and `disk_capacity_bytes` (a
  disk tier when a path is given; `.tp<rank>` is appended under tensor parallelism);
* `redis_url`, `worker_id`, `index_namespace`: publish residency to a `RedisKVIndex`.

Pages are stored in our page layout `(2, layers, page_size, heads, head_dim)`. The
host pool's layouts `layer_first`, `page_first` and `page_first_direct` are read and
written through views of its buffer (`batch_get_v1`/`batch_set_v1`: one copy between
the host pool and our tier, none through an intermediate tensor when the view is
contiguous). The older `batch_get`/`batch_set` pass flat pages in the host pool's own
order (`get_data_page`); they are converted the same way. MHA pools only.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from engine.compute.sglang.hicache_config import extra_config as extra_config  # the config that loads this
from engine.compute.sglang.sizes import DEFAULT_DISK_CAPACITY_BYTES, DEFAULT_HOST_CAPACITY_BYTES
from engine.data.kv import Capacity, DiskTierConfig, KVLayout, KVStore, KVStoreConfig, WritePolicy
from engine.data.kv.errors import KVConfigError, KVError
from engine.data.kv.index import KVIndexPublisher, RedisKVIndex
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import dtype_name

log = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

_stores: dict[str, KVStore] = {}
_stores_lock = threading.Lock()


def register_store(name: str, store: KVStore) -> None:
    """Hand an existing store to backends created with `extra_config["store"] == name`."""
    with _stores_lock:
        _stores[name] = store


def unregister_store(name: str) -> None:
    with _stores_lock:
        _stores.pop(name, None)


def _read_into(store: KVStore, key: PageHash, dst: torch.Tensor) -> bool:
    """Copy page `key` into `dst` (a view of the host pool); False when the store lacks it."""
    if dst.is_contiguous():
        return store.get(key, out=dst, promote=False) is not None
    page = store.get(key, promote=False)
    if page is None:
        return False
    dst.copy_(page)
    return True


def _write_from(store: KVStore, key: PageHash, src: torch.Tensor) -> bool:
    """Store page `key` from `src` (a view of the host pool) unless it is there already; False
    when the store refuses it."""
    if store.contains(key):
        return True
    try:
        store.put(key, src.contiguous())
    except KVError as exc:
        log.warning("HiCache set of page %s failed: %s", key[:16], exc)
        return False
    return True


def layout_of_host_pool(pool: Any) -> KVLayout:
    """Our page layout for an SGLang MHA host pool (`MHATokenToKVPoolHost`)."""
    if getattr(pool, "layout", None) not in SUPPORTED_LAYOUTS:
        raise KVConfigError(f"host pool layout {getattr(pool, 'layout', None)!r}; one of {SUPPORTED_LAYOUTS}")
    if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
        raise KVConfigError("host pools with a V head dim other than the K head dim are not supported")
    return KVLayout(
        page_size=int(pool.page_size),
        num_layers=int(pool.layer_num),
        num_kv_heads=int(pool.head_num),
        head_dim=int(pool.head_dim),
        dtype=dtype_name(pool.dtype),
    )


class OmniFlowHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 storage backed by an Omni-Flow `KVStore` (host + disk tiers)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        if storage_config.is_mla_model:
            raise KVConfigError("the omniflow HiCache backend stores MHA pages only")
        self.storage_config = storage_config
        self.options: dict[str, Any] = dict(storage_config.extra_config or {})
        self.kwargs = dict(kwargs or {})
        self.mem_pool_host: Any = None
        self.store: KVStore | None = None
        self._owns_store = False
        self._publisher: KVIndexPublisher | None = None
        self._lock = threading.Lock()
        name = self.options.get("store")
        if name is not None:
            with _stores_lock:
                if name not in _stores:
                    raise KVConfigError(f"no KV store registered as {name!r} (register_store)")
                self.store = _stores[name]
            self._attach_index()

    # -- setup -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        layout = layout_of_host_pool(mem_pool_host)
        with self._lock:
            if self.store is None:
                self.store = self._build_store(layout)
                self._owns_store = True
                self._attach_index()
            elif self.store.layout != layout:
                raise KVConfigError(
                    f"store layout {self.store.layout} does not match the host pool's {layout}"
                )
            self.mem_pool_host = mem_pool_host

    def _build_store(self, layout: KVLayout) -> KVStore:
        disk = None
        if self.options.get("disk_path"):
            path = Path(str(self.options["disk_path"]))
            if self.storage_config.tp_size > 1:
                path = path.with_name(f"{path.name}.tp{self.storage_config.tp_rank}")
            capacity = int(self.options.get("disk_capacity_bytes", DEFAULT_DISK_CAPACITY_BYTES))
            disk = DiskTierConfig(path=path, capacity=Capacity(bytes=capacity))
        host = int(self.options.get("host_capacity_bytes", DEFAULT_HOST_CAPACITY_BYTES))
        # The device tier is one CPU page: SGLang's own host pool is the fast tier here.
        return KVStore(
            KVStoreConfig(
                layout=layout,
                device_capacity=Capacity(pages=1),
                host_capacity=Capacity(bytes=host),
                disk=disk,
                write=WritePolicy.WRITE_THROUGH,
                device="cpu",
                pin_host=False,
            )
        )

    def _attach_index(self) -> None:
        url = self.options.get("redis_url")
        if not url or self.store is None:
            return
        index = RedisKVIndex.from_url(
            str(url), namespace=str(self.options.get("index_namespace", "omniflow:kv"))
        )
        worker = str(self.options.get("worker_id") or f"sglang-tp{self.storage_config.tp_rank}")
        index.register_worker(worker, ttl_s=float(self.options.get("worker_ttl_s", 3600.0)))
        publisher = KVIndexPublisher(index, worker)
        publisher.attach(self.store)
        self._publisher = publisher.start()

    def _store(self) -> KVStore:
        if self.store is None:
            raise KVConfigError("no host pool registered yet (register_mem_pool_host) and no store given")
        return self.store

    def flush_index(self) -> int:
        """Write pending residency changes to the KV index now (tests, shutdown)."""
        return self._publisher.flush() if self._publisher is not None else 0

    # -- host pool views --------------------------------------------------------------

    def _pool_page(self, index: int) -> torch.Tensor:
        """A view of the host pool's page starting at token slot `index`, in our page order."""
        pool = self.mem_pool_host
        if pool is None:
            raise KVConfigError("no host pool registered (register_mem_pool_host)")
        size = pool.page_size
        if pool.layout == "layer_first":
            return pool.kv_buffer[:, :, index : index + size]
        if pool.layout == "page_first":
            return pool.kv_buffer[:, index : index + size].transpose(1, 2)
        return pool.kv_buffer[:, index // size]  # page_first_direct

    def _flat_to_page(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page in the host pool's order (`get_data_page`) as our page (a view when possible)."""
        layout = self._store().layout
        pool = self.mem_pool_host
        if pool is not None and pool.layout == "page_first":
            shape = (2, layout.page_size, layout.num_layers, layout.num_kv_heads, layout.head_dim)
            return flat.reshape(shape).transpose(1, 2).contiguous()
        return flat.reshape(layout.page_shape)

    def _page_to_flat(self, page: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        pool = self.mem_pool_host
        ordered = page.transpose(1, 2) if pool is not None and pool.layout == "page_first" else page
        if out is None:
            return ordered.contiguous().flatten()
        out.view(ordered.shape).copy_(ordered)
        return out

    # -- plain interface ---------------------------------------------------------------

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        page = self._store().get(PageHash(key), promote=False)
        if page is None:
            return None
        return self._page_to_flat(page, target_location)

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets, strict=True)]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if value is None:
            return False
        store = self._store()
        if store.contains(PageHash(key)):
            return True
        try:
            store.put(PageHash(key), self._flat_to_page(value.flatten()))
        except KVError as exc:
            log.warning("HiCache set of page %s failed: %s", key[:16], exc)
            return False
        return True

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if values is None or len(values) != len(keys):
            return False
        return all([self.set(key, value) for key, value in zip(keys, values, strict=True)])

    def exists(self, key: str) -> bool:
        return self._store().contains(PageHash(key))

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._store().lookup([PageHash(k) for k in keys]).prefix_pages

    # -- zero-copy interface over the registered host pool ---------------------------------

    def _pool_pages(self, keys: list[str], host_indices: torch.Tensor) -> list[tuple[PageHash, torch.Tensor]]:
        """Each key with the view of its page in the host pool (`host_indices`: the pages' token
        slots, a page's run of `page_size` slots in turn)."""
        size = self.mem_pool_host.page_size if self.mem_pool_host is not None else 0
        if size == 0 or len(host_indices) < len(keys) * size:
            raise KVConfigError(f"{len(host_indices)} host indices for {len(keys)} pages of {size} tokens")
        starts = host_indices[::size][: len(keys)].tolist()
        return [(PageHash(key), self._pool_page(int(start))) for key, start in zip(keys, starts, strict=True)]

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        store = self._store()
        return [_read_into(store, key, dst) for key, dst in self._pool_pages(keys, host_indices)]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        store = self._store()
        return [_write_from(store, key, src) for key, src in self._pool_pages(keys, host_indices)]

    # -- housekeeping ------------------------------------------------------------------

    def clear(self) -> None:
        store = self._store()
        for page in list(store.resident_pages()):
            if not store.lock_count(page):
                store.remove(page)

    def get_stats(self) -> None:
        return None

    def close(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.close()
        if self._owns_store and self.store is not None:
            self.store.close()
        self.store = None
