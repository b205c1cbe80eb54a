"""The audio decoder: a small convolutional decoder from audio codes to 16-bit WAV bytes.

Codes are `(T,)` ids of one codebook or `(num_codebooks, T)` (residual codebooks: their
embeddings are summed, as in EnCodec/SoundStream decoders). A 1-d convolution, then one
transposed convolution per upsampling rate (kernel = stride = rate, so `T` codes become
exactly `T * prod(rates)` samples), a last convolution and `tanh` give samples in
[-1, 1], written as 16-bit PCM mono WAV.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.compute.decoders.catalog import AudioDecoderConfig
from engine.compute.decoders.errors import DecoderError
from engine.compute.media import wav_bytes
from engine.compute.weights.seeding import build_seeded


class AudioCodeDecoder(torch.nn.Module):
    def __init__(self, config: AudioDecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.codebooks = torch.nn.ModuleList(
            torch.nn.Embedding(config.codebook_size, config.dim) for _ in range(config.num_codebooks)
        )
        self.stem = torch.nn.Conv1d(config.dim, config.channels, kernel_size=7, padding=3)
        ups = []
        channels = config.channels
        for rate in config.rates:
            out = max(channels // 2, 8)
            ups.append(torch.nn.ConvTranspose1d(channels, out, kernel_size=rate, stride=rate))
            ups.append(torch.nn.Conv1d(out, out, kernel_size=3, padding=1))
            channels = out
        self.ups = torch.nn.ModuleList(ups)
        self.head = torch.nn.Conv1d(channels, 1, kernel_size=7, padding=3)
        self._init_weights()

    def _init_weights(self) -> None:
        """Variance-preserving convolutions (torch's default shrinks the signal ~100x over the
        stack, which leaves a random decoder silent): std `1.5 / sqrt(fan_in)` (0.3 for the last, so
        `tanh` rarely saturates), zero biases."""
        for module in (self.stem, *self.ups, self.head):
            weight = module.weight
            if isinstance(module, torch.nn.ConvTranspose1d):
                fan_in = weight.shape[0]  # kernel == stride: each output sample sees every input channel once
            else:
                fan_in = weight.shape[1] * weight.shape[2]
            scale = 0.3 if module is self.head else 1.5
            torch.nn.init.normal_(weight, std=scale / math.sqrt(fan_in))
            torch.nn.init.zeros_(module.bias)

    @classmethod
    def build(cls, config: AudioDecoderConfig) -> AudioCodeDecoder:
        return build_seeded(lambda: cls(config), config.seed)

    def _codes(self, codes: np.ndarray | torch.Tensor | list) -> torch.Tensor:
        c = torch.as_tensor(np.asarray(codes) if not isinstance(codes, torch.Tensor) else codes)
        if c.ndim == 1:
            c = c[None]
        cfg = self.config
        if c.ndim != 2 or c.shape[0] != cfg.num_codebooks or c.shape[1] == 0:
            raise DecoderError(f"codes are (T,) or ({cfg.num_codebooks}, T) with T > 0, not {tuple(c.shape)}")
        if c.dtype.is_floating_point or c.dtype == torch.bool:
            raise DecoderError(f"codes are integer ids, not {c.dtype}")
        if int(c.min()) < 0 or int(c.max()) >= cfg.codebook_size:
            raise DecoderError(f"codes must be in [0, {cfg.codebook_size})")
        return c.long().to(self.stem.weight.device)

    @torch.inference_mode()
    def samples(self, codes: np.ndarray | torch.Tensor | list) -> torch.Tensor:
        """Float samples in [-1, 1], `T * hop` of them."""
        c = self._codes(codes)
        x = sum(book(row) for book, row in zip(self.codebooks, c, strict=True))  # (T, dim)
        x = self.stem(x.T[None])
        act = torch.nn.functional.elu
        for layer in self.ups:
            x = layer(act(x))
        return self.config.gain * torch.tanh(self.head(act(x)))[0, 0]

    def decode_wav(self, codes: np.ndarray | torch.Tensor | list) -> bytes:
        """16-bit PCM mono WAV bytes at the config's sample rate."""
        return wav_bytes(self.samples(codes).cpu(), self.config.sample_rate)
