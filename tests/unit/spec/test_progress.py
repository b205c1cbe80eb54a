"""ProgressMeter: counts reported as fractions and "n/N unit", at most once per interval, the
first (start) and the last (total reached) always."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.spec.calls import NodeContext
from engine.spec.progress import ProgressMeter, on_loop


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reports_are_throttled_to_one_per_interval_with_the_last_always_sent() -> None:
    clock, seen = Clock(), []
    meter = ProgressMeter(lambda f, m: seen.append((f, m)), 10, "steps", interval_s=0.1, clock=clock).start()
    for step in range(1, 11):
        clock.now += 0.04  # four steps per 0.16 s: one report per 0.1 s at most
        meter.advance()
        if step == 5:
            clock.now += 1.0  # a stall: the next step is reported at once
    assert seen == [(0.0, "0/10 steps"), (0.3, "3/10 steps"), (0.6, "6/10 steps"), (0.9, "9/10 steps"),
                    (1.0, "10/10 steps")]
    assert meter.done == 10


def test_a_count_past_the_total_reads_as_full_and_a_bad_total_is_refused() -> None:
    seen = []
    meter = ProgressMeter(lambda f, m: seen.append((f, m)), 4, "tokens", clock=Clock())
    meter.advance(3)
    meter.advance(5)
    assert seen == [(0.75, "3/4 tokens"), (1.0, "4/4 tokens")]
    with pytest.raises(ValueError, match="progress total must be >= 1, not 0"):
        ProgressMeter(seen.append, 0, "items")


async def test_on_loop_reports_from_a_thread_reach_the_context_on_its_loop() -> None:
    got: list[tuple[float | None, str, bool]] = []
    loop_thread = threading.current_thread()
    ctx = NodeContext(run_id="r", node_id="n", iteration=1, attempt=1,
                      report_progress=lambda f, m: got.append((f, m, threading.current_thread() is loop_thread)))
    meter = ProgressMeter(on_loop(ctx, asyncio.get_running_loop()), 2, "steps", clock=Clock())
    await asyncio.to_thread(lambda: (meter.start(), meter.advance(2)))
    await asyncio.sleep(0)
    assert got == [(0.0, "0/2 steps", True), (1.0, "2/2 steps", True)]
