"""Pictures users send (a run's image upload, an image in a `/v1` chat message), checked before
anything decodes them: the workers' encoders decode with Pillow, and a small compressed file can
claim a picture of gigabytes. The header gives the size without decoding
(`engine.spec.graph.MAX_IMAGE_PIXELS`)."""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

from engine.spec.graph import MAX_IMAGE_PIXELS


class PictureRefused(ValueError):
    """The bytes are no picture this studio reads, or too large a one; the message says which."""


def oversized(data: bytes) -> str | None:
    """Why `data` is refused as too large a picture (the size its header claims), or None: within
    the limit, or no header Pillow reads (an `image` port may carry other bytes to an op; the
    workers' decoders check them again)."""
    try:
        with Image.open(io.BytesIO(data)) as picture:
            width, height = picture.size
    except Image.DecompressionBombError as exc:  # Pillow's own, far higher, limit
        return f"the image is too large: {exc}"
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        return None
    if width * height > MAX_IMAGE_PIXELS:
        return f"the image is {width}x{height} pixels, over the limit of {MAX_IMAGE_PIXELS} pixels (width times height)"
    return None


def check_picture(data: bytes) -> None:
    """Raise `PictureRefused` unless `data` is a whole picture (Pillow's `verify`: not truncated
    or corrupt) of at most `MAX_IMAGE_PIXELS` pixels."""
    too_large = oversized(data)
    if too_large:
        raise PictureRefused(too_large)
    try:
        with Image.open(io.BytesIO(data)) as picture:
            picture.verify()
    except UnidentifiedImageError:
        raise PictureRefused("the image is not in a format this studio reads (PNG, JPEG, WebP, ...)") from None
    except Image.DecompressionBombError as exc:
        raise PictureRefused(f"the image is too large: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:  # how Pillow reports truncated or corrupt files
        raise PictureRefused(f"the image is broken: {exc}") from None
