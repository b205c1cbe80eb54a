"""Build the built-in models, load local checkpoints, export checkpoints.

Two kinds of built-in model: the tiny seeded ones (`catalog.BUILTIN_MODELS`, random
weights, for tests and quick runs) and the packaged real ones (`packaged.PACKAGED_MODELS`,
built once from an installed distribution's GGUF into the model cache, `cache.ModelCache`).

Nothing here touches the network: tiny models are drawn from their seed, packaged ones
come from a locally installed file, and a checkpoint is only ever read from a local
directory (`local_files_only=True`, so a path that is not a checkpoint is an error, never
a hub id; `HF_HUB_OFFLINE=1` is therefore always honoured).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.compute.models.cache import MANIFEST, ModelCache, ModelCacheConfig
from engine.compute.models.catalog import BUILTIN_MODELS, ModelConfig
from engine.compute.models.errors import ModelLoadError
from engine.compute.models.packaged import PACKAGED_MODELS
from engine.compute.models.text import ModelTokenizer
from engine.compute.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, build_byte_tokenizer

SUPPORTED_FAMILIES = ("llama", "qwen2")

MODEL_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes a model is loaded in, by the name a role's `dtype` param gives (float32 the default)."""


def model_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a `dtype` name; `ModelLoadError` naming the choices for any other."""
    if isinstance(name, torch.dtype):
        if name not in MODEL_DTYPES.values():
            raise ModelLoadError(f"dtype {name} is not supported (supported: {', '.join(MODEL_DTYPES)})")
        return name
    try:
        return MODEL_DTYPES[name]
    except (KeyError, TypeError):
        raise ModelLoadError(f"dtype {name!r} is not supported (supported: {', '.join(MODEL_DTYPES)})") from None


def _dtype_id(model_id: str, dtype: torch.dtype) -> str:
    """A model's id in `dtype`: float32 keeps the plain id; another dtype is other weights (and KV
    pages of another layout), so its id names it and its pages never mix with float32's."""
    return model_id if dtype == torch.float32 else f"{model_id}:{str(dtype).removeprefix('torch.')}"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A causal LM ready for the runner: `transformers` module in eval mode (float32 or bfloat16), and its tokenizer.

    `model_id` names the weights (it seeds the KV page hash chain, so two models never
    share pages); `eos_token_ids` are the ids that end a generation.
    """

    name: str
    model_id: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights (and so of the activations and the KV cache)."""
        return self.model.get_input_embeddings().weight.dtype

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        return int(self.model.config.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def codec(self) -> ModelTokenizer:
        """The tokenizer wrapper: encode, decode, streaming decode, chat prompts."""
        return ModelTokenizer(self.tokenizer)


def list_models() -> list[ModelConfig]:
    """The tiny seeded models' configs (`engine.compute.builtin_models` lists every built-in model)."""
    return list(BUILTIN_MODELS.values())


def _unknown(name: str) -> ModelLoadError:
    known = ", ".join(sorted([*PACKAGED_MODELS, *BUILTIN_MODELS]))
    return ModelLoadError(f"unknown model {name!r} (built-in models: {known})")


def model_config(name: str) -> ModelConfig:
    """The config of a tiny seeded model; `ModelLoadError` for any other name."""
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        if name in PACKAGED_MODELS:
            raise ModelLoadError(f"model {name!r} is a packaged real model, not a seeded one") from None
        raise _unknown(name) from None


def _hf_config(cfg: ModelConfig) -> LlamaConfig | Qwen2Config:
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
    }
    if cfg.family == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(use_sliding_window=False, **common)


def build_model(cfg: ModelConfig) -> PreTrainedModel:
    """The seeded random model of a built-in config (same seed, same weights, on any machine)."""
    hf_config = _hf_config(cfg)
    model_cls = LlamaForCausalLM if cfg.family == "llama" else Qwen2ForCausalLM
    model = model_cls(hf_config)
    gen = torch.Generator().manual_seed(cfg.seed)
    scales = cfg.init
    with torch.no_grad():
        # Sorted names: the draw order, and so the weights, do not depend on module order.
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith(".bias"):
                param.copy_(noise * scales.bias)
            elif "embed_tokens" in name:
                param.copy_(noise * scales.embed)
            elif name.startswith("lm_head"):
                param.copy_(noise * scales.lm_head / math.sqrt(param.shape[1]))
            else:
                fan_in = param.shape[1]
                if any(p in name for p in ("q_proj", "k_proj")):
                    scale = scales.qk
                elif any(p in name for p in ("v_proj", "o_proj")):
                    scale = scales.vo
                else:
                    scale = scales.mlp
                param.copy_(noise * scale / math.sqrt(fan_in))
        rows = torch.full((model.lm_head.weight.shape[0], 1), scales.unprintable_rows)
        rows[ord(" ") : ord("~") + 1] = 1.0
        rows[BOS_ID:] = scales.special_rows
        model.lm_head.weight.mul_(rows)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = BOS_ID
    return model.eval()


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), model.config.eos_token_id,
                   tokenizer.eos_token_id):
        for value in source if isinstance(source, list | tuple) else [source]:
            if isinstance(value, int) and value not in ids:
                ids.append(value)
    return tuple(ids)


