"""Our page hash chain and multimodal pad sentinels against SGLang 0.5.23's own functions."""

from __future__ import annotations

import random
from array import array

import pytest
from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str as sglang_get_hash_str
from sglang.srt.mem_cache.utils import get_storage_hash_str, storage_namespace_seed

from engine.compute.prefix import MultimodalItem, content_hash
from engine.compute.sglang import keys as sgl_keys
from engine.data.kv import get_hash_str, page_hashes
from engine.data.kv.keys import ExtraKeys
from engine.data.kv.keys import storage_namespace_seed as our_namespace_seed


def _sglang_chain(ids: list[int], page_size: int, prior: str | None = None) -> list[str]:
    keys = []
    for start in range(0, len(ids) - len(ids) % page_size, page_size):
        prior = sglang_get_hash_str(ids[start : start + page_size], prior)
        keys.append(prior)
    return keys


@pytest.mark.parametrize("page_size", [1, 2, 16, 64])
def test_page_chain_equals_sglang_get_hash_str(page_size: int) -> None:
    rng = random.Random(page_size)
    for length in (0, page_size - 1, page_size, 3 * page_size + 1, 200):
        ids = [rng.randrange(0, 152_000) for _ in range(max(length, 0))]
        ours = page_hashes(ids, page_size)
        assert ours == _sglang_chain(ids, page_size)
        # SGLang's batched form (page_size=) gives the same list, partial page dropped.
        full = ids[: len(ids) - len(ids) % page_size]
        if full:
            assert ours == sglang_get_hash_str(full, None, page_size=page_size)


def test_single_page_wide_ids_and_prior_equal_sglang() -> None:
    rng = random.Random(7)
    prior = sglang_get_hash_str([1, 2, 3])
    for page in (
        [0, 1, 2**32 - 1],
        [2**32, 5, 6],  # one wide id switches the whole page to the tagged 8-byte form
        [2**62 + 12345, 2**63 - 1],
        [rng.randrange(0, 2**63) for _ in range(32)],
    ):
        assert get_hash_str(page) == sglang_get_hash_str(page)
        assert get_hash_str(page, prior) == sglang_get_hash_str(page, prior)
        assert get_hash_str(array("q", page)) == sglang_get_hash_str(array("q", page))


def test_continued_chain_and_namespace_seed_equal_sglang() -> None:
    ids = list(range(100, 164))
    head = page_hashes(ids[:32], 8)
    assert page_hashes(ids[32:], 8, prior=head[-1]) == _sglang_chain(ids[32:], 8, head[-1])
    for model, salt in (("qwen", None), (None, "tenant-a"), ("qwen", "tenant-a"), ("", "")):
        assert our_namespace_seed(model, salt) == storage_namespace_seed(model, salt)
        key = RadixKey(array("q", ids), extra_key=model, cache_salt=salt)
        expected = get_storage_hash_str(key, None, page_size=8)
        assert page_hashes(ids, 8, extra_keys=ExtraKeys(model_id=model, tenant_salt=salt or None)) == expected
        assert sgl_keys.sglang_page_hashes(ids, 8, model_id=model, tenant_salt=salt or None) == expected


def _sglang_item(item_hash: str) -> MultimodalDataItem:
    item = MultimodalDataItem(modality=Modality.IMAGE)
    # What TokenizerManager does with GenerateReqInput.mm_hashes entries.
    item.set_hash(int(sgl_keys.mm_hash_hex(item_hash), 16))
    return item


def test_pad_values_equal_sglang_set_hash() -> None:
    hashes = [
        content_hash("image", b"a picture"),
        content_hash("audio", b"a sound"),
        "00000000000000000000000000000000000000000000000000000000000000ff",
        "deadbeef",
        "FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF",
    ]
    for item_hash in hashes:
        item = _sglang_item(item_hash)
        assert item.hash == sgl_keys.mm_hash_value(item_hash)
        assert sgl_keys.pad_values(item_hash) == tuple(item.pad_values)
        assert item.pad_value == sgl_keys.pad_values(item_hash)[0]
        for length in (1, 3, 4, 9, 577):
            assert sgl_keys.padding_sequence(item_hash, length) == item.padding_sequence(length)


def test_multimodal_page_keys_equal_sglang_chain_over_padded_ids() -> None:
    image = content_hash("image", b"\x01" * 64)
    audio = content_hash("audio", b"\x02" * 64)
    prompt = list(range(1000, 1060))
    items = [MultimodalItem("image", image, 5, 20), MultimodalItem("audio", audio, 40, 9)]
    # SGLang's padded ids: text kept, each item's placeholders replaced by its padding sequence.
    padded = list(prompt)
    for ours, hashed in zip(items, (_sglang_item(image), _sglang_item(audio)), strict=True):
        padded[ours.start : ours.end] = hashed.padding_sequence(ours.length)
    assert sgl_keys.sglang_cache_key(prompt, items) == padded
    for page_size in (1, 4, 16):
        assert sgl_keys.sglang_page_hashes(prompt, page_size, items) == _sglang_chain(padded, page_size)
    # A different picture of the same size changes the key from its first page on, not before.
    other = [MultimodalItem("image", content_hash("image", b"\x03" * 64), 5, 20), items[1]]
    a, b = sgl_keys.sglang_page_hashes(prompt, 4, items), sgl_keys.sglang_page_hashes(prompt, 4, other)
    assert a[0] == b[0] and a[1] != b[1]


def test_mm_hash_hex_rejects_non_hex() -> None:
    with pytest.raises(ValueError):
        sgl_keys.mm_hash_hex("not-hex")
