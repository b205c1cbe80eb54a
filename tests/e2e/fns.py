"""Node functions of the browser tests' workflows (the studio under test allows ops in
`tests.e2e.fns`): a pause to watch states change and to cancel, a word stream, a PNG
made from an uploaded image, a WAV tone made from a caption, and a gradient PNG with its measure."""

from __future__ import annotations

import asyncio
import hashlib
import io
import math
import struct
import wave
import zlib
from collections.abc import AsyncIterator


async def pause(value: object, seconds: float = 1.0) -> object:
    await asyncio.sleep(seconds)
    return value


async def spell(caption: str) -> AsyncIterator[str]:
    """The caption's words one by one, a little apart, so they arrive as live frames."""
    for word in caption.split():
        await asyncio.sleep(0.15)
        yield word + " "


def gather(words: list[str]) -> str:
    return "".join(words).strip()


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A valid PNG: a horizontal gradient from black to `rgb`."""
    rows = b"".join(
        b"\x00" + b"".join(bytes(int(c * x / (width - 1)) for c in rgb) for x in range(width)) for _ in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def swatch(picture: bytes) -> bytes:
    """A 96x64 PNG whose colour is derived from the uploaded image's bytes."""
    digest = hashlib.sha256(picture).digest()
    return png(96, 64, (64 + digest[0] % 192, 64 + digest[1] % 192, 64 + digest[2] % 192))


def tone(caption: str) -> bytes:
    """A short 16-bit mono WAV whose pitch follows the caption's length."""
    rate, seconds = 8000, 0.4
    pitch = 220.0 + 20.0 * (len(caption) % 24)
    samples = b"".join(
        struct.pack("<h", int(12000 * math.sin(2 * math.pi * pitch * i / rate))) for i in range(int(rate * seconds))
    )
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(samples)
    return out.getvalue()


def gradient(caption: str) -> bytes:
    """A 256x128 PNG whose colour follows the caption: an image no workflow output carries."""
    digest = hashlib.sha256(caption.encode()).digest()
    return png(256, 128, (64 + digest[0] % 192, 64 + digest[1] % 192, 64 + digest[2] % 192))


def measure(picture: bytes) -> dict[str, int]:
    """The PNG's size as its header says it."""
    width, height = struct.unpack(">II", picture[16:24])
    return {"width": width, "height": height, "bytes": len(picture)}
