"""Encoders whose embeddings the LLM splices in at placeholder positions: vision (ViT) and audio (log-mel).

The names below load their module on first use (PEP 562): the configurations (`catalog`) import
neither torch nor transformers, so the model catalogue (the studio's editor, validation) reads
them without loading what builds the encoders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_attributes

if TYPE_CHECKING:
    from engine.compute.encoders.audio import AudioEncoder, LogMel
    from engine.compute.encoders.catalog import (
        AUDIO_ENCODERS,
        VISION_ENCODERS,
        AudioEncoderConfig,
        VisionEncoderConfig,
    )
    from engine.compute.encoders.errors import EncoderError
    from engine.compute.encoders.items import EncodedItem, SplicedPrompt, splice_prompt
    from engine.compute.encoders.vision import VisionEncoder

_HOMES = {
    "audio": ("AudioEncoder", "LogMel"),
    "catalog": ("AUDIO_ENCODERS", "VISION_ENCODERS", "AudioEncoderConfig", "VisionEncoderConfig"),
    "errors": ("EncoderError",),
    "items": ("EncodedItem", "SplicedPrompt", "splice_prompt"),
    "vision": ("VisionEncoder",),
}
__getattr__ = lazy_attributes(__name__, _HOMES)

__all__ = [
    "AUDIO_ENCODERS",
    "VISION_ENCODERS",
    "AudioEncoder",
    "AudioEncoderConfig",
    "EncodedItem",
    "EncoderError",
    "LogMel",
    "SplicedPrompt",
    "VisionEncoder",
    "VisionEncoderConfig",
    "splice_prompt",
]
