"""Model families: tiny seeded `transformers` decoders and packaged real models by name, local checkpoints by path."""

from __future__ import annotations

from engine.compute.models.catalog import BUILTIN_MODELS, InitScales, ModelConfig, Weights
from engine.compute.models.loader import (
    MODEL_DTYPES,
    LoadedModel,
    ModelLoadError,
    build_model,
    export_model,
    list_models,
    load_builtin,
    load_checkpoint,
    load_model,
    model_dtype,
)
from engine.compute.models.packaged import PACKAGED_MODELS, PackagedModel, PackageMissingError
from engine.compute.models.text import IncrementalDetokenizer, ModelTokenizer

__all__ = [
    "BUILTIN_MODELS",
    "MODEL_DTYPES",
    "PACKAGED_MODELS",
    "IncrementalDetokenizer",
    "InitScales",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "ModelTokenizer",
    "PackageMissingError",
    "PackagedModel",
    "Weights",
    "build_model",
    "export_model",
    "list_models",
    "load_builtin",
    "load_checkpoint",
    "load_model",
    "model_dtype",
]
