"""Ops of `workflows/loop.py`: double a value until it reaches a target."""

from __future__ import annotations

from engine.spec.calls import Route
from engine.spec.ops import op


@op("loop.grow")
def grow(state: dict) -> dict:
    """The state with its value doubled and one more step."""
    return {"value": state["value"] * 2, "steps": state["steps"] + 1, "target": state["target"]}


@op("loop.start")
def start(value: int, target: int) -> dict:
    """The loop's first state."""
    return {"value": value, "steps": 0, "target": target}


@op("loop.check")
def check(state: dict) -> Route:
    """Route to `done` once the value reached the target, else back to `grow`."""
    return Route(["done"] if state["value"] >= state["target"] else ["grow"], state)


@op("loop.done")
def done(state: dict) -> dict:
    """The final value and the steps it took."""
    return {"value": state["value"], "steps": state["steps"]}
