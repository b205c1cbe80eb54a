"""Every built-in model of every role kind, and whether a role computes with real or random weights.

One catalogue (`model_catalogue`) feeds `omniflow models list`, the studio's `/api/models/` (the
editor's model picker), `/v1/models` and validation: each role kind's `RoleModels.builtin` names
one of the per-kind functions below (`llm_models`, `vision_encoders` ...), which read it.
Real weights: the packaged models (`smollm2-135m`, an instruction-tuned LLM built from an
installed distribution) and any checkpoint directory; random weights (drawn from a seed, "for
testing"): the tiny built-in LLMs, vision and audio encoders, and image and audio decoders, for
which no real model is to be had offline. A `diffusion` role denoises with an LLM's transformer
but through a seeded head (`engine.compute.diffusion.head`), so what it makes is random whatever
its LLM is.

Nothing here loads a model, nor imports torch, transformers or diffusers: the rows come from the
configuration tables (`models.catalog`, `models.packaged`, `encoders.catalog`, `decoders.catalog`),
imported when the catalogue is first asked for. The studio reads it to list models and to validate
every workflow, so the first editor to open must not wait for the libraries that build models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.compute.models.catalog import DecoderShape, Weights
from engine.spec.kinds import BuiltinModel

LLM_ROLE_KINDS = ("llm", "sglang_llm", "diffusion")
"""Role kinds whose `model` is an LLM (a diffusion role runs the LLM's transformer)."""
SEEDED_HEAD_KINDS = frozenset({"diffusion"})
"""Role kinds that compute through seeded layers of their own, whatever their model is."""


@dataclass(frozen=True, slots=True)
class CatalogueModel:
    """One built-in model: the role kinds whose `model` may name it, and its weights."""

    name: str
    role_kinds: tuple[str, ...]
    weights: Weights
    description: str
    llm: DecoderShape | None = None

    def to_dict(self) -> dict[str, Any]:
        shape = self.llm
        return {
            "name": self.name,
            "role_kinds": list(self.role_kinds),
            "weights": str(self.weights),
            "weights_label": self.weights.label,
            "description": self.description,
            "family": shape.family if shape else None,
            "layers": shape.num_layers if shape else None,
            "hidden": shape.hidden_size if shape else None,
            "heads": shape.num_heads if shape else None,
            "kv_heads": shape.num_kv_heads if shape else None,
        }

    def for_spec(self) -> BuiltinModel:
        """What validation and the editor's picker know of it."""
        return BuiltinModel(self.name, self.weights is Weights.RANDOM, self.description)


def model_catalogue() -> list[CatalogueModel]:
    """The packaged real LLMs first, then the tiny seeded LLMs, encoders and decoders."""
    from engine.compute.decoders.catalog import AUDIO_DECODERS, IMAGE_DECODERS
    from engine.compute.encoders.catalog import AUDIO_ENCODERS, VISION_ENCODERS
    from engine.compute.models.catalog import BUILTIN_MODELS
    from engine.compute.models.packaged import PACKAGED_MODELS

    rows = [CatalogueModel(p.name, LLM_ROLE_KINDS, Weights.REAL, p.description, p) for p in PACKAGED_MODELS.values()]
    rows += [CatalogueModel(c.name, LLM_ROLE_KINDS, Weights.RANDOM, c.description, c) for c in BUILTIN_MODELS.values()]
    for kind, table in (("vision_encoder", VISION_ENCODERS), ("audio_encoder", AUDIO_ENCODERS),
                        ("vae_decoder", IMAGE_DECODERS), ("audio_decoder", AUDIO_DECODERS)):
        rows += [CatalogueModel(c.name, (kind,), Weights.RANDOM, c.description) for c in table.configs.values()]
    return rows


def role_weights(kind: str, model: str | None) -> Weights | None:
    """What a role of `kind` running `model` (a built-in name, or any other name: a checkpoint)
    computes with; None for a role without a model (python)."""
    if not model:
        return None
    if kind in SEEDED_HEAD_KINDS:
        return Weights.RANDOM
    row = next((row for row in model_catalogue() if row.name == model), None)
    if row is not None:
        return row.weights
    return Weights.REAL  # a checkpoint directory: trained weights, as far as anyone here knows


def _of_kind(kind: str) -> list[BuiltinModel]:
    return [row.for_spec() for row in model_catalogue() if kind in row.role_kinds]


def llm_models() -> list[BuiltinModel]:
    """The LLMs an `llm` or `diffusion` role may name: the packaged real ones, then the seeded ones."""
    return _of_kind("llm")


def vision_encoders() -> list[BuiltinModel]:
    return _of_kind("vision_encoder")


def audio_encoders() -> list[BuiltinModel]:
    return _of_kind("audio_encoder")


def image_decoders() -> list[BuiltinModel]:
    return _of_kind("vae_decoder")


def audio_decoders() -> list[BuiltinModel]:
    return _of_kind("audio_decoder")
