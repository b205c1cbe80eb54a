"""The op of the README's quick start (`workflows/hello.py`)."""

from __future__ import annotations

from engine.spec.ops import op


@op("hello.greet")
def greet(name: str) -> str:
    """A greeting for `name`."""
    return f"hello, {name}"
