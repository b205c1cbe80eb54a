"""Vision and audio encoders: against `transformers` references, spliced into the LLM, keyed by content."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import ViTModel
from transformers.audio_utils import mel_filter_bank as hf_mel_filter_bank
from transformers.audio_utils import spectrogram, window_function

from engine.compute.encoders import AudioEncoder, EncodedItem, VisionEncoder, splice_prompt
from engine.compute.encoders.audio import mel_filter_bank
from engine.compute.encoders.catalog import AUDIO_ENCODERS, VISION_ENCODERS
from engine.compute.encoders.errors import EncoderError
from engine.compute.llm import EngineConfig, LLMEngine
from engine.compute.media import (
    MediaError,
    png_bytes,
    read_audio,
    read_image,
    sample_picture,
    sample_sound,
    to_pcm16,
    wav_bytes,
)
from engine.compute.models.tokenizer import BOS_ID, IMAGE_ID
from engine.compute.sampling import SamplingParams
from tests.pictures import claimed_png


@pytest.fixture(scope="module")
def vision() -> VisionEncoder:
    return VisionEncoder.build(VISION_ENCODERS.named("tiny-vit"), 64)


@pytest.fixture(scope="module")
def audio() -> AudioEncoder:
    return AudioEncoder.build(AUDIO_ENCODERS.named("tiny-audio-encoder"), 64)


# -- media ----------------------------------------------------------------------------------------


def test_sample_media_are_deterministic_and_round_trip():
    picture = sample_picture(48, 40)
    assert picture.shape == (40, 48, 3) and picture.dtype == np.uint8
    assert np.array_equal(picture, sample_picture(48, 40))
    assert not np.array_equal(picture, sample_picture(48, 40, variant=1))
    assert np.array_equal(read_image(png_bytes(picture)), picture)
    sound = sample_sound(0.25)
    assert sound.shape == (4000,) and np.abs(sound).max() <= 1.0
    assert np.array_equal(sound, sample_sound(0.25))
    decoded = read_audio(wav_bytes(sound))
    assert np.array_equal(decoded, to_pcm16(sound).astype(np.float32) / 32768)  # 16-bit PCM, exactly
    assert np.abs(decoded - sound).max() <= 2 / 32767
    assert read_audio(wav_bytes(sound, 8000), 16000).shape == (8000,)  # resampled to 16 kHz


def test_media_readers_refuse_what_they_cannot_read():
    with pytest.raises(MediaError):
        read_image(b"not a picture")
    with pytest.raises(MediaError, match="5000x4000 pixels, over the limit"):  # before decoding a pixel
        read_image(claimed_png(5000, 4000))
    with pytest.raises(MediaError):
        read_audio(b"RIFF....WAVE")
    with pytest.raises(MediaError):
        read_image(np.zeros((4, 4, 3), dtype=np.int32))


# -- vision ---------------------------------------------------------------------------------------


def test_vision_matches_vit_plus_projection(vision: VisionEncoder):
    """At the ViT's input size no resize happens: the reference is ViTModel on (x/255-0.5)/0.5."""
    pixels = sample_picture(32, 32)
    item = vision.encode(png_bytes(pixels))
    assert item.kind == "image" and item.embeds.shape == (16, 64) and item.embeds.dtype == torch.float32
    reference_vit = ViTModel(vision.vit.config, add_pooling_layer=False).eval()
    reference_vit.load_state_dict(vision.vit.state_dict())
    x = torch.from_numpy((pixels.astype(np.float32) / 255.0 - 0.5) / 0.5).permute(2, 0, 1)[None]
    with torch.no_grad():
        expected = vision.proj(reference_vit(pixel_values=x).last_hidden_state[:, 1:])[0]
    assert torch.allclose(item.embeds, expected, atol=1e-5)


def test_vision_hash_follows_content_not_container(vision: VisionEncoder):
    pixels = sample_picture()
    from_png = vision.encode(png_bytes(pixels))
    from_array = vision.encode(pixels)
    from_float = vision.encode(pixels.astype(np.float32) / 255.0)
    assert from_png.item_hash == from_array.item_hash == from_float.item_hash
    assert torch.equal(from_png.embeds, from_array.embeds)
    other = vision.encode(sample_picture(variant=1))
    assert other.item_hash != from_png.item_hash
    assert vision.encode(sample_picture(96, 80)).embeds.shape == (16, 64)  # resized to the ViT input


def test_encoders_are_seeded():
    a = VisionEncoder.build(VISION_ENCODERS.named("tiny-vit"), 64)
    b = VisionEncoder.build(VISION_ENCODERS.named("tiny-vit"), 64)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    before = torch.random.get_rng_state()
    AudioEncoder.build(AUDIO_ENCODERS.named("tiny-audio-encoder"), 64)
    assert torch.equal(before, torch.random.get_rng_state())  # building draws nothing from the global RNG
    with pytest.raises(EncoderError, match=r"^unknown vision encoder 'no-such-vit' \(built-in: tiny-vit\)$"):
        VISION_ENCODERS.named("no-such-vit")


