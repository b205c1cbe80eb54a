"""Decoders whose outputs open in a browser: VAE latents to PNG, audio codes to 16-bit WAV.

The image decoder imports `diffusers`; import it from `engine.compute.decoders.image`.
"""

from __future__ import annotations

from engine.compute.decoders.errors import DecoderError

__all__ = ["DecoderError"]
