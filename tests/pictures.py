"""Pictures for tests of the decoders' size limit: a PNG whose header claims any size."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def claimed_png(width: int, height: int) -> bytes:
    """A 1x1 PNG whose IHDR (CRC fixed up) claims `width` x `height`: what a decompression bomb
    looks like to a reader that checks the header before decoding (its pixel data is not there)."""
    out = io.BytesIO()
    Image.new("RGB", (1, 1)).save(out, format="PNG")
    data = bytearray(out.getvalue())
    data[16:24] = struct.pack(">II", width, height)  # IHDR's data starts after the 8-byte signature and 8-byte chunk head
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)
