"""What one process of an `sglang_llm` role gives its hierarchical cache (`engine.compute.sglang.sizes`):
the per-token KV bytes against a real model's cache, the defaults, and SGLang's host pool where it is
known, with why where it is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.compute.sglang.sizes import (
    DEFAULT_DISK_CAPACITY_BYTES,
    DEFAULT_HOST_CAPACITY_BYTES,
    NO_SHAPE,
    UNCAPPED,
    HiCacheBytes,
    checkpoint_config,
    element_bytes,
    hicache_bytes,
    kv_bytes_per_token,
)

SHAPE = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
         "intermediate_size": 128, "vocab_size": 97}


def cache_bytes_per_token(config: LlamaConfig, dtype: torch.dtype, tokens: int = 5) -> int:
    """The bytes of K and V a Hugging Face forward keeps per token (the independent reference)."""
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        cache = model(torch.arange(tokens)[None], use_cache=True).past_key_values
    total = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                for layer in cache.layers)
    return total // tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_bytes_per_token_match_a_real_models_cache(dtype: torch.dtype) -> None:
    config = LlamaConfig(**SHAPE, torch_dtype=str(dtype).removeprefix("torch."))
    assert kv_bytes_per_token(config.to_dict(), {}) == cache_bytes_per_token(config, dtype)


def test_which_dtype_counts() -> None:
    config = {**SHAPE, "torch_dtype": "float32"}
    assert element_bytes(config, {}) == 4
    assert element_bytes(config, {"dtype": "bfloat16"}) == 2
    assert element_bytes(config, {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2"}) == 1
    assert element_bytes(config, {"kv_cache_dtype": "auto", "dtype": "auto"}) == 4  # the checkpoint's
    assert element_bytes(SHAPE, {}) == 4  # nothing says: the most SGLang would keep
    assert kv_bytes_per_token({**SHAPE, "head_dim": 8}, {"dtype": "half"}) == 2 * 3 * 2 * 8 * 2


@pytest.mark.parametrize("config", [{}, {"num_hidden_layers": 3}, {**SHAPE, "hidden_size": None},
                                    {**SHAPE, "num_key_value_heads": "2"}])
def test_a_config_that_does_not_say_its_shape_gives_none(config: dict) -> None:
    assert kv_bytes_per_token(config, {}) is None


def test_the_tiers_defaults_and_the_pool_only_where_the_device_pool_is_capped() -> None:
    assert hicache_bytes({}, SHAPE) == HiCacheBytes(DEFAULT_HOST_CAPACITY_BYTES, None, 0, UNCAPPED)
    assert hicache_bytes({"hicache": {"disk_path": "kv"}}, None).disk == DEFAULT_DISK_CAPACITY_BYTES
    assert hicache_bytes({"hicache": {"disk_capacity_bytes": 5}}, None).disk == 0  # no disk tier without a path
    assert hicache_bytes({"hicache": {"host_capacity_bytes": True}}, None).tier == DEFAULT_HOST_CAPACITY_BYTES
    per_token = 2 * 3 * 2 * 16 * 4
    capped = {"sglang": {"max_total_tokens": 1000}, "hicache_ratio": 3, "page_size": 8,
              "hicache": {"host_capacity_bytes": 100}}
    sized = hicache_bytes(capped, SHAPE)
    assert sized == HiCacheBytes(100, (3000 + 8) * per_token, 0)
    assert sized.host == 100 + (3000 + 8) * per_token
    assert hicache_bytes({**capped, "hicache_ratio": None}, SHAPE).pool == (2000 + 8) * per_token  # default 2
    assert hicache_bytes(capped, None) == HiCacheBytes(100, None, 0, NO_SHAPE)  # no shape: not known here
    assert hicache_bytes(capped, {"num_hidden_layers": 3}).why_unbounded == NO_SHAPE
    assert hicache_bytes({**capped, "sglang": {}}, SHAPE) == HiCacheBytes(100, None, 0, UNCAPPED)  # not capped
    assert "params.sglang.max_total_tokens" in UNCAPPED


def test_checkpoint_config(tmp_path: Path) -> None:
    assert checkpoint_config(None) is None and checkpoint_config(tmp_path) is None
    (tmp_path / "config.json").write_text("[1, 2]")
    assert checkpoint_config(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert checkpoint_config(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps(SHAPE))
    assert checkpoint_config(tmp_path) == SHAPE
