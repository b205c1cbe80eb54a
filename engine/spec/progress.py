"""Progress a unit reports as it works: a count of a known total, throttled.

A unit that advances once per token or per denoising step would send an event each time; a
`ProgressMeter` reports at most once per `interval_s` (plus the first count and the count that
reaches the total), so a node's progress costs about ten events a second whatever its rate. The
meter calls `report` on the thread that advances it: a unit advancing it off the event loop
passes a report that hops onto the loop (`on_loop`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.spec.calls import NodeContext

Report = Callable[[float | None, str], None]

PROGRESS_INTERVAL_S = 0.1


@dataclass(slots=True)
class ProgressMeter:
    """`done` of `total` `unit`s ("tokens", "steps", "items"), reported as "12/64 tokens"."""

    report: Report = field(repr=False)
    total: int
    unit: str
    interval_s: float = PROGRESS_INTERVAL_S
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    done: int = 0
    _last: float = -math.inf

    def __post_init__(self) -> None:
        if self.total < 1:
            raise ValueError(f"a progress total must be >= 1, not {self.total}")

    def start(self) -> ProgressMeter:
        """Report none done yet (the bar appears before the first unit is)."""
        self._last = self.clock()
        self.report(0.0, f"0/{self.total} {self.unit}")
        return self

    def advance(self, count: int = 1) -> None:
        self.done += count
        now = self.clock()
        if self.done < self.total and now - self._last < self.interval_s:
            return
        self._last = now
        self.report(min(1.0, self.done / self.total), f"{min(self.done, self.total)}/{self.total} {self.unit}")


def on_loop(ctx: NodeContext, loop: asyncio.AbstractEventLoop) -> Report:
    """`ctx.progress` callable from any thread: the report runs on `loop`, which owns the run."""
    return lambda fraction, message: loop.call_soon_threadsafe(ctx.progress, fraction, message)
