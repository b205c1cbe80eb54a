"""Encoders whose embeddings the LLM splices in at placeholder positions: vision (ViT) and audio (log-mel)."""

from __future__ import annotations

from engine.compute.encoders.audio import AUDIO_ENCODERS, AudioEncoder, AudioEncoderConfig, LogMel
from engine.compute.encoders.items import EncodedItem, EncoderError, SplicedPrompt, splice_prompt
from engine.compute.encoders.vision import VISION_ENCODERS, VisionEncoder, VisionEncoderConfig

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
