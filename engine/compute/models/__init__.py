"""Model families: tiny seeded `transformers` decoders by name, and local checkpoints by path."""

from __future__ import annotations

from engine.compute.models.catalog import BUILTIN_MODELS, InitScales, ModelConfig
from engine.compute.models.loader import (
    LoadedModel,
    ModelLoadError,
    build_model,
    export_model,
    list_models,
    load_builtin,
    load_checkpoint,
    load_model,
)

__all__ = [
    "BUILTIN_MODELS",
    "InitScales",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "build_model",
    "export_model",
    "list_models",
    "load_builtin",
    "load_checkpoint",
    "load_model",
]
