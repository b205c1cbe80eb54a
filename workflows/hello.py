"""The README's quick start: a name in, a greeting out, through the registered op `hello.greet`."""

from engine.flow.dsl import Workflow
from workflows.ops.hello import greet

wf = Workflow("hello")
py = wf.role("py", kind="python")
name = wf.input("name", "text", default="world")
node = wf.python(greet, role=py)
wf.edge(name, node)
wf.output("greeting", node)
workflow = wf
