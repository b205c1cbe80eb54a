"""Prefix matching: a page-aligned radix tree over cache keys, and multimodal cache keys."""

from __future__ import annotations

from engine.compute.prefix.keys import MultimodalItem, cache_key, content_hash, sentinel_id
from engine.compute.prefix.radix import MatchResult, Namespace, PrefixLockError, RadixCache, RadixNode

__all__ = [
    "MatchResult",
    "MultimodalItem",
    "Namespace",
    "PrefixLockError",
    "RadixCache",
    "RadixNode",
    "cache_key",
    "content_hash",
    "sentinel_id",
]
