"""The worker's liveness thread stops the worker when a health check fails (e.g. the GPU
weights it attached lost their publisher), once, with the reason."""

from __future__ import annotations

import threading

from engine.flow.discovery import WorkerLoad
from engine.spec.graph import RoleSpec
from engine.worker.process import WorkerConfig, _Liveness


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
    liveness = _Liveness(config, "127.0.0.1", lambda: WorkerLoad(), stop_worker, check)
    liveness.start_and_bind()
    try:
        assert stopped.wait(10), "the failed check did not stop the worker"
    finally:
        liveness.stop()
    assert not liveness.is_alive()
    assert reasons == ["the publisher of GPU weights this worker attached is gone: m (pid 1)"]
    assert len(checks) == 2  # not asked again once the worker is stopping
