"""The built-in decoders' configurations by name: what the model catalogue lists and validation
checks a role's `model` against, importable without torch or diffusers (the modules that build
the decoders, `image.py` and `audio.py`, import them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.compute.catalog import Catalog
from engine.compute.decoders.errors import DecoderError


@dataclass(frozen=True, slots=True)
class ImageDecoderConfig:
    """A tiny seeded `AutoencoderKL`: each latent cell becomes `2 ** (len(block_out_channels) - 1)`
    pixels a side."""

    name: str
    latent_channels: int = 4
    block_out_channels: tuple[int, ...] = (16, 32, 32)
    layers_per_block: int = 1
    norm_num_groups: int = 8
    sample_size: int = 64
    scaling_factor: float = 0.18215
    seed: int = 5
    description: str = ""

    @property
    def scale(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)


IMAGE_DECODERS = Catalog(
    "image decoder", DecoderError,
    ImageDecoderConfig(
        name="tiny-vae",
        description="AutoencoderKL, 4 latent channels, 3 blocks (16, 32, 32): 16x16 latents -> 64x64 RGB",
    ),
)


@dataclass(frozen=True, slots=True)
class AudioDecoderConfig:
    name: str
    codebook_size: int = 1024
    num_codebooks: int = 1
    dim: int = 64
    channels: int = 64
    rates: tuple[int, ...] = (8, 5, 4)
    sample_rate: int = 16_000
    gain: float = 0.5
    seed: int = 13
    description: str = ""

    @property
    def hop(self) -> int:
        """Samples per code."""
        return math.prod(self.rates)


AUDIO_DECODERS = Catalog(
    "audio decoder", DecoderError,
    AudioDecoderConfig(
        name="tiny-audio-decoder",
        description="1024-code codebook, upsampling 8x5x4: 100 codes per second of 16 kHz audio",
    ),
)
