"""What an encoder hands the LLM: an item's embeddings and content hash, and how a prompt is spliced.

A prompt that mixes text and items is written as *model ids* with one placeholder token
(`<|image|>` or `<|audio|>`) per embedding row of each item, plus one `MultimodalItem`
per item that says where its rows go. The LLM replaces the placeholders' token
embeddings with the rows (`PrefillChunk.embeds`), and its cache key replaces them with
the item's sentinel (`engine.compute.prefix.keys.cache_key`): the same content hits,
different content of the same size never does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.compute.models.tokenizer import AUDIO_ID, IMAGE_ID
from engine.compute.prefix.keys import ItemKind, MultimodalItem

PLACEHOLDER_IDS: dict[str, int] = {"image": IMAGE_ID, "audio": AUDIO_ID}


@dataclass(frozen=True, slots=True)
class EncodedItem:
    """One encoded image or audio clip: `embeds` is `(length, llm_hidden)` float32."""

    kind: ItemKind
    item_hash: str
    embeds: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.embeds.shape[0])

    def at(self, start: int) -> MultimodalItem:
        """The item placed at prompt position `start`."""
        return MultimodalItem(self.kind, self.item_hash, start, self.length, self.embeds)

    def describe(self) -> dict[str, Any]:
        """JSON-ready description (what an encoder node returns beside the embeddings tensor)."""
        return {"kind": self.kind, "hash": self.item_hash, "length": self.length,
                "hidden": int(self.embeds.shape[1])}


@dataclass(frozen=True, slots=True)
class SplicedPrompt:
    """Model ids with placeholders, and the items that fill them (positions into `token_ids`)."""

    token_ids: list[int]
    items: list[MultimodalItem]


def splice_prompt(parts: Sequence[str | Sequence[int] | EncodedItem],
                  encode: Callable[[str], list[int]]) -> SplicedPrompt:
    """Join text (tokenized with `encode`), token ids and encoded items into one prompt.

    Each item contributes `item.length` placeholder ids of its kind.
    """
    ids: list[int] = []
    items: list[MultimodalItem] = []
    for part in parts:
        if isinstance(part, EncodedItem):
            items.append(part.at(len(ids)))
            ids.extend([PLACEHOLDER_IDS[part.kind]] * part.length)
        elif isinstance(part, str):
            ids.extend(encode(part))
        else:
            ids.extend(int(t) for t in part)
    return SplicedPrompt(ids, items)
