"""Page keys against vectors produced by SGLang 0.5.23's own native hash helper.

The expected digests below were produced once by building
`sglang/srt/mem_cache/cpp_utils/hash_binding.cpp` from the `sglang==0.5.23` wheel and
calling it through `get_hash_str` / `get_storage_hash_str`; they are an independent
reference, not this module's earlier output.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from engine.data.kv.keys import ExtraKeys, MMItem, get_hash_str, page_hashes, storage_namespace_seed

TOKENS = list(range(100, 140))
SGLANG_CHAIN_16 = [
    "34819f75ed7b029ce33517f976a03f67d74fac07003ef23ab361aaf7ef214b68",
    "b359ff706833ab50906de18766614b2b38838a7448199a16427ccddc9548eac2",
    # SGLang also keys the trailing partial page (bc6d89af...); we do not cache partial pages.
]


def test_single_page_matches_sglang() -> None:
    assert get_hash_str([1, 2, 3, 4]) == "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
    assert get_hash_str([]) == hashlib.sha256(b"").hexdigest()


def test_chain_matches_sglang_and_drops_partial_page() -> None:
    assert page_hashes(TOKENS, 16) == SGLANG_CHAIN_16


def test_prior_continues_the_chain() -> None:
    prior = SGLANG_CHAIN_16[0]
    expected = "c82c8d78ad9284f090d87c6bda4c889de4510dcfbc03c113d32eeab230f38e27"
    assert page_hashes(list(range(200, 216)), 16, prior=prior) == [expected]
    assert get_hash_str(list(range(200, 216)), prior) == expected


def test_wide_token_ids_use_tagged_eight_byte_encoding() -> None:
    assert page_hashes([1, 2**40, 3, 4, 5, 6, 7, 8], 4) == [
        "4775a3d17f37dba78a63049c5df850afba007a7a81f0611c1cafde30a3b0ea5e",
        "032fec408ada491599bbbb84eda73955d36fadc986797c319b3d1a838223a47d",
    ]
    assert page_hashes([2**32 - 1, 0, 7, 9], 4) == [
        "a6e0da979d4847d0539e0a72ebb3a4f0a2f45c3a074e2641d12521c93ca5f5f7"
    ]


def test_model_and_tenant_seed_match_sglang_namespace() -> None:
    seed = storage_namespace_seed("llama-3-8b", "tenant-a")
    assert seed == "ebc493213e064dd904c7e11b602224fe62a4dc6be944c75576492e45bcf65720"
    assert page_hashes(TOKENS[:32], 16, extra_keys=ExtraKeys("llama-3-8b", "tenant-a")) == [
        "66da6d2607756b580dfafe65d30ce02514f16583cae61c82b15fa194863ba493",
        "43de98d88d680502ff54c979b58bea27f451cb4e9b10e5fe247963137c29383a",
    ]
    assert page_hashes(TOKENS[:16], 16, extra_keys=ExtraKeys(tenant_salt="tenant-a")) == [
        "5f07d2cc78500f66173616693d2ef53eff87ce77b971120e2acefe28aaef8dbc"
    ]
    assert page_hashes(TOKENS[:16], 16, extra_keys=ExtraKeys(model_id="llama-3-8b")) == [
        "8a6c4e933bd16485fd8f78322f438c55fd1b69d43f39804abe4d67fcad034023"
    ]
    assert page_hashes(TOKENS, 16, extra_keys=ExtraKeys()) == SGLANG_CHAIN_16


def test_inputs_as_numpy_and_torch_give_the_same_keys() -> None:
    assert page_hashes(np.array(TOKENS, dtype=np.int32), 16) == SGLANG_CHAIN_16
    assert page_hashes(torch.tensor(TOKENS), 16) == SGLANG_CHAIN_16


def test_multimodal_items_change_only_the_pages_they_overlap_and_later() -> None:
    plain = page_hashes(TOKENS, 8)  # 5 pages
    cat = page_hashes(TOKENS, 8, extra_keys=ExtraKeys(mm_items=(MMItem("cat", 17, 20),)))
    dog = page_hashes(TOKENS, 8, extra_keys=ExtraKeys(mm_items=(MMItem("dog", 17, 20),)))
    moved = page_hashes(TOKENS, 8, extra_keys=ExtraKeys(mm_items=(MMItem("cat", 18, 21),)))
    assert cat[:2] == plain[:2] == dog[:2]
    assert len({cat[2], dog[2], plain[2], moved[2]}) == 4
    assert all(c != d for c, d in zip(cat[2:], dog[2:], strict=True))


def test_bad_token_ids_are_rejected() -> None:
    with pytest.raises(ValueError):
        page_hashes([-1, 0, 0, 0], 4)
    with pytest.raises(ValueError):
        page_hashes([2**64, 0, 0, 0], 4)
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        MMItem("x", 5, 5)
