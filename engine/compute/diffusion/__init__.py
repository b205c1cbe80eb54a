"""A diffusion runner on the LLM forward path: image latents denoised by the LLM's own transformer,
attending to the prompt's KV (computed once, or pulled from the LLM role that computed it).

Imports `diffusers` (its flow-matching scheduler).
"""

from __future__ import annotations

from engine.compute.diffusion.forward import DiffusionModelError, ImageTokenForward, KVBatch, PromptKV
from engine.compute.diffusion.head import DiffusionHead, patchify, unpatchify
from engine.compute.diffusion.runner import DiffusionConfig, DiffusionRunner, Prompt

__all__ = [
    "DiffusionConfig",
    "DiffusionHead",
    "DiffusionModelError",
    "DiffusionRunner",
    "ImageTokenForward",
    "KVBatch",
    "Prompt",
    "PromptKV",
    "patchify",
    "unpatchify",
]
