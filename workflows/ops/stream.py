"""Ops of `workflows/stream.py`: a word stream, a stream-mode transform, a gathering join."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from engine.spec.ops import op


@op("stream.words", outputs={"word": "text"})
def words(text: str) -> Iterator[str]:
    """The text's words, one frame each."""
    yield from text.split()


@op("stream.shout", outputs={"word": "text"})
async def shout(words: AsyncIterator[str]) -> AsyncIterator[str]:
    """Each word of a stream in capitals, as it arrives."""
    async for word in words:
        yield word.upper()


@op("stream.sentence", inputs={"words": {"type": "text", "join": "ordered"}})
def sentence(words: list[str]) -> str:
    """The words, in order, as one sentence."""
    return " ".join(words)
