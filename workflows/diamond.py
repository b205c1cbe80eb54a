"""A diamond with an OR-AND trigger.

`n` fans out to `square` and `cube`, which join into `total` (a `join: all` port). A
memo lookup races them: `total` fires when both branches have delivered, OR as soon
as the memo routes a remembered answer to it (trigger `[[square, cube], [memo]]`).
"""

from __future__ import annotations

from engine.flow.dsl import Route, Workflow

REMEMBERED = {3: 36}


def square(x: int) -> int:
    return x * x


def cube(x: int) -> int:
    return x * x * x


def memo(x: int) -> Route:
    """Route to `total` with the remembered sum, or nowhere on a miss."""
    if x in REMEMBERED:
        return Route(["total"], REMEMBERED[x])
    return Route([], None)


def total(values: list[int]) -> int:
    return sum(values)


wf = Workflow("diamond", description="square + cube of n, raced by a memo (OR-AND trigger)")
py = wf.role("py", kind="python", replicas=2)
n = wf.input("n", "json", default=6)
sq = wf.python(square, role=py)
cu = wf.python(cube, role=py)
me = wf.python(memo, role=py, routes=["total"])
tot = wf.python(total, role=py, inputs={"values": {"type": "json", "join": "all"}},
                trigger=[["square", "cube"], ["memo"]])
for branch in (sq, cu, me):
    wf.edge(n, branch)
    wf.edge(branch, tot)
wf.output("sum", tot)

workflow = wf
