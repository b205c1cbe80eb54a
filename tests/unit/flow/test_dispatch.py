"""The in-process dispatcher: a role's unit is built off the event loop, once however many calls
come while it builds, and a failed build is not kept. Builds wait on gates the test opens once it
has seen what it needs; every wait is bounded, so a broken dispatcher fails instead of hanging."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from engine.flow.dispatch import InProcessDispatcher
from engine.spec.calls import ComputeUnit, NodeCall, NodeContext, NodeResult, RanOn
from engine.spec.graph import RoleSpec
from engine.spec.kinds import default_kinds

WAIT_S = 10.0
ROLE = RoleSpec(name="py", kind="python")


class Echo(ComputeUnit):
    def __init__(self) -> None:
        self.closed = False

    async def execute(self, call: NodeCall, ctx: NodeContext) -> NodeResult:
        return NodeResult(outputs={"out": call.inputs["x"]})

    async def close(self) -> None:
        self.closed = True


def call_of(x: int, reports: list[tuple[float | None, str]] | None = None) -> tuple[NodeCall, NodeContext]:
    """Node `n<x>`'s call; its progress reports go to `reports`."""
    call = NodeCall(run_id="r", node_id=f"n{x}", op=None, params={}, inputs={"x": x}, output_ports=("out",),
                    stream=False, router=False, iteration=1, attempt=1)
    report = (lambda f, m: None) if reports is None else (lambda f, m: reports.append((f, m)))
    return call, NodeContext(run_id="r", node_id=f"n{x}", iteration=1, attempt=1, report_progress=report)


class GatedBuild:
    """`(role) -> Echo` that records the thread it ran on and, while `gate` is closed, waits for it
    (at most WAIT_S: a build on the loop's own thread would otherwise hold the loop for good)."""

    def __init__(self, fail_first: bool = False) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.threads: list[int] = []
        self.units: list[Echo] = []
        self._fail = fail_first

    def __call__(self, role: RoleSpec) -> Echo:
        self.threads.append(threading.get_ident())
        self.entered.set()
        self.gate.wait(WAIT_S)
        if self._fail:
            self._fail = False
            raise RuntimeError("the model would not load")
        self.units.append(Echo())
        return self.units[-1]


def execute(dispatcher: InProcessDispatcher, x: int, started: Callable[[RanOn], None] = lambda where: None, *,
            role: RoleSpec = ROLE, reports: list[tuple[float | None, str]] | None = None) -> asyncio.Task[NodeResult]:
    call, ctx = call_of(x, reports)
    return asyncio.get_running_loop().create_task(dispatcher.execute(role, call, ctx, started))


def test_a_unit_is_built_off_the_loop_once_while_the_loop_serves_on() -> None:
    build = GatedBuild()

    async def main() -> None:
        dispatcher = InProcessDispatcher(default_kinds(load_entry_points=False), build=build)
        first = execute(dispatcher, 1)
        assert await asyncio.to_thread(build.entered.wait, WAIT_S)
        # This coroutine runs on while the unit builds: the loop is free (a build on the loop held it
        # until the build ended, `first` with it).
        assert not first.done()
        second = execute(dispatcher, 2)  # comes while the unit builds: waits for that build
        await asyncio.sleep(0)
        assert not second.done()
        build.gate.set()
        results = await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
        assert [r.outputs for r in results] == [{"out": 1}, {"out": 2}]
        assert (await asyncio.wait_for(execute(dispatcher, 3), WAIT_S)).outputs == {"out": 3}  # built: reused
        await dispatcher.close()

    asyncio.run(main())
    assert len(build.units) == 1 and build.units[0].closed
    assert threading.get_ident() not in build.threads  # asyncio.run's loop runs on this thread


def test_a_failed_build_fails_its_calls_and_the_next_call_builds_again() -> None:
    build = GatedBuild(fail_first=True)
    build.gate.set()

    async def main() -> None:
        dispatcher = InProcessDispatcher(default_kinds(load_entry_points=False), build=build)
        with pytest.raises(RuntimeError, match="would not load"):
            await asyncio.wait_for(execute(dispatcher, 1), WAIT_S)
        assert (await asyncio.wait_for(execute(dispatcher, 2), WAIT_S)).outputs == {"out": 2}
        await dispatcher.close()

    asyncio.run(main())
    assert len(build.threads) == 2 and len(build.units) == 1


def test_a_call_cancelled_while_its_unit_builds_leaves_the_build_to_the_next_call() -> None:
    build = GatedBuild()

    async def main() -> None:
        dispatcher = InProcessDispatcher(default_kinds(load_entry_points=False), build=build)
        first = execute(dispatcher, 1)
        assert await asyncio.to_thread(build.entered.wait, WAIT_S)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        second = execute(dispatcher, 2)
        build.gate.set()
        assert (await asyncio.wait_for(second, WAIT_S)).outputs == {"out": 2}
        await dispatcher.close()

    asyncio.run(main())
    assert len(build.threads) == 1 and build.units[0].closed


def test_a_call_waiting_for_its_roles_model_to_load_says_so_before_it_starts() -> None:
    build = GatedBuild()
    llm = RoleSpec(name="writer", kind="llm", model="smollm2-135m")
    seen: list[str] = []  # reports and the start, in order

    async def main() -> None:
        dispatcher = InProcessDispatcher(default_kinds(load_entry_points=False), build=build)
        first: list[tuple[float | None, str]] = []
        waiting = execute(dispatcher, 1, lambda where: seen.append("started"), role=llm, reports=first)
        assert await asyncio.to_thread(build.entered.wait, WAIT_S)
        seen.extend(message for _, message in first)
        assert first == [(None, "loading smollm2-135m (role writer)")] and seen == [first[0][1]]
        build.gate.set()
        await asyncio.wait_for(waiting, WAIT_S)
        assert seen == ["loading smollm2-135m (role writer)", "started"]
        later: list[tuple[float | None, str]] = []
        await asyncio.wait_for(execute(dispatcher, 2, role=llm, reports=later), WAIT_S)
        assert later == []  # built: nothing to wait for
        python: list[tuple[float | None, str]] = []
        await asyncio.wait_for(execute(dispatcher, 3, reports=python), WAIT_S)
        assert python == []  # no model: its unit is built at once, unannounced
        await dispatcher.close()

    asyncio.run(main())