def load_builtin(name: str, cache: ModelCache | None = None, dtype: str | torch.dtype = "float32") -> LoadedModel:
    """A built-in model by name, in `dtype`. A packaged one is built into `cache` on first use
    (default: the cache the environment names, `ModelCacheConfig.from_env`) and loaded from it."""
    torch_dtype = model_dtype(dtype)
    if name in PACKAGED_MODELS:
        return load_packaged(name, cache, torch_dtype)
    cfg = model_config(name)
    model = build_model(cfg).to(torch_dtype)
    tokenizer = build_byte_tokenizer()
    return LoadedModel(
        name=name,
        model_id=_dtype_id(f"builtin:{name}:seed{cfg.seed}", torch_dtype),
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(model, tokenizer),
    )


def _checkpoint_id(path: Path) -> str:
    """Names a checkpoint by its config and the size and age of its weight files."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"checkpoint:{digest.hexdigest()[:24]}"


def load_checkpoint(path: str | Path, dtype: str | torch.dtype = "float32") -> LoadedModel:
    """A local Hugging Face checkpoint directory (config, weights, tokenizer) of a supported family,
    its weights cast to `dtype`."""
    torch_dtype = model_dtype(dtype)
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{str(path)!r} is not a checkpoint directory (no config.json in it)")
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{directory / 'config.json'}: unreadable config: {exc}") from exc
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ModelLoadError(
            f"{directory}: model type {family!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    if config.get("use_sliding_window"):
        raise ModelLoadError(f"{directory}: sliding-window attention is not supported by the paged runner")
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory}: cannot load checkpoint: {exc}") from exc
    return LoadedModel(
        name=directory.name,
        model_id=_dtype_id(_checkpoint_id(directory), torch_dtype),
        model=model.eval(),
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(model, tokenizer),
    )


def _text_directory(ref: str, cache: ModelCache | None) -> Path | None:
    """The checkpoint directory that holds `ref`'s tokenizer and configs (None: a tiny built-in model)."""
    if ref in PACKAGED_MODELS:
        cache = cache if cache is not None else ModelCache(ModelCacheConfig.from_env())
        return cache.text_files(PACKAGED_MODELS[ref])
    if Path(ref).is_dir():
        return Path(ref)
    model_config(ref)  # an unknown built-in name is an error, as for the weights
    return None


def load_tokenizer(ref: str, cache: ModelCache | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a model reference (a built-in name or a checkpoint directory), without
    its weights: the byte tokenizer of the tiny built-in models; a packaged model's from the cache
    (built there first if need be; only the tokenizer's files are verified, not the weights);
    a checkpoint directory's, local files only."""
    directory = _text_directory(ref, cache)
    if directory is None:
        return build_byte_tokenizer()
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{ref}: cannot load its tokenizer: {exc}") from exc


def eos_token_ids(ref: str, tokenizer: PreTrainedTokenizerBase, cache: ModelCache | None = None) -> tuple[int, ...]:
    """The ids that end a generation of `ref`'s model, read without its weights: the ids
    `LoadedModel.eos_token_ids` holds once it is loaded (its generation config's and config's
    `eos_token_id`, then `tokenizer`'s)."""
    directory = _text_directory(ref, cache)
    sources: list[Any] = []
    for name in ("generation_config.json", "config.json"):
        path = directory / name if directory is not None else None
        if path is not None and path.is_file():
            try:
                sources.append(json.loads(path.read_text(encoding="utf-8")).get("eos_token_id"))
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"{path}: unreadable: {exc}") from exc
    sources.append(tokenizer.eos_token_id)
    ids: list[int] = []
    for source in sources:
        for value in source if isinstance(source, list | tuple) else [source]:
            if isinstance(value, int) and value not in ids:
                ids.append(value)
    return tuple(ids)


def load_packaged(name: str, cache: ModelCache | None = None, dtype: str | torch.dtype = "float32") -> LoadedModel:
    """A packaged real model from the cache (built there first if it is not), in `dtype`."""
    torch_dtype = model_dtype(dtype)
    cache = cache if cache is not None else ModelCache(ModelCacheConfig.from_env())
    built = cache.checkpoint(PACKAGED_MODELS[name])
    loaded = load_checkpoint(built.path, torch_dtype)
    model_id = _dtype_id(f"packaged:{name}:{built.digest[:24]}", torch_dtype)
    return LoadedModel(name=name, model_id=model_id, model=loaded.model,
                       tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids)


def load_model(name: str | None = None, path: str | Path | None = None,
               dtype: str | torch.dtype = "float32") -> LoadedModel:
    """Exactly one of a built-in `name` or a checkpoint `path`, in `dtype` (float32 or bfloat16)."""
    if (name is None) == (path is None):
        raise ModelLoadError("give exactly one of a model name or a checkpoint path")
    if name is not None:
        return load_builtin(name, dtype=dtype)
    return load_checkpoint(path, dtype)  # type: ignore[arg-type]


def export_model(name: str, directory: str | Path) -> Path:
    """Write a built-in model as a standard checkpoint: config, safetensors weights, tokenizer.

    `AutoModelForCausalLM.from_pretrained(directory)` and `AutoTokenizer.from_pretrained(directory)`
    load the result unchanged. A packaged model's files are copied from the (verified) cache,
    built there first if need be.
    """
    out = Path(directory)
    if name in PACKAGED_MODELS:
        built = ModelCache(ModelCacheConfig.from_env()).checkpoint(PACKAGED_MODELS[name])
        out.mkdir(parents=True, exist_ok=True)
        for item in sorted(built.path.iterdir()):
            if item.name != MANIFEST:
                shutil.copyfile(item, out / item.name)
        return out
    loaded = load_builtin(name)
    out.mkdir(parents=True, exist_ok=True)
    loaded.model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    return out
