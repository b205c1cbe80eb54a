"""Errors of the decoders."""

from __future__ import annotations


class DecoderError(ValueError):
    """An input a decoder cannot take, or an unknown decoder."""
