"""Media values: deterministic test media, and the PNG/WAV codecs the multimodal units speak.

Images and audio cross node ports as PNG/WAV bytes (what a browser opens) or as numpy
arrays. `read_image` / `read_audio` accept either and return plain arrays; `png_bytes` /
`wav_bytes` write the files. `sample_picture` and `sample_sound` are generated from nothing
but their arguments (same arguments, same bytes on any machine), for tests, demos and
benchmarks; nothing is downloaded.

PNG needs Pillow (imported when used); WAV is the standard library's `wave`.
"""

from __future__ import annotations

import io
import math
import wave

import numpy as np
import torch

from engine.spec.graph import MAX_IMAGE_PIXELS

DEFAULT_SAMPLE_RATE = 16_000


class MediaError(ValueError):
    """A value that is not a readable image or sound."""


# -- generated test media ---------------------------------------------------------------------------


def sample_picture(width: int = 64, height: int = 64, variant: int = 0) -> np.ndarray:
    """A `(height, width, 3)` uint8 picture: a colour gradient, a disc and a bar.

    `variant` moves and recolours the shapes, so two variants are different pictures of
    the same size (what the prefix-cache tests need).
    """
    if width <= 0 or height <= 0:
        raise MediaError(f"picture size {width}x{height} is empty")
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    u, v = x / max(width - 1, 1), y / max(height - 1, 1)
    image = np.stack((u, v, 1.0 - 0.5 * (u + v)), axis=-1)
    shift = (variant * 0.37) % 1.0
    cx, cy, r = (0.3 + 0.4 * shift) * width, 0.4 * height, 0.22 * min(width, height)
    disc = (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    image[disc] = (1.0, 0.85 - 0.5 * shift, 0.1 + 0.6 * shift)
    bar = (y >= 0.72 * height) & (y < 0.84 * height) & (x >= 0.15 * width) & (x < 0.85 * width)
    image[bar] = (0.1, 0.2 + 0.5 * shift, 0.8)
    return np.round(image * 255).astype(np.uint8)


def sample_sound(seconds: float = 1.0, sample_rate: int = DEFAULT_SAMPLE_RATE, variant: int = 0) -> np.ndarray:
    """Mono float32 samples in [-1, 1]: a two-note chord under a rising chirp, faded in and out."""
    count = int(round(seconds * sample_rate))
    if count <= 0:
        raise MediaError(f"a sound of {seconds} s at {sample_rate} Hz is empty")
    t = np.arange(count, dtype=np.float64) / sample_rate
    base = 220.0 * 2 ** (variant / 12)
    chord = 0.3 * np.sin(2 * math.pi * base * t) + 0.2 * np.sin(2 * math.pi * base * 1.5 * t)
    f0, f1 = 300.0, 3000.0
    sweep = 0.15 * np.sin(2 * math.pi * (f0 * t + (f1 - f0) * t * t / (2 * max(seconds, 1e-9))))
    fade = np.minimum(1.0, np.minimum(t, t[-1] - t) / 0.02)
    return ((chord + sweep) * fade).astype(np.float32)


# -- images -------------------------------------------------------------------------------------------------


def _pil():
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - pillow is a dependency
        raise MediaError("PNG images need Pillow (`pip install pillow`)") from exc
    return Image


def png_bytes(pixels: np.ndarray) -> bytes:
    """PNG file bytes of an `(H, W, 3)` (or `(H, W)` grey) uint8 array."""
    array = np.asarray(pixels)
    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise MediaError(f"PNG needs (H, W[, 3|4]) uint8 pixels, not {array.dtype} {array.shape}")
    out = io.BytesIO()
    _pil().fromarray(np.ascontiguousarray(array)).save(out, format="PNG")
    return out.getvalue()


def _check_pixels(width: int, height: int) -> None:
    if width * height > MAX_IMAGE_PIXELS:
        raise MediaError(f"the image is {width}x{height} pixels, over the limit of {MAX_IMAGE_PIXELS} pixels"
                         " (width times height)")


def image_size(data: bytes) -> tuple[int, int]:
    """`(width, height)` of an encoded picture, from its header (nothing is decoded): `MediaError`
    when it is no picture Pillow reads, or claims more than `MAX_IMAGE_PIXELS` pixels."""
    image = _pil()
    try:
        with image.open(io.BytesIO(data)) as img:
            _check_pixels(*img.size)
            return img.size
    except image.DecompressionBombError as exc:
        raise MediaError(f"the image is too large to decode: {exc}") from exc
    except (image.UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"not an image file: {exc}") from exc


def read_image(data: bytes | bytearray | memoryview | np.ndarray | torch.Tensor) -> np.ndarray:
    """An image value as `(H, W, 3)` uint8: encoded bytes (PNG, JPEG, … whatever Pillow reads) or
    an array — uint8 `(H, W[, C])`, or float in [0, 1] of the same shapes (also `(3, H, W)`)."""
    if isinstance(data, bytes | bytearray | memoryview):
        image = _pil()
        try:
            with image.open(io.BytesIO(bytes(data))) as img:
                _check_pixels(*img.size)  # from the header: nothing is decoded yet
                return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()
        except image.DecompressionBombError as exc:
            raise MediaError(f"the image is too large to decode: {exc}") from exc
        except OSError as exc:
            raise MediaError(f"not an image file: {exc}") from exc
    array = data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[2] not in (1, 3, 4):
        array = array.transpose(1, 2, 0)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4) or 0 in array.shape:
        raise MediaError(f"an image array is (H, W[, 1|3|4]), not {array.shape}")
    if array.dtype != np.uint8:
        if not np.issubdtype(array.dtype, np.floating):
            raise MediaError(f"an image array is uint8, or float in [0, 1]; not {array.dtype}")
        array = np.round(np.clip(array, 0.0, 1.0) * 255).astype(np.uint8)
    if array.shape[2] == 1:
        array = np.repeat(array, 3, axis=2)
    return np.ascontiguousarray(array[:, :, :3])


