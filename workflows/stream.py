"""Streaming: a producer yields words, a stream-mode consumer transforms each as it
arrives (starting on the first frame), and an `ordered` join gathers the result."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from engine.flow.dsl import Workflow


def words(text: str) -> Iterator[str]:
    yield from text.split()


async def shout(words: AsyncIterator[str]) -> AsyncIterator[str]:
    async for word in words:
        yield word.upper()


def sentence(words: list[str]) -> str:
    return " ".join(words)


wf = Workflow("stream", description="stream words through a consumer that starts on the first frame")
py = wf.role("py", kind="python")
text = wf.input("text", "text", default="frames flow through the graph one at a time")
src = wf.python(words, role=py, outputs={"word": "text"}, stream=True)
up = wf.python(shout, role=py, inputs={"words": "text"}, outputs={"word": "text"}, stream=True)
out = wf.python(sentence, role=py, inputs={"words": {"type": "text", "join": "ordered"}}, outputs={"out": "text"})
wf.edge(text, src)
wf.edge(src, up, stream=True)
wf.edge(up, out)
wf.output("result", out, "text")

workflow = wf
