"""Model families: tiny seeded `transformers` decoders and packaged real models by name, local checkpoints by path.

The names below load their module on first use (PEP 562), so that a process which only needs the
catalogue (a worker of python ops reads `models.catalog` through weight seeding) does not import
`transformers` with the loader: seconds of every worker start on a loaded machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_attributes

if TYPE_CHECKING:
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

_HOMES = {
    "catalog": ("BUILTIN_MODELS", "InitScales", "ModelConfig", "Weights"),
    "loader": ("MODEL_DTYPES", "LoadedModel", "ModelLoadError", "build_model", "export_model", "list_models",
               "load_builtin", "load_checkpoint", "load_model", "model_dtype"),
    "packaged": ("PACKAGED_MODELS", "PackagedModel", "PackageMissingError"),
    "text": ("IncrementalDetokenizer", "ModelTokenizer"),
}
__getattr__ = lazy_attributes(__name__, _HOMES)


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
