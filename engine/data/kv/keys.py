"""Page keys: a SHA-256 hash chain over page-aligned token ids, byte-compatible with SGLang.

The key of page *i* of a sequence is

    sha256(digest(page i-1) || encode(token ids of page i) [|| multimodal record])

with no prior digest for the first page of a chain unless the chain is seeded (see
below). This is SGLang HiCache's page key (`sglang.srt.mem_cache.utils.get_hash_str`
in 0.5.23, whose native helper is `cpp_utils/hash_binding.cpp`), reproduced exactly
in pure Python so that the same prefix has the same key in both systems:

* `prior`: the previous page's digest as its 32 raw bytes (the hex key decoded);
  nothing at all for the first page of an unseeded chain.
* token ids: when every id of the page fits in 32 bits, each id as 4-byte
  little-endian unsigned; when any id of the page is wider, one `0xff` tag byte and
  then every id of that page as 8-byte little-endian unsigned (the odd byte count
  keeps the two encodings apart). Ids must be in `[0, 2**63)`, as in SGLang.
* the key is the lowercase hex digest.

Extra keys are folded in at two places:

* Model id and tenant salt seed the chain: the first page's prior is
  `storage_namespace_seed(model_id, tenant_salt)`, which is SGLang's own namespace
  seed with `extra_key=model_id` and `cache_salt=tenant_salt`
  (`get_storage_hash_str`). With neither set the chain is unseeded, so with no extra
  keys at all the keys equal SGLang's `get_hash_str` keys exactly.
* Multimodal items (`MMItem`: the content hash of an image/audio item and the token
  range its placeholder tokens occupy) are folded into exactly the pages they
  overlap, so the text before an item stays shareable and every later page differs
  through the chain. Such a page is encoded as: prior, a `0xfe` tag byte, the page's
  token count as u32 LE, every id as u64 LE, then per overlapping item (ordered by
  start, then hash) its start and end relative to the page start as i64 LE and its
  hash as u32 LE length + UTF-8 bytes. SGLang has no such record (it writes item
  hashes into the pad token ids instead); callers that use SGLang-style pad ids need
  no `MMItem` and keep full compatibility.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

PageHash = NewType("PageHash", str)
"""Hex SHA-256 digest naming one page of KV cache (64 lowercase hex characters)."""

_WIDE_TAG = b"\xff"
_MM_TAG = b"\xfe"
_U32_LIMIT = 1 << 32
_I64_LIMIT = 1 << 63
_NAMESPACE_DOMAIN = b"sglang-cache-namespace-v1"

TokenIds: TypeAlias = "Sequence[int] | np.ndarray | torch.Tensor"


@dataclass(frozen=True, slots=True)
class MMItem:
    """A multimodal item whose placeholder tokens occupy `[start, end)` of the token ids."""

    item_hash: str
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(f"MMItem range [{self.start}, {self.end}) is empty or negative")


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What besides the token ids tells two pages apart: model, tenant, multimodal inputs."""

    model_id: str | None = None
    tenant_salt: str | None = None
    mm_items: tuple[MMItem, ...] = ()


def storage_namespace_seed(extra_key: str | None, cache_salt: str | None) -> PageHash | None:
    """SGLang's chain seed for a namespace (`sglang.srt.mem_cache.utils.storage_namespace_seed`).

    sha256("sglang-cache-namespace-v1", then per part: `0x00` if absent, else `0x01`,
    its UTF-8 length as u64 LE and its bytes); `None` when both parts are absent.
    """
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(_NAMESPACE_DOMAIN)
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return PageHash(digest.hexdigest())


def _as_int64(token_ids: TokenIds) -> np.ndarray:
    torch_module = sys.modules.get("torch")  # a tensor exists only where torch is loaded: hashing never loads it
    if torch_module is not None and isinstance(token_ids, torch_module.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    try:
        ids = np.asarray(token_ids, dtype=np.int64)
    except OverflowError as exc:
        raise ValueError("token ids must be in [0, 2**63)") from exc
    if ids.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {ids.shape}")
    if ids.size and int(ids.min()) < 0:
        raise ValueError("token ids must be in [0, 2**63)")
    return ids


def _page_token_bytes(page: np.ndarray) -> bytes:
    if page.size and int(page.max()) >= _U32_LIMIT:
        return _WIDE_TAG + page.astype("<u8").tobytes()
    return page.astype("<u4").tobytes()


def _chain_step(prior: str | None, payload: bytes) -> PageHash:
    hasher = hashlib.sha256()
    if prior:
        hasher.update(bytes.fromhex(prior))
    hasher.update(payload)
    return PageHash(hasher.hexdigest())


def get_hash_str(token_ids: TokenIds, prior_hash: str | None = None) -> PageHash:
    """The key of one page: SGLang's `get_hash_str(token_ids, prior_hash)`, byte for byte."""
    return _chain_step(prior_hash, _page_token_bytes(_as_int64(token_ids)))


def _mm_record(page: np.ndarray, page_start: int, items: list[MMItem]) -> bytes:
    parts = [_MM_TAG, struct.pack("<I", page.size), page.astype("<u8").tobytes()]
    for item in sorted(items, key=lambda it: (it.start, it.end, it.item_hash)):
        encoded = item.item_hash.encode("utf-8")
        parts.append(struct.pack("<qqI", item.start - page_start, item.end - page_start, len(encoded)))
        parts.append(encoded)
    return b"".join(parts)


def page_hashes(
    token_ids: TokenIds,
    page_size: int,
    *,
    extra_keys: ExtraKeys | None = None,
    prior: str | None = None,
) -> list[PageHash]:
    """Keys of every full page of `token_ids`; a trailing partial page has no key (it is not cached).

    `prior` continues an existing chain: it is the key of the page just before
    `token_ids[0]`, and then the namespace seed is not applied again (the prior already
    carries it). `MMItem` ranges are relative to `token_ids[0]`.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    ids = _as_int64(token_ids)
    extra = extra_keys or ExtraKeys()
    chain: str | None = prior
    if chain is None:
        chain = storage_namespace_seed(extra.model_id, extra.tenant_salt)
    num_pages = ids.size // page_size
    pages = ids[: num_pages * page_size].reshape(num_pages, page_size)
    wide = (pages >= _U32_LIMIT).any(axis=1) if num_pages else np.zeros(0, dtype=bool)
    narrow = pages.astype("<u4") if num_pages and not wide.all() else None
    keys: list[PageHash] = []
    for index in range(num_pages):
        start = index * page_size
        end = start + page_size
        overlapping = [it for it in extra.mm_items if it.start < end and it.end > start]
        if overlapping:
            payload = _mm_record(pages[index], start, overlapping)
        elif wide[index]:
            payload = _WIDE_TAG + pages[index].astype("<u8").tobytes()
        else:
            assert narrow is not None
            payload = narrow[index].tobytes()
        chain = _chain_step(chain, payload)
        keys.append(chain)
    return keys
