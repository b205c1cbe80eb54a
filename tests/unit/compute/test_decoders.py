"""Image (VAE) and audio decoders: against diffusers' own decode, parsed by PIL and `wave`."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from engine.compute.decoders import DecoderError
from engine.compute.decoders.audio import AudioCodeDecoder
from engine.compute.decoders.catalog import AUDIO_DECODERS, IMAGE_DECODERS, AudioDecoderConfig
from engine.compute.decoders.image import ImageDecoder


@pytest.fixture(scope="module")
def image_decoder() -> ImageDecoder:
    return ImageDecoder(IMAGE_DECODERS.named("tiny-vae"))


@pytest.fixture(scope="module")
def audio_decoder() -> AudioCodeDecoder:
    return AudioCodeDecoder.build(AUDIO_DECODERS.named("tiny-audio-decoder"))


def _latents(seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randn((batch, 4, 16, 16), generator=torch.Generator().manual_seed(seed))


def test_vae_png_equals_diffusers_decode_and_postprocess(image_decoder: ImageDecoder):
    latents = _latents(0, batch=2)
    pngs = image_decoder.decode_png(latents)
    vae = image_decoder.vae
    with torch.no_grad():
        sample = vae.decode(latents / vae.config.scaling_factor).sample
    expected = VaeImageProcessor(vae_scale_factor=image_decoder.config.scale).postprocess(sample, output_type="pil")
    assert len(pngs) == 2
    for png, reference in zip(pngs, expected, strict=True):
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        with Image.open(io.BytesIO(png)) as img:
            assert (img.format, img.mode, img.size) == ("PNG", "RGB", (64, 64))
            assert np.array_equal(np.asarray(img), np.asarray(reference))


def test_vae_is_seeded_and_checks_latents(image_decoder: ImageDecoder):
    again = ImageDecoder(IMAGE_DECODERS.named("tiny-vae"))
    latents = _latents(1)[0]  # (C, h, w) works too
    assert again.decode_png(latents) == image_decoder.decode_png(latents)
    with pytest.raises(DecoderError):
        image_decoder.decode_png(torch.zeros(3, 16, 16))
    with pytest.raises(DecoderError):
        IMAGE_DECODERS.named("no-such-vae")


def test_wav_parses_with_the_wave_module(audio_decoder: AudioCodeDecoder):
    codes = [(i * 37) % 1024 for i in range(50)]
    data = audio_decoder.decode_wav(codes)
    with wave.open(io.BytesIO(data), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        assert w.getnframes() == 50 * audio_decoder.config.hop
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    expected = np.round(audio_decoder.samples(codes).numpy().astype(np.float64) * 32767).astype(np.int16)
    assert np.array_equal(pcm, expected)
    assert pcm.std() > 1000  # audible, not silence


def test_audio_decoder_codebooks_and_bad_codes():
    decoder = AudioCodeDecoder.build(AudioDecoderConfig(name="two-books", num_codebooks=2, codebook_size=16,
                                                        rates=(4, 2)))
    codes = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert decoder.samples(codes).shape == (3 * 8,)
    # Codebooks are summed: swapping the second book's codes changes the sound.
    assert not torch.equal(decoder.samples(codes), decoder.samples(torch.tensor([[1, 2, 3], [6, 5, 4]])))
    for bad in (torch.tensor([1, 2, 3]), torch.tensor([[1, 2], [3, 16]]), torch.tensor([[0.5], [1.0]]),
                torch.zeros((2, 0), dtype=torch.long)):
        with pytest.raises(DecoderError):
            decoder.samples(bad)
