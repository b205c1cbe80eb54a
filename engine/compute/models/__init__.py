"""Model families: tiny seeded `transformers` decoders and packaged real models by name, local checkpoints by path."""

from __future__ import annotations

from engine.compute.models.catalog import BUILTIN_MODELS, InitScales, ModelConfig
from engine.compute.models.loader import (
    LoadedModel,
    ModelInfo,
    ModelLoadError,
    Weights,
    build_model,
    catalog,
    export_model,
    list_models,
    load_builtin,
    load_checkpoint,
    load_model,
)
from engine.compute.models.packaged import PACKAGED_MODELS, PackagedModel, PackageMissingError
from engine.compute.models.text import IncrementalDetokenizer, ModelTokenizer

__all__ = [
    "BUILTIN_MODELS",
    "PACKAGED_MODELS",
    "IncrementalDetokenizer",
    "InitScales",
    "LoadedModel",
    "ModelConfig",
    "ModelInfo",
    "ModelLoadError",
    "ModelTokenizer",
    "PackageMissingError",
    "PackagedModel",
    "Weights",
    "build_model",
    "catalog",
    "export_model",
    "list_models",
    "load_builtin",
    "load_checkpoint",
    "load_model",
]
