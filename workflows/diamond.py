"""A diamond with an OR-AND trigger.

`n` fans out to `square` and `cube`, which join into `total` (a `join: all` port). A
memo lookup races them: `total` fires when both branches have delivered, OR as soon
as the memo routes a remembered answer to it (trigger `[[square, cube], [memo]]`).
"""

from __future__ import annotations

from engine.flow.dsl import Workflow
from workflows.ops.diamond import cube, memo, square, total

wf = Workflow("diamond", description="square + cube of n, raced by a memo (OR-AND trigger)")
py = wf.role("py", kind="python", replicas=2)
n = wf.input("n", "json", default=6)
sq = wf.python(square, role=py)
cu = wf.python(cube, role=py)
me = wf.python(memo, role=py, routes=["total"])
tot = wf.python(total, role=py, trigger=[["square", "cube"], ["memo"]])
for branch in (sq, cu, me):
    wf.edge(n, branch)
    wf.edge(branch, tot)
wf.output("sum", tot)

workflow = wf
