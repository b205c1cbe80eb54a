"""Models: the catalogue, what a role's weights are, and a model's text side without its weights.

* `model_catalogue` -- every role kind's built-in models (packaged real LLMs, then the tiny seeded
  ones, encoders and decoders); `is_builtin_model` -- whether a name is one of them;
* `role_weights`, `Weights` -- whether a role computes with trained or seeded (random) weights;
* `load_model_text`, `ModelText` -- a model's tokenizer (`ModelTokenizer`: encode, decode, chat
  prompts, `ChatPromptError`) and the token ids that end its generations, read without loading
  its weights; `ModelLoadError` for an unknown name or an unreadable checkpoint;
* `RoleTokenizers` -- `(role, text) -> token ids` for the llm roles, loaded once per model: the
  `PromptTokenizer` that KV-aware routing (`engine.client.plane`) tokenizes text prompts with;
* `hicache_bytes`, `HiCacheBytes`, `checkpoint_config` -- the host memory and disk one process of
  an `sglang_llm` role gives its hierarchical cache (`engine.compute.sglang.sizes`: what quotas count).

Importing it loads neither torch nor transformers: loading a model's text does, on first use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.compute.builtin_models import model_catalogue, role_weights
from engine.compute.models.cache import ModelCacheConfig
from engine.compute.models.catalog import BUILTIN_MODELS, Weights
from engine.compute.models.errors import ModelLoadError
from engine.compute.models.packaged import PACKAGED_MODELS
from engine.compute.models.role_tokenizers import RoleTokenizers
from engine.compute.models.text import ChatPromptError, ModelTokenizer
from engine.compute.sglang.sizes import HiCacheBytes, checkpoint_config, hicache_bytes

__all__ = [
    "ChatPromptError",
    "HiCacheBytes",
    "ModelLoadError",
    "ModelText",
    "ModelTokenizer",
    "RoleTokenizers",
    "Weights",
    "checkpoint_config",
    "hicache_bytes",
    "is_builtin_model",
    "load_model_text",
    "model_cache_root",
    "model_catalogue",
    "role_weights",
]


def model_cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """Where a process with `environ` builds and keeps packaged models' checkpoints (`OMNIFLOW_CACHE_DIR`)."""
    return ModelCacheConfig.from_env(environ).root


def is_builtin_model(name: str) -> bool:
    """Whether `name` names a built-in model (a tiny seeded one or a packaged real one) rather
    than a checkpoint directory."""
    return name in BUILTIN_MODELS or name in PACKAGED_MODELS


@dataclass(frozen=True, slots=True)
class ModelText:
    """A model's text side: its tokenizer and the ids that end its generations (the ids the
    loaded model's `eos_token_ids` would hold)."""

    tokenizer: ModelTokenizer
    eos_token_ids: frozenset[int]


def load_model_text(model: str) -> ModelText:
    """The text side of `model` (a built-in name or a checkpoint directory), from its tokenizer
    files only: a packaged model's from the model cache, built there first if need be. Raises
    `ModelLoadError` for an unknown name or an unreadable checkpoint."""
    from engine.compute.models.loader import eos_token_ids, load_tokenizer  # torch: on first use only

    tokenizer = load_tokenizer(model)
    return ModelText(ModelTokenizer(tokenizer), frozenset(eos_token_ids(model, tokenizer)))
