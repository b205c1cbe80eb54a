"""Cache keys of prompts with multimodal items.

A prompt's *model* ids put one placeholder token per position an image or audio item
occupies; its *cache key* replaces those positions with a sentinel id derived from
the item's content hash. So the same picture in a later turn gives the same key (and
hits), while a different picture of the same size gives a different key from its
first position on (and never hits). Sentinels live above 2**62, far outside any
vocabulary, and are what the page hash chain hashes (as SGLang does with its pad ids).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

ItemKind = Literal["image", "audio"]
SENTINEL_BASE = 1 << 62
_SENTINEL_BITS = 60


def content_hash(kind: ItemKind, data: bytes | np.ndarray | torch.Tensor) -> str:
    """SHA-256 of an item's kind, and of its bytes (arrays: with their dtype and shape)."""
    digest = hashlib.sha256(kind.encode() + b"\x00")
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().contiguous().numpy()
    if isinstance(data, np.ndarray):
        digest.update(f"{data.dtype.str}:{data.shape}".encode() + b"\x00")
        digest.update(np.ascontiguousarray(data).tobytes())
    else:
        digest.update(bytes(data))
    return digest.hexdigest()


def sentinel_id(item_hash: str) -> int:
    """The cache-key id standing for every placeholder position of the item with this hash."""
    return SENTINEL_BASE | (int(item_hash[: _SENTINEL_BITS // 4], 16) & ((1 << _SENTINEL_BITS) - 1))


@dataclass(frozen=True, slots=True)
class MultimodalItem:
    """An item whose placeholders occupy `[start, start + length)` of the prompt.

    `embeds` (`(length, hidden)`), when given, replace the placeholder tokens'
    embeddings in the forward (an encoder's output spliced into the LLM input).
    """

    kind: ItemKind
    item_hash: str
    start: int
    length: int
    embeds: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.start < 0 or self.length <= 0:
            raise ValueError(f"multimodal item range start={self.start} length={self.length} is invalid")
        if self.embeds is not None and self.embeds.shape[0] != self.length:
            raise ValueError(f"item embeds have {self.embeds.shape[0]} rows for {self.length} positions")

    @property
    def end(self) -> int:
        return self.start + self.length

    def shifted(self, offset: int) -> MultimodalItem:
        return MultimodalItem(self.kind, self.item_hash, self.start + offset, self.length, self.embeds)


def cache_key(token_ids: Sequence[int], items: Sequence[MultimodalItem] = ()) -> list[int]:
    """The cache key of a prompt: its ids with every item's positions replaced by the item's sentinel."""
    key = list(token_ids)
    for item in items:
        if item.end > len(key):
            raise ValueError(f"{item.kind} item [{item.start}, {item.end}) runs past the prompt ({len(key)} ids)")
        key[item.start : item.end] = [sentinel_id(item.item_hash)] * item.length
    return key
