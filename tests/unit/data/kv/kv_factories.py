"""Factories for the KV cache tests: small layouts, seeded pages, byte comparisons.

A module with a unique name (not conftest) so that test modules import it unambiguously.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from engine.data.kv.host import SHM_DIR
from engine.data.kv.keys import PageHash, page_hashes
from engine.data.kv.layout import KVLayout
from engine.data.kv.store import KVStore

SHM_PREFIX = "omniflow-kv-"


def small_layout(dtype: str = "bfloat16") -> KVLayout:
    return KVLayout(page_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype)


def make_page(layout: KVLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.page_shape, generator=gen).to(layout.torch_dtype)


def make_keys(n: int, page_size: int = 4, start: int = 1000) -> list[PageHash]:
    return page_hashes(list(range(start, start + n * page_size)), page_size)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, for bit-exact comparisons (NaN-safe, dtype-agnostic)."""
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(raw(a), raw(b))


def shm_segments() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX)}


StoreFactory = Callable[..., KVStore]
