"""How much host memory and disk an `sglang_llm` role's hierarchical cache takes, per process,
read from its params and its checkpoint's `config.json` (no SGLang import): what quotas count.

* host: Omni-Flow's host tier (`hicache.host_capacity_bytes`, default 1 GiB) and SGLang's own
  host pool, `hicache_ratio` times its device pool in tokens, at the device pool's bytes per
  token (plus a page: SGLang rounds the pool to whole pages). The device pool is known here only
  when the role caps it (`sglang.max_total_tokens`, an upper bound of SGLang's pool) and the
  checkpoint's config gives its KV shape; otherwise SGLang sizes it from the GPU it is given
  (`mem_fraction_static`), nothing here bounds the pool, and `HiCacheBytes.why_unbounded` says
  why: the studio refuses such a role rather than count only its tier
  (`studio.workflows.specs.sglang_role_issues`, `studio.workflows.quotas`).
* disk: the disk tier (`hicache.disk_capacity_bytes`, default 8 GiB) where `hicache.disk_path` is set.

A replica of a role is `tp_size` processes (an `sglang_llm` role runs with tp_size 1).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_HOST_CAPACITY_BYTES = 1 << 30
"""Omni-Flow's host tier of a role whose `hicache` sets no `host_capacity_bytes`."""
DEFAULT_DISK_CAPACITY_BYTES = 8 << 30
"""Its disk tier (with a `disk_path`) when no `disk_capacity_bytes` is set."""
DEFAULT_HICACHE_RATIO = 2.0
DEFAULT_PAGE_SIZE = 16

UNCAPPED = ("params.sglang.max_total_tokens is not set, so SGLang sizes its device pool, and its host pool"
            " (hicache_ratio times that), from the GPU it is given")
NO_SHAPE = ("the checkpoint's config.json cannot be read here or does not give its KV shape (num_hidden_layers,"
            " num_attention_heads, num_key_value_heads, head_dim or hidden_size)")

_DTYPE_BYTES = {"half": 2, "float16": 2, "bfloat16": 2, "bf16": 2, "float": 4, "float32": 4,
                "fp8_e5m2": 1, "fp8_e4m3": 1}


@dataclass(frozen=True, slots=True)
class HiCacheBytes:
    """One process's HiCache: bytes of host memory (Omni-Flow's tier and SGLang's pool) and disk."""

    tier: int
    """Omni-Flow's host tier."""
    pool: int | None
    """SGLang's host pool; None where its device pool's size is not known here."""
    disk: int
    why_unbounded: str = ""
    """Why `pool` is None, for people ('' when it is known)."""

    @property
    def host(self) -> int:
        """Host memory counted: the tier, and the pool where it is known."""
        return self.tier + (self.pool or 0)

    def describe_host(self) -> str:
        """What `host` is made of, for people."""
        tier = f"host tier {self.tier}"
        return tier if self.pool is None else f"{tier} + SGLang host pool {self.pool}"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def element_bytes(config: Mapping[str, Any], sglang: Mapping[str, Any]) -> int:
    """Bytes of one K or V element in SGLang's pools: `kv_cache_dtype`, else the engine's `dtype`,
    else the checkpoint's own (`torch_dtype`); counted at 4 bytes where none says (SGLang may
    run a float32 checkpoint in 16 bits: the count is then an upper bound)."""
    for name in (sglang.get("kv_cache_dtype"), sglang.get("dtype"), config.get("torch_dtype"), config.get("dtype")):
        if isinstance(name, str) and name in _DTYPE_BYTES:
            return _DTYPE_BYTES[name]
    return 4


def kv_bytes_per_token(config: Mapping[str, Any], sglang: Mapping[str, Any]) -> int | None:
    """Bytes one token's K and V take over every layer (multi-head or grouped-query attention),
    from a checkpoint's `config.json` values; None when they do not say."""
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    if not (isinstance(layers, int) and isinstance(heads, int) and layers > 0 and heads > 0):
        return None
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim")
    if head_dim is None and isinstance(config.get("hidden_size"), int):
        head_dim = config["hidden_size"] // heads
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int) and kv_heads > 0 and head_dim > 0):
        return None
    return 2 * layers * kv_heads * head_dim * element_bytes(config, sglang)


def hicache_bytes(params: Mapping[str, Any], config: Mapping[str, Any] | None) -> HiCacheBytes:
    """One process's HiCache for role `params` (validated against the role kind's schema, or
    not: a value of the wrong type counts as its default) and its checkpoint's `config` (None:
    not readable here)."""
    hicache = params.get("hicache")
    hicache = hicache if isinstance(hicache, Mapping) else {}
    sglang = params.get("sglang")
    sglang = sglang if isinstance(sglang, Mapping) else {}
    tier = hicache.get("host_capacity_bytes")
    tier = int(tier) if _number(tier) else DEFAULT_HOST_CAPACITY_BYTES
    disk = 0
    if hicache.get("disk_path"):
        size = hicache.get("disk_capacity_bytes")
        disk = int(size) if _number(size) else DEFAULT_DISK_CAPACITY_BYTES
    tokens = sglang.get("max_total_tokens")
    if not _number(tokens):
        return HiCacheBytes(tier=tier, pool=None, disk=disk, why_unbounded=UNCAPPED)
    per_token = kv_bytes_per_token(config, sglang) if config is not None else None
    if per_token is None:
        return HiCacheBytes(tier=tier, pool=None, disk=disk, why_unbounded=NO_SHAPE)
    ratio = params.get("hicache_ratio")
    ratio = float(ratio) if _number(ratio) else DEFAULT_HICACHE_RATIO
    page = params.get("page_size")
    page = int(page) if _number(page) else DEFAULT_PAGE_SIZE
    return HiCacheBytes(tier=tier, pool=(int(tokens * ratio) + page) * per_token, disk=disk)


def checkpoint_config(folder: Path | None) -> dict[str, Any] | None:
    """A checkpoint folder's `config.json` values; None without a folder, or when it cannot be read."""
    if folder is None:
        return None
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


__all__ = ["DEFAULT_DISK_CAPACITY_BYTES", "DEFAULT_HOST_CAPACITY_BYTES", "NO_SHAPE", "UNCAPPED", "HiCacheBytes",
           "checkpoint_config", "element_bytes", "hicache_bytes", "kv_bytes_per_token"]
