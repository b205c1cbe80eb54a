"""The extra config that loads our HiCache backend into SGLang, built without importing SGLang.

SGLang's `dynamic` storage backend imports `module_path` and instantiates `class_name` from this
config, so those keys (and the rest of `FIXED_KEYS`) are the runner's, never an option's: an
option naming one is refused rather than merged. The options are those of
`engine.compute.kinds.SGLANG_HICACHE_PARAMS` (what a role's `hicache` param may hold); any other
name is refused too. The backend itself (`engine.compute.sglang.hicache`) imports SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.compute.kinds import SGLANG_HICACHE_PARAMS
from engine.data.kv.errors import KVConfigError

BACKEND_MODULE = "engine.compute.sglang.hicache"
BACKEND_CLASS = "OmniFlowHiCacheStorage"
FIXED_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "store")
"""Keys the runner sets: which code SGLang loads, and the in-process store it is handed."""
OPTIONS = tuple(SGLANG_HICACHE_PARAMS["properties"])


def extra_config(options: Mapping[str, Any] | None = None, *, store: str | None = None) -> dict[str, Any]:
    """The `--hicache-storage-backend-extra-config` that loads our backend (as a dict), with `options`
    (names of `OPTIONS`: a role's `hicache` param) and `store` (the runner's: a store handed over
    in-process with `hicache.register_store`).

    Raises KVConfigError naming an option that would replace a fixed key, or that is not an option."""
    options = dict(options or {})
    fixed = sorted(set(options) & set(FIXED_KEYS))
    if fixed:
        raise KVConfigError(f"HiCache options {fixed} are set by the runner (which code SGLang loads), not by options")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise KVConfigError(f"unknown HiCache options {unknown} (known: {list(OPTIONS)})")
    config: dict[str, Any] = {
        **options,
        "backend_name": "omniflow",
        "module_path": BACKEND_MODULE,
        "class_name": BACKEND_CLASS,
        "interface_v1": 1,
    }
    if store is not None:
        config["store"] = store
    return config
