"""Errors of the encoders."""

from __future__ import annotations


class EncoderError(ValueError):
    """An input an encoder cannot take, or an unknown encoder."""
