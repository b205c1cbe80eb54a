"""Ops of `workflows/diamond.py`: square and cube of n, a memo of known sums, their total."""

from __future__ import annotations

from engine.spec.calls import Route
from engine.spec.ops import op

REMEMBERED = {3: 36}


@op("diamond.square")
def square(x: int) -> int:
    """x squared."""
    return x * x


@op("diamond.cube")
def cube(x: int) -> int:
    """x cubed."""
    return x * x * x


@op("diamond.memo")
def memo(x: int) -> Route:
    """Route to `total` with the remembered sum, or nowhere on a miss."""
    if x in REMEMBERED:
        return Route(["total"], REMEMBERED[x])
    return Route([], None)


@op("diamond.total", inputs={"values": {"type": "json", "join": "all"}})
def total(values: list[int]) -> int:
    """The sum of the values gathered from every incoming edge."""
    return sum(values)
