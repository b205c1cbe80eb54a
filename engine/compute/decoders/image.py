"""The image decoder: a `diffusers` `AutoencoderKL` decoding latents to PNG bytes.

Latents `(C, h, w)` (or a batch) are unscaled (`z / scaling_factor + shift_factor`, the
inverse of what an encoder's latents get), decoded by the VAE to `[-1, 1]` pixels and
written as 8-bit RGB: `round(clamp(x / 2 + 0.5, 0, 1) * 255)`, which is what diffusers'
own `VaeImageProcessor.postprocess` produces.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKL

from engine.compute.decoders.catalog import ImageDecoderConfig
from engine.compute.decoders.errors import DecoderError
from engine.compute.media import png_bytes
from engine.compute.weights.seeding import build_seeded


def vae_module(config: ImageDecoderConfig) -> AutoencoderKL:
    """An `AutoencoderKL` of `config`'s shape, initialised from torch's global generator."""
    blocks = len(config.block_out_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=config.latent_channels,
        block_out_channels=config.block_out_channels,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        layers_per_block=config.layers_per_block,
        norm_num_groups=config.norm_num_groups,
        sample_size=config.sample_size,
        scaling_factor=config.scaling_factor,
    )


def build_vae(config: ImageDecoderConfig) -> AutoencoderKL:
    """The seeded VAE of `config` (diffusers' own initialisation, drawn from the seed)."""
    return build_seeded(lambda: vae_module(config), config.seed)


class ImageDecoder:
    """Decodes latents with a VAE (built from `config`, or given) into RGB arrays and PNG bytes."""

    def __init__(self, config: ImageDecoderConfig, vae: AutoencoderKL | None = None) -> None:
        self.config = config
        self.vae = vae if vae is not None else build_vae(config)

    def _batch(self, latents: np.ndarray | torch.Tensor) -> torch.Tensor:
        z = torch.as_tensor(np.asarray(latents) if isinstance(latents, np.ndarray) else latents).float()
        z = z.to(self.vae.device)
        if z.ndim == 3:
            z = z[None]
        if z.ndim != 4 or z.shape[1] != self.config.latent_channels:
            raise DecoderError(
                f"latents are (C, h, w) or (B, C, h, w) with C = {self.config.latent_channels}, not {tuple(z.shape)}"
            )
        return z

    @torch.inference_mode()
    def decode_pixels(self, latents: np.ndarray | torch.Tensor) -> list[np.ndarray]:
        """`(H, W, 3)` uint8 images, one per latent of the batch."""
        z = self._batch(latents)
        cfg = self.vae.config
        z = z / cfg.scaling_factor
        if getattr(cfg, "shift_factor", None) is not None:
            z = z + cfg.shift_factor
        sample = self.vae.decode(z).sample
        images = (sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
        return [(img * 255).round().astype(np.uint8) for img in images]

    def decode_png(self, latents: np.ndarray | torch.Tensor) -> list[bytes]:
        """PNG file bytes, one per latent of the batch."""
        return [png_bytes(img) for img in self.decode_pixels(latents)]
