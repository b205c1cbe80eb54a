"""The studio's engine loop starts once, however many callers ask for it while it starts, and a
start that fails says why (`RunService.start`)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from studio.workflows.apps import StudioEngine
from studio.workflows.runs import service as service_module
from studio.workflows.runs.bus import LocalRunEventBus
from studio.workflows.runs.service import EngineLoopError, RunService


def engine_threads() -> int:
    return sum(thread.name == "omniflow-engine" and thread.is_alive() for thread in threading.enumerate())


async def answer() -> str:
    return "answered"


def test_callers_that_give_up_on_a_slow_start_leave_one_start_and_the_next_caller_gets_its_loop(
        studio_engine: StudioEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the loop imports torch (held here on a gate), each caller waits `start_timeout_s` and
    gives up naming why; none starts a second loop (two loops once served one deployment host, whose
    Redis client then failed with "attached to a different loop"). Once the import is done, the
    same start serves every caller."""
    gate = threading.Event()
    real = service_module.in_process_executor

    def slow_executor(*args: Any, **kwargs: Any) -> Any:
        gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(service_module, "in_process_executor", slow_executor)
    before = engine_threads()
    service = RunService(studio_engine.kinds, LocalRunEventBus(), ops=studio_engine.ops, start_timeout_s=0.2)
    try:
        for _ in range(2):
            with pytest.raises(EngineLoopError, match=r"did not start within 0\.2 s \(still starting\)"):
                service.start()
            assert engine_threads() == before + 1 and not service.running
        gate.set()
        service.start()
        assert service.running and engine_threads() == before + 1
        assert service.call(answer()).result(10) == "answered"
    finally:
        gate.set()
        service.stop()
    assert engine_threads() == before


def test_a_start_that_fails_says_why_and_the_next_start_tries_again(
        studio_engine: StudioEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real = service_module.in_process_executor

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("the ops' root is not readable")

    monkeypatch.setattr(service_module, "in_process_executor", broken)
    service = RunService(studio_engine.kinds, LocalRunEventBus(), ops=studio_engine.ops, start_timeout_s=30)
    try:
        with pytest.raises(EngineLoopError, match="failed to start: the ops' root is not readable") as err:
            service.start()
        assert isinstance(err.value.__cause__, OSError) and not service.running
        monkeypatch.setattr(service_module, "in_process_executor", real)
        service.start()
        assert service.call(answer()).result(10) == "answered"
    finally:
        service.stop()
