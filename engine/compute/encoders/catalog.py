"""The built-in encoders' configurations by name: what the model catalogue lists and validation
checks a role's `model` against, importable without torch or transformers (the modules that build
the encoders, `vision.py` and `audio.py`, import both)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.compute.catalog import Catalog
from engine.compute.encoders.errors import EncoderError


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """A built-in encoder's transformer: `num_layers` layers of width `hidden_size`, `num_heads`
    heads and `intermediate_size` MLPs, its weights drawn from `seed` (`build_seeded`). What feeds
    it (mel frames, image patches) is the subclass's."""

    name: str
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 64
    seed: int = 0
    description: str = ""


@dataclass(frozen=True, slots=True)
class VisionEncoderConfig(EncoderConfig):
    """A tiny seeded ViT: `(image_size / patch_size) ** 2` embedding rows per image."""

    image_size: int = 32
    patch_size: int = 8
    seed: int = 7

    @property
    def num_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


VISION_ENCODERS = Catalog(
    "vision encoder", EncoderError,
    VisionEncoderConfig(
        name="tiny-vit",
        description="2-layer ViT, hidden 32, 32x32 input in 8x8 patches: 16 rows per image",
    ),
)


@dataclass(frozen=True, slots=True)
class AudioEncoderConfig(EncoderConfig):
    """Log-mel frames (`n_mels` bins, a frame per `hop_length` samples at `sample_rate`) into the
    transformer: one embedding row per 4 frames (`num_tokens`)."""

    sample_rate: int = 16_000
    n_fft: int = 400
    hop_length: int = 160
    n_mels: int = 40
    seed: int = 11

    def num_tokens(self, num_samples: int) -> int:
        frames = num_samples // self.hop_length + 1
        strided = (frames + 1) // 2  # conv2: kernel 3, stride 2, padding 1
        return (strided + 1) // 2 if strided > 1 else 1  # average pooling by 2, ceil


AUDIO_ENCODERS = Catalog(
    "audio encoder", EncoderError,
    AudioEncoderConfig(
        name="tiny-audio-encoder",
        description="40-bin log-mel at 16 kHz into a 2-layer transformer, hidden 32: 25 rows per second",
    ),
)
