"""Paged KV cache of the Data Flow layer.

* `layout`: `KVLayout`, the geometry and bytes of one page (page-first, contiguous).
* `keys`: `PageHash` and `page_hashes`, the SHA-256 page chain shared with SGLang.
* `device`, `host`, `disk`: the three tiers (torch slots; a named shared-memory
  segment other processes map with `HostPageReader`; a checksummed segment file).
* `store`: `KVStore`, one per worker process, serving every role in it; its parts:
  `hierarchy` (the tiers and the moves of pages between them), `locks` (pages locked for
  compute), `loan` (pages lent in place), `prefetch` (background promotion), `config`
  (`KVStoreConfig`), `events` (`KVEvent`).
* `index`: `RedisKVIndex` and `KVIndexPublisher`, which worker holds which pages.
* `pull`: `KVPageServer` and `fetch_pages`, pages between workers' stores.
* `source`: `PageSource` and its kinds, where a store gets pages it lacks (another store, a
  named holder, the holder the index names).
* `ref`: `KVRef`, the `kv` value of llm nodes (pages, holder, a prefill's hold).

The names below load their module on first use (PEP 562), so that a process which only passes
`KVRef`s along (the studio, a flow executor) does not import torch with the tiers.
"""

from typing import TYPE_CHECKING

from engine.lazy import lazy_attributes

if TYPE_CHECKING:
    from engine.data.kv.errors import (
        KVCapacityError,
        KVClosedError,
        KVConfigError,
        KVError,
        KVIndexError,
        KVLayoutError,
        KVLockError,
        KVPageNotFound,
        KVTimeoutError,
        KVTransferError,
    )
    from engine.data.kv.keys import ExtraKeys, MMItem, PageHash, get_hash_str, page_hashes
    from engine.data.kv.layout import KVLayout
    from engine.data.kv.policy import EvictionPolicy
    from engine.data.kv.store import (
        DiskTierConfig,
        KVEvent,
        KVEventKind,
        KVStore,
        KVStoreConfig,
        LookupResult,
        PrefetchHandle,
        PrefetchResult,
        WritePolicy,
    )
    from engine.data.kv.tier import Capacity, Tier

_HOMES = {
    "errors": ("KVCapacityError", "KVClosedError", "KVConfigError", "KVError", "KVIndexError", "KVLayoutError",
               "KVLockError", "KVPageNotFound", "KVTimeoutError", "KVTransferError"),
    "keys": ("ExtraKeys", "MMItem", "PageHash", "get_hash_str", "page_hashes"),
    "layout": ("KVLayout",),
    "policy": ("EvictionPolicy",),
    "store": ("DiskTierConfig", "KVEvent", "KVEventKind", "KVStore", "KVStoreConfig", "LookupResult",
              "PrefetchHandle", "PrefetchResult", "WritePolicy"),
    "tier": ("Capacity", "Tier"),
}
__getattr__ = lazy_attributes(__name__, _HOMES)


__all__ = [
    "Capacity",
    "DiskTierConfig",
    "EvictionPolicy",
    "ExtraKeys",
    "KVCapacityError",
    "KVClosedError",
    "KVConfigError",
    "KVError",
    "KVEvent",
    "KVEventKind",
    "KVIndexError",
    "KVLayout",
    "KVLayoutError",
    "KVLockError",
    "KVPageNotFound",
    "KVStore",
    "KVStoreConfig",
    "KVTimeoutError",
    "KVTransferError",
    "LookupResult",
    "MMItem",
    "PageHash",
    "PrefetchHandle",
    "PrefetchResult",
    "Tier",
    "WritePolicy",
    "get_hash_str",
    "page_hashes",
]
