"""Streaming: a producer yields words, a stream-mode consumer transforms each as it
arrives (starting on the first frame), and an `ordered` join gathers the result."""

from __future__ import annotations

from engine.flow.dsl import Workflow
from workflows.ops.stream import sentence, shout, words

wf = Workflow("stream", description="stream words through a consumer that starts on the first frame")
py = wf.role("py", kind="python")
text = wf.input("text", "text", default="frames flow through the graph one at a time")
src = wf.python(words, role=py, stream=True)
up = wf.python(shout, role=py, inputs={"words": "text"}, outputs={"word": "text"}, stream=True)
out = wf.python(sentence, role=py)
wf.edge(text, src)
wf.edge(src, up, stream=True)
wf.edge(up, out)
wf.output("result", out, "text")

workflow = wf
