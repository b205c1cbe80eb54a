"""The audio encoder: log-mel features computed with torch, then a small transformer encoder.

`LogMel` is the usual front end (Whisper's, without its clamping): a centred,
reflect-padded STFT with a periodic Hann window, the power spectrum through an HTK
mel filter bank, natural log with a floor. It is written with `torch.stft` and a filter
bank built here (no torchaudio) and matches `transformers.audio_utils.spectrogram`.

`AudioEncoder`: two 1-d convolutions (the second with stride 2) over the mel frames,
average pooling by 2, fixed sinusoidal positions, a `torch.nn.TransformerEncoder` and
a projection to the LLM's hidden size: one embedding row per 4 mel frames (40 ms at
the default 10 ms hop).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.compute.encoders.catalog import AudioEncoderConfig
from engine.compute.encoders.items import EncodedItem
from engine.compute.media import read_audio
from engine.compute.prefix.keys import content_hash
from engine.compute.weights.seeding import build_seeded


def hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    """HTK mel scale."""
    return 2595.0 * torch.log10(1.0 + hz / 700.0)


def mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_filter_bank(n_freqs: int, n_mels: int, sample_rate: int, f_min: float = 0.0,
                    f_max: float | None = None) -> torch.Tensor:
    """`(n_freqs, n_mels)` triangular HTK filters (unnormalised), computed in float64.

    Triangles are laid on the FFT bin frequencies between mel-spaced corner frequencies.
    """
    f_max = sample_rate / 2 if f_max is None else f_max
    fft_freqs = torch.linspace(0, sample_rate // 2, n_freqs, dtype=torch.float64)
    mels = torch.linspace(hz_to_mel(torch.tensor(f_min, dtype=torch.float64)).item(),
                          hz_to_mel(torch.tensor(f_max, dtype=torch.float64)).item(), n_mels + 2,
                          dtype=torch.float64)
    corners = mel_to_hz(mels)
    widths = corners[1:] - corners[:-1]
    slopes = corners[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    return torch.clamp(torch.minimum(down, up), min=0.0)


class LogMel(torch.nn.Module):
    """Mono samples `(num_samples,)` -> log-mel `(frames, n_mels)`, `frames = num_samples // hop + 1`."""

    def __init__(self, sample_rate: int, n_fft: int, hop_length: int, n_mels: int, floor: float = 1e-10) -> None:
        super().__init__()
        self.n_fft, self.hop_length, self.floor = n_fft, hop_length, floor
        self.window = torch.nn.Buffer(torch.hann_window(n_fft, periodic=True, dtype=torch.float64), persistent=False)
        self.filters = torch.nn.Buffer(mel_filter_bank(n_fft // 2 + 1, n_mels, sample_rate), persistent=False)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        if samples.shape[-1] <= self.n_fft // 2:
            # Reflect padding needs more samples than half a window.
            samples = torch.nn.functional.pad(samples, (0, self.n_fft // 2 + 1 - samples.shape[-1]))
        spec = torch.stft(samples.double(), self.n_fft, self.hop_length, window=self.window, center=True,
                          pad_mode="reflect", return_complex=True)
        power = spec.abs() ** 2
        mel = self.filters.T @ power
        return torch.log(torch.clamp(mel, min=self.floor)).T.float()


def sinusoids(length: int, channels: int, offset: int = 0) -> torch.Tensor:
    """`(length, channels)` fixed sin/cos position codes (Whisper's)."""
    half = channels // 2
    scales = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / max(half - 1, 1))
    angles = torch.arange(offset, offset + length, dtype=torch.float32)[:, None] * scales[None, :]
    return torch.cat((torch.sin(angles), torch.cos(angles)), dim=1)


class AudioEncoder(torch.nn.Module):
    """Log-mel front end, conv stem, transformer encoder, projection to `out_size`."""

    def __init__(self, config: AudioEncoderConfig, out_size: int) -> None:
        super().__init__()
        self.config = config
        self.out_size = out_size
        d = config.hidden_size
        self.logmel = LogMel(config.sample_rate, config.n_fft, config.hop_length, config.n_mels)
        self.conv1 = torch.nn.Conv1d(config.n_mels, d, kernel_size=3, padding=1)
        self.conv2 = torch.nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        layer = torch.nn.TransformerEncoderLayer(d, config.num_heads, config.intermediate_size, dropout=0.0,
                                                 activation="gelu", batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, config.num_layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.proj = torch.nn.Linear(d, out_size)

    @classmethod
    def build(cls, config: AudioEncoderConfig, out_size: int) -> AudioEncoder:
        return build_seeded(lambda: cls(config, out_size), config.seed)

    def features(self, samples: np.ndarray | torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(samples, dtype=torch.float32, device=self.proj.weight.device)
        return self.logmel(x)

    @torch.inference_mode()
    def embed(self, mel: torch.Tensor) -> torch.Tensor:
        """Log-mel `(frames, n_mels)` -> `(tokens, out_size)`."""
        x = mel.T[None]  # (1, n_mels, frames)
        x = torch.nn.functional.gelu(self.conv1(x))
        x = torch.nn.functional.gelu(self.conv2(x))
        x = torch.nn.functional.avg_pool1d(x, kernel_size=2, ceil_mode=True) if x.shape[-1] > 1 else x
        x = x.transpose(1, 2)
        x = x + sinusoids(x.shape[1], x.shape[2])[None]
        return self.proj(self.norm(self.encoder(x)))[0]

    def encode(self, audio: bytes | np.ndarray | torch.Tensor) -> EncodedItem:
        """One clip -> embeddings and content hash (over the decoded samples at the model's rate)."""
        samples = read_audio(audio, self.config.sample_rate)
        embeds = self.embed(self.features(samples))
        return EncodedItem(kind="audio", item_hash=content_hash("audio", samples), embeds=embeds)
