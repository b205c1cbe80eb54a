"""Dynamic routing: a classifier picks one branch; the other is skipped, not stuck."""

from __future__ import annotations

from engine.flow.dsl import Workflow
from workflows.ops.router import answer, classify, echo, merge

wf = Workflow("router", description="route a message to one of two handlers")
py = wf.role("py", kind="python")
message = wf.input("message", "text", default="What is the meaning of life?")
cls = wf.python(classify, role=py, routes=["answer", "echo"])
ans = wf.python(answer, role=py)
ech = wf.python(echo, role=py)
mrg = wf.python(merge, role=py)
wf.edge(message, cls)
wf.edge(cls, ans)
wf.edge(cls, ech)
# Both branches feed one port: only the routed one delivers.
wf.edge(ans, mrg)
wf.edge(ech, mrg)
wf.output("reply", mrg, "text")

workflow = wf
