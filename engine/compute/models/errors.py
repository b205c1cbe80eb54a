"""The model family's error type, apart so that every module of the package can raise it."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model name is unknown, or a directory is not a loadable checkpoint of a supported family."""
