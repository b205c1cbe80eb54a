"""SGLang's multimodal pad sentinels and page keys, derived from our item content hashes.

SGLang 0.5.23 writes an item's *pad values* into the token ids at the item's
placeholder positions, and its page keys (`get_hash_str`) hash those ids. A caller
may supply the item hash (`GenerateReqInput.mm_hashes`, hex strings): the tokenizer
manager calls `MultimodalDataItem.set_hash(int(hex, 16))`, which keeps the low 64
bits (`hash & (2**64 - 1)`), and the pad values are

    digest = sha256(b"sglang-mm-wide-pad-v1" || hash.to_bytes(8, "big"))
    pad[j] = 1_000_000 + (int.from_bytes(digest[8j : 8j + 8], "big") & (2**62 - 1)),  j = 0..3

An item's `n` placeholder positions take `pad[0], pad[1], pad[2], pad[3], pad[0], ...`
(`MultimodalDataItem.padding_sequence`). This module reproduces that in pure Python,
so our content hashes (`engine.compute.prefix.content_hash`, 64 hex digits) passed
as `mm_hashes` give page keys we can compute without SGLang: `sglang_page_hashes`.

Our own prefix cache keeps its sentinels (`engine.compute.prefix.sentinel_id`, one
id above 2**62 per item); these are a second, SGLang-shaped derivation, not a change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from engine.compute.prefix.keys import MultimodalItem
from engine.data.kv.keys import ExtraKeys, PageHash, TokenIds, page_hashes

MM_PAD_SHIFT_VALUE = 1_000_000
MM_HASH_MASK = (1 << 64) - 1
_WIDE_PAD_TAG = b"sglang-mm-wide-pad-v1"
_WIDE_PAD_MASK = (1 << 62) - 1
_PAD_COUNT = 4


def mm_hash_hex(item_hash: str) -> str:
    """The `mm_hashes` entry to send SGLang for an item: its content hash as hex (validated)."""
    int(item_hash, 16)  # raises ValueError when it is not hex, as SGLang would ignore it
    return item_hash.lower()


def mm_hash_value(item_hash: str) -> int:
    """`MultimodalDataItem.hash` after `set_hash(int(item_hash, 16))`: the low 64 bits."""
    return int(item_hash, 16) & MM_HASH_MASK


def pad_values(item_hash: str) -> tuple[int, ...]:
    """The four pad sentinels SGLang derives for an item whose `mm_hashes` entry is `item_hash`."""
    identity = mm_hash_value(item_hash).to_bytes(8, byteorder="big")
    digest = hashlib.sha256(_WIDE_PAD_TAG + identity).digest()
    return tuple(
        MM_PAD_SHIFT_VALUE + (int.from_bytes(digest[i : i + 8], byteorder="big") & _WIDE_PAD_MASK)
        for i in range(0, 8 * _PAD_COUNT, 8)
    )


def padding_sequence(item_hash: str, length: int) -> list[int]:
    """The ids SGLang writes over `length` placeholder positions of the item."""
    values = pad_values(item_hash)
    repeats, remainder = divmod(length, len(values))
    return list(values) * repeats + list(values[:remainder])


def sglang_cache_key(token_ids: Sequence[int], items: Sequence[MultimodalItem] = ()) -> list[int]:
    """The token ids SGLang hashes: every item's positions replaced by its padding sequence."""
    key = [int(t) for t in token_ids]
    for item in items:
        if item.end > len(key):
            raise ValueError(
                f"{item.kind} item [{item.start}, {item.end}) runs past the prompt ({len(key)} ids)"
            )
        key[item.start : item.end] = padding_sequence(item.item_hash, item.length)
    return key


def sglang_page_hashes(
    token_ids: TokenIds,
    page_size: int,
    items: Sequence[MultimodalItem] = (),
    *,
    model_id: str | None = None,
    tenant_salt: str | None = None,
    prior: str | None = None,
) -> list[PageHash]:
    """SGLang's HiCache page keys of a prompt whose items were sent with `mm_hashes=[item_hash...]`.

    Without `model_id`/`tenant_salt` these are `get_hash_str` chain keys; with them the
    chain is seeded like SGLang's `get_storage_hash_str` (`extra_key`, `cache_salt`).
    """
    ids = sglang_cache_key(list(token_ids), items) if items else token_ids
    extra = ExtraKeys(model_id=model_id, tenant_salt=tenant_salt)
    return page_hashes(ids, page_size, extra_keys=extra, prior=prior)
