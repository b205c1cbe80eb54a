"""Ops of `workflows/router.py`: a classifier and the two handlers it picks between."""

from __future__ import annotations

from engine.spec.calls import Route
from engine.spec.ops import op


@op("router.classify", outputs={"out": "text"})
def classify(text: str) -> Route:
    """Questions go to `answer`, everything else to `echo`."""
    return Route(["answer" if text.rstrip().endswith("?") else "echo"], text)


@op("router.answer")
def answer(text: str) -> str:
    """The answer to a question."""
    return f"You asked: {text!r}. The answer is 42."


@op("router.echo")
def echo(text: str) -> str:
    """The text in capitals."""
    return text.upper()


@op("router.merge")
def merge(reply: str) -> str:
    """Whichever reply arrived."""
    return reply