# -- audio ----------------------------------------------------------------------------------------------------


def to_pcm16(samples: np.ndarray | torch.Tensor) -> np.ndarray:
    """Float samples in [-1, 1] (clipped) as int16 PCM: `round(x * 32767)`."""
    array = samples.detach().cpu().numpy() if isinstance(samples, torch.Tensor) else np.asarray(samples)
    if array.dtype == np.int16:
        return array
    return np.round(np.clip(array.astype(np.float64), -1.0, 1.0) * 32767).astype(np.int16)


def wav_bytes(samples: np.ndarray | torch.Tensor, sample_rate: int = DEFAULT_SAMPLE_RATE) -> bytes:
    """A 16-bit PCM WAV file of mono samples (float in [-1, 1], or int16) or `(frames, channels)`."""
    pcm = to_pcm16(samples)
    if pcm.ndim == 1:
        pcm = pcm[:, None]
    if pcm.ndim != 2 or pcm.shape[0] == 0:
        raise MediaError(f"WAV samples are (frames,) or (frames, channels), not {pcm.shape}")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(pcm.shape[1])
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(np.ascontiguousarray(pcm, dtype="<i2").tobytes())
    return out.getvalue()


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Linear-interpolation resampling (enough for test media and the tiny encoders)."""
    if rate == target or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    count = max(1, int(round(samples.size * target / rate)))
    positions = np.arange(count, dtype=np.float64) * (rate / target)
    return np.interp(positions, np.arange(samples.size), samples).astype(np.float32)


_WAV_DTYPES = {1: np.uint8, 2: np.dtype("<i2"), 4: np.dtype("<i4")}


def read_audio(
    data: bytes | bytearray | memoryview | np.ndarray | torch.Tensor, sample_rate: int = DEFAULT_SAMPLE_RATE
) -> np.ndarray:
    """An audio value as mono float32 samples at `sample_rate`.

    Bytes are a PCM WAV file (8, 16 or 32 bit; channels averaged; resampled to
    `sample_rate`); an array is mono samples already at `sample_rate` (float in [-1, 1],
    or int16).
    """
    if isinstance(data, bytes | bytearray | memoryview):
        try:
            with wave.open(io.BytesIO(bytes(data)), "rb") as w:
                width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
                frames = w.readframes(w.getnframes())
        except (wave.Error, EOFError) as exc:
            raise MediaError(f"not a PCM WAV file: {exc}") from exc
        if width not in _WAV_DTYPES:
            raise MediaError(f"WAV sample width of {width} bytes is not supported (1, 2 or 4)")
        raw = np.frombuffer(frames, _WAV_DTYPES[width]).astype(np.float64)
        scale = {1: 128.0, 2: 32768.0, 4: 2147483648.0}[width]
        samples = ((raw - 128.0) if width == 1 else raw) / scale
        samples = samples.reshape(-1, channels).mean(axis=1)
        return resample(samples.astype(np.float32), rate, sample_rate)
    array = data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    if array.ndim != 1 or array.size == 0:
        raise MediaError(f"audio samples are a non-empty 1-d array, not {array.shape}")
    if array.dtype == np.int16:
        return (array.astype(np.float32) / 32768.0).astype(np.float32)
    if not np.issubdtype(array.dtype, np.floating):
        raise MediaError(f"audio samples are float or int16, not {array.dtype}")
    return array.astype(np.float32, copy=False)
