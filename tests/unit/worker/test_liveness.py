"""The worker's liveness thread stops the worker when a health check fails (e.g. the GPU
weights it attached lost their publisher), once, with the reason; and its loop watch tells a
stuck event loop from one that is merely late."""

from __future__ import annotations

import threading

from engine.flow.discovery import WorkerLoad
from engine.spec.graph import RoleSpec
from engine.worker.config import WorkerConfig
from engine.worker.liveness import Liveness, LoopWatch


def test_a_failed_check_stops_the_worker_once_with_its_reason() -> None:
    reasons: list[str] = []
    stopped = threading.Event()
    checks: list[int] = []

    def stop_worker(reason: str) -> None:
        reasons.append(reason)
        stopped.set()

    def check() -> str | None:
        checks.append(1)
        return "the publisher of GPU weights this worker attached is gone: m (pid 1)" if len(checks) >= 2 else None

    config = WorkerConfig(RoleSpec(name="py", kind="python"), "py-0", heartbeat_s=0.02)
    liveness = Liveness(config, "127.0.0.1", lambda: WorkerLoad(), stop_worker, check)
    liveness.start_and_bind()
    try:
        assert stopped.wait(10), "the failed check did not stop the worker"
    finally:
        liveness.stop()
    assert not liveness.is_alive()
    assert reasons == ["the publisher of GPU weights this worker attached is gone: m (pid 1)"]
    assert len(checks) == 2  # not asked again once the worker is stopping


class _Loop:
    """The probes a `LoopWatch` posts, held until the test lets the 'loop' run them."""

    def __init__(self) -> None:
        self.posted: list = []

    def call_soon_threadsafe(self, callback) -> None:
        self.posted.append(callback)

    def turn(self) -> None:
        posted, self.posted = self.posted, []
        for callback in posted:
            callback()


def test_a_loop_that_answers_its_probes_is_never_stalled() -> None:
    loop = _Loop()
    watch = LoopWatch(loop, timeout_s=1e-9)  # any probe older than now counts as overdue
    for _ in range(5):
        assert watch.stalled() is None
        assert len(loop.posted) == 1
        loop.turn()


def test_a_stuck_loop_is_reported_on_the_check_after_its_probe_is_overdue() -> None:
    loop = _Loop()
    watch = LoopWatch(loop, timeout_s=1e-9)
    assert watch.stalled() is None  # posts the probe
    assert watch.stalled() is None  # overdue: suspect, confirmed only on the next check
    reason = watch.stalled()
    assert reason is not None and reason.startswith("the worker's event loop has not turned for")
    assert reason.endswith("(stall timeout 1e-09 s)")
    assert len(loop.posted) == 1  # one probe out at a time


def test_a_loop_that_answers_late_after_a_whole_process_pause_is_not_stalled() -> None:
    """Both threads held up together: the check may run before the loop's first turn, but the
    loop answers long before the check after it."""
    loop = _Loop()
    watch = LoopWatch(loop, timeout_s=1e-9)
    assert watch.stalled() is None
    assert watch.stalled() is None  # the pause ends; the liveness thread happens to run first
    loop.turn()
    assert watch.stalled() is None  # answered: a fresh probe, nothing suspect
    loop.turn()
    assert watch.stalled() is None


def test_a_zero_stall_timeout_never_probes() -> None:
    loop = _Loop()
    watch = LoopWatch(loop, timeout_s=0)
    assert [watch.stalled() for _ in range(3)] == [None, None, None]
    assert loop.posted == []
