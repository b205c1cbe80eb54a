"""Dynamic routing: a classifier picks one branch; the other is skipped, not stuck."""

from __future__ import annotations

from engine.flow.dsl import Route, Workflow


def classify(text: str) -> Route:
    """Questions go to `answer`, everything else to `echo`."""
    return Route(["answer" if text.rstrip().endswith("?") else "echo"], text)


def answer(text: str) -> str:
    return f"You asked: {text!r}. The answer is 42."


def echo(text: str) -> str:
    return text.upper()


def merge(reply: str) -> str:
    return reply


wf = Workflow("router", description="route a message to one of two handlers")
py = wf.role("py", kind="python")
message = wf.input("message", "text", default="What is the meaning of life?")
cls = wf.python(classify, role=py, routes=["answer", "echo"], outputs={"out": "text"})
ans = wf.python(answer, role=py, outputs={"out": "text"})
ech = wf.python(echo, role=py, outputs={"out": "text"})
mrg = wf.python(merge, role=py, outputs={"out": "text"})
wf.edge(message, cls)
wf.edge(cls, ans)
wf.edge(cls, ech)
# Both branches feed one port: only the routed one delivers.
wf.edge(ans, mrg)
wf.edge(ech, mrg)
wf.output("reply", mrg, "text")

workflow = wf
