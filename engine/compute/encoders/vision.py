"""The vision encoder: a `transformers` ViT and a projection to the LLM's hidden size.

An image (PNG bytes or an array, see `engine.compute.media.read_image`) is resized to
the ViT's square input, normalised to [-1, 1] and run through `ViTModel`; its patch
tokens (the CLS token dropped) go through a linear projection to the LLM's hidden size.
The result is one embedding row per placeholder position of the image in the prompt.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from transformers import ViTConfig, ViTModel

from engine.compute.encoders.catalog import VisionEncoderConfig
from engine.compute.encoders.items import EncodedItem
from engine.compute.media import read_image
from engine.compute.prefix.keys import content_hash
from engine.compute.weights.seeding import build_seeded


class VisionEncoder(torch.nn.Module):
    """`ViTModel` + projection to `out_size` (the LLM hidden size); float32, eval mode."""

    def __init__(self, config: VisionEncoderConfig, out_size: int) -> None:
        super().__init__()
        self.config = config
        self.out_size = out_size
        self.vit = ViTModel(
            ViTConfig(
                hidden_size=config.hidden_size,
                num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_heads,
                intermediate_size=config.intermediate_size,
                image_size=config.image_size,
                patch_size=config.patch_size,
                num_channels=3,
            ),
            add_pooling_layer=False,
        )
        self.proj = torch.nn.Linear(config.hidden_size, out_size)

    @classmethod
    def build(cls, config: VisionEncoderConfig, out_size: int) -> VisionEncoder:
        """The seeded encoder (same config and size, same weights)."""
        return build_seeded(lambda: cls(config, out_size), config.seed)

    @property
    def num_tokens(self) -> int:
        return self.config.num_tokens

    def pixel_values(self, pixels: np.ndarray) -> torch.Tensor:
        """`(H, W, 3)` uint8 -> the ViT input `(1, 3, S, S)` in [-1, 1] (bilinear resize, antialiased)."""
        device = self.proj.weight.device
        x = torch.from_numpy(np.ascontiguousarray(pixels)).to(device).permute(2, 0, 1)[None].float() / 255.0
        size = self.config.image_size
        if x.shape[-2:] != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        return x * 2.0 - 1.0

    @torch.inference_mode()
    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`(B, 3, S, S)` -> `(B, num_tokens, out_size)` patch embeddings in the LLM's space."""
        hidden = self.vit(pixel_values=pixel_values).last_hidden_state[:, 1:]
        return self.proj(hidden)

    def encode(self, image: bytes | np.ndarray | torch.Tensor) -> EncodedItem:
        """One image -> its embeddings and content hash (over the decoded pixels, so the same
        picture hashes alike whatever file it came in)."""
        pixels = read_image(image)
        embeds = self.embed(self.pixel_values(pixels))[0]
        return EncodedItem(kind="image", item_hash=content_hash("image", pixels), embeds=embeds)