# -- audio ----------------------------------------------------------------------------------------


def test_log_mel_matches_transformers_audio_utils(audio: AudioEncoder):
    cfg = audio.config
    filters = hf_mel_filter_bank(cfg.n_fft // 2 + 1, cfg.n_mels, 0.0, cfg.sample_rate / 2, cfg.sample_rate,
                                 norm=None, mel_scale="htk")
    assert np.abs(mel_filter_bank(cfg.n_fft // 2 + 1, cfg.n_mels, cfg.sample_rate).numpy() - filters).max() < 1e-12
    sound = sample_sound(0.5)
    expected = spectrogram(sound.astype(np.float64), window_function(cfg.n_fft, "hann"), cfg.n_fft, cfg.hop_length,
                           power=2.0, mel_filters=filters, log_mel="log", mel_floor=1e-10, dtype=np.float64)
    features = audio.features(sound).numpy()
    assert features.shape == (len(sound) // cfg.hop_length + 1, cfg.n_mels) == expected.T.shape
    assert np.abs(features - expected.T).max() < 1e-4


def test_audio_encoder_rows_and_hash(audio: AudioEncoder):
    for seconds in (0.05, 0.5, 1.0):
        sound = sample_sound(seconds)
        item = audio.encode(sound)
        assert item.kind == "audio"
        assert item.embeds.shape == (audio.config.num_tokens(len(sound)), 64)
    sound = sample_sound(0.5)
    from_wav = audio.encode(wav_bytes(sound))
    from_pcm = audio.encode(to_pcm16(sound))  # the same 16-bit samples as the WAV holds
    assert from_wav.item_hash == from_pcm.item_hash and torch.equal(from_wav.embeds, from_pcm.embeds)
    assert audio.encode(sample_sound(0.5, variant=3)).item_hash != from_wav.item_hash


# -- splicing into the LLM --------------------------------------------------------------------------


def test_splice_prompt_places_items():
    item = EncodedItem("image", "ab" * 32, torch.zeros(3, 8))
    spliced = splice_prompt([[BOS_ID], "hi ", item, "!"], lambda s: list(s.encode()))
    assert spliced.token_ids == [BOS_ID, ord("h"), ord("i"), ord(" "), IMAGE_ID, IMAGE_ID, IMAGE_ID, ord("!")]
    assert [(i.kind, i.start, i.length) for i in spliced.items] == [("image", 4, 3)]


def test_llm_with_spliced_image_matches_hf_inputs_embeds(tiny_llama, vision: VisionEncoder):
    """The engine's paged forward with the embeddings spliced in generates what `transformers`
    `generate(inputs_embeds=...)` generates for the same embedded prompt."""
    item = vision.encode(png_bytes(sample_picture()))
    encode = lambda s: list(tiny_llama.tokenizer(s).input_ids)  # noqa: E731
    spliced = splice_prompt([[BOS_ID], "Look: ", item, " What is it?"], encode)
    engine = LLMEngine(tiny_llama, EngineConfig(page_size=4))
    try:
        out = engine.generate([spliced.token_ids], SamplingParams(max_new_tokens=8), mm_items=spliced.items)[0]
    finally:
        engine.close()
    with torch.no_grad():
        embeds = tiny_llama.model.model.embed_tokens(torch.tensor(spliced.token_ids))
        placed = spliced.items[0]
        embeds[placed.start : placed.end] = placed.embeds
        reference = tiny_llama.model.generate(
            inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(spliced.token_ids), dtype=torch.long),
            max_new_tokens=8, do_sample=False,
        )
    assert list(out.output_ids) == reference[0].tolist()


def test_same_picture_hits_the_prefix_cache_and_another_does_not(tiny_llama, vision: VisionEncoder):
    encode = lambda s: list(tiny_llama.tokenizer(s).input_ids)  # noqa: E731
    prompts = {
        variant: splice_prompt([[BOS_ID], "Look: ", vision.encode(sample_picture(variant=variant)), " What?"], encode)
        for variant in (0, 1)
    }
    image_start = prompts[0].items[0].start
    engine = LLMEngine(tiny_llama, EngineConfig(page_size=4))
    try:
        params = SamplingParams(max_new_tokens=2)
        first = engine.generate([prompts[0].token_ids], params, mm_items=prompts[0].items)[0]
        again = engine.generate([prompts[0].token_ids], params, mm_items=prompts[0].items)[0]
        other = engine.generate([prompts[1].token_ids], params, mm_items=prompts[1].items)[0]
    finally:
        engine.close()
    full_pages = len(prompts[0].token_ids) // 4 * 4
    assert first.cached_tokens == 0
    assert again.cached_tokens == full_pages
    assert other.cached_tokens == image_start // 4 * 4  # only the text before the picture
