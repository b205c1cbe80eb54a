"""A bounded loop: double a value until it reaches a target.

`grow` fires on its entry edge first, then on the back edge from `check`; `check`
routes back to `grow` or on to `done`. `max_iterations` bounds the cycle.
"""

from __future__ import annotations

from engine.flow.dsl import Workflow
from workflows.ops.loop import check, done, grow, start

wf = Workflow("loop", description="double a value until it reaches the target (bounded cycle)")
py = wf.role("py", kind="python")
value = wf.input("value", "json", default=3)
target = wf.input("target", "json", default=100)
st = wf.python(start, role=py)
gr = wf.python(grow, role=py, max_iterations=32)
ck = wf.python(check, role=py, routes=["grow", "done"])
dn = wf.python(done, role=py)
wf.edge(value, st.inp("value"))
wf.edge(target, st.inp("target"))
wf.edge(st, gr)
wf.edge(gr, ck)
wf.edge(ck, gr)
wf.edge(ck, dn)
wf.output("result", dn)

workflow = wf
