"""Back-pressure on streams: credit windows, bounded stream channels, and runs whose
producers outpace their readers, in one process.

The producers here never wait by themselves, so a producer that is not held back makes
its whole stream before its reader runs: how far ahead it gets is exact, not a matter of
timing. Readers that must wait for the producer wait on `fns.COUNTS`, never on a clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from engine.compute.context import UnitContext
from engine.compute.python import PythonUnit
from engine.data.credit import CreditWindow, Taken
from engine.flow.dispatch import InProcessDispatcher
from engine.flow.dsl import Workflow
from engine.flow.events import RunStatus
from engine.flow.executor import Executor, RunResult
from engine.flow.streams import StreamChannel, StreamGroup
from engine.spec.calls import NodeCall, NodeContext
from engine.spec.graph import RoleSpec
from engine.spec.kinds import KindRegistry, default_kinds
from engine.spec.ops import OpConfig, default_ops
from tests.unit.flow import fns

DEADLINE_S = 10.0
CAPACITY = 4


@pytest.fixture(autouse=True)
def counters():
    fns.COUNTS.clear()
    fns.GATES.clear()
    yield fns.COUNTS
    fns.COUNTS.clear()
    fns.GATES.clear()


@pytest.fixture
def kinds() -> KindRegistry:
    return default_kinds(load_entry_points=False)


async def run(kinds: KindRegistry, wf: Workflow, capacity: int = CAPACITY) -> RunResult:
    executor = Executor(InProcessDispatcher(kinds), kinds, stream_capacity=capacity)
    try:
        handle = await executor.submit(wf.to_spec(), timeout_s=DEADLINE_S)
        return await handle.wait()
    finally:
        await executor.aclose()


# ------------------------------------------------------------------ credit
async def test_a_sender_waits_for_credit_and_a_closed_window_lets_it_go():
    window = CreditWindow(2)
    await window.wait(0)
    await window.wait(1)
    third = asyncio.ensure_future(window.wait(2))
    await asyncio.sleep(0)  # one loop turn: the wait is parked on the future
    assert not third.done()
    window.grant(1)
    await asyncio.wait_for(third, 1)
    fourth = asyncio.ensure_future(window.wait(3))
    await asyncio.sleep(0)
    assert not fourth.done()
    window.close()  # the peer is gone: the sender goes on, and its send fails
    await asyncio.wait_for(fourth, 1)
    assert not window.exhausted(100)


def test_credit_comes_back_in_half_windows():
    taken = Taken(8)
    assert [taken.take() for _ in range(9)] == [0, 0, 0, 4, 0, 0, 0, 4, 0]
    one = Taken(1)
    assert [one.take() for _ in range(3)] == [1, 1, 1]
    with pytest.raises(ValueError, match="at least one frame"):
        CreditWindow(0)


# ------------------------------------------------------------------ channels
async def test_a_channel_holds_capacity_frames_only_while_its_reader_runs():
    channel = StreamChannel(2)
    for i in range(5):  # no reader yet: it may never come before the producer ends
        await channel.put(i)
    assert channel.held == 5
    channel.attach()
    assert [await anext(channel) for _ in range(3)] == [0, 1, 2]
    put = asyncio.ensure_future(channel.put(5))
    await asyncio.sleep(0)
    assert not put.done()  # two frames held: full
    assert await anext(channel) == 3
    await asyncio.wait_for(put, 1)
    blocked = asyncio.ensure_future(channel.put(6))
    await asyncio.sleep(0)
    assert not blocked.done()
    channel.detach()  # the reader ended: its producer goes on, and nothing is kept for it
    await asyncio.wait_for(blocked, 1)
    for i in range(7, 10):
        await channel.put(i)
    assert channel.held == 0


async def test_a_reader_waiting_on_an_empty_channel_frees_its_other_channels():
    group = StreamGroup()
    a, b = StreamChannel(1, group), StreamChannel(1, group)
    a.attach()
    b.attach()
    await a.put("a0")
    held = asyncio.ensure_future(a.put("a1"))
    await asyncio.sleep(0)
    assert not held.done()
    waiting = asyncio.ensure_future(anext(b))  # the reader wants b, which only comes after a1
    await asyncio.wait_for(held, 1)
    await b.put("b0")
    assert await asyncio.wait_for(waiting, 1) == "b0"
    assert [await anext(a), await anext(a)] == ["a0", "a1"]


async def test_a_reader_woken_on_its_channel_no_longer_frees_it():
    """A put that wakes the waiting reader fills the channel up to its capacity, no further,
    even before the reader ran again (else a producer that never waits would make them all)."""
    channel = StreamChannel(2)
    channel.attach()
    reader = asyncio.ensure_future(anext(channel))
    await asyncio.sleep(0)  # one loop turn: the reader waits on the empty channel
    held: list[int] = []

    async def produce() -> None:
        for i in range(5):
            await channel.put(i)
            held.append(channel.held)

    producer = asyncio.ensure_future(produce())
    await asyncio.sleep(0)  # the producer runs until it waits; the reader has not run since
    assert held == [1, 2]
    assert await reader == 0
    assert [await anext(channel) for _ in range(4)] == [1, 2, 3, 4]
    await asyncio.wait_for(producer, 1)


async def test_a_relayed_channel_waiting_frees_nothing():
    """The dispatcher's relay to a worker waits on every idle port: the worker's credit, not
    its waits, says when the node starves."""
    group = StreamGroup()
    busy, idle = StreamChannel(1, group), StreamChannel(1, group)
    for channel in (busy, idle):
        channel.attach()
    idle.relay()
    relay = asyncio.ensure_future(anext(idle))
    await busy.put("a0")
    held = asyncio.ensure_future(busy.put("a1"))
    await asyncio.sleep(0)
    assert not held.done()
    relay.cancel()
    held.cancel()


# ------------------------------------------------------------------ runs
def one_stream(producer: Any, produce_params: dict[str, Any], reader: Any,
               read_params: dict[str, Any] | None = None, **role: Any) -> Workflow:
    """`producer` streaming to `reader`, on one role (`role`: its options)."""
    wf = Workflow("one-stream")
    py = wf.role("py", **role)
    src = wf.python(producer, role=py, id="src", stream=True, params=produce_params)
    read = wf.python(reader, role=py, id="read", params=read_params)
    wf.edge(src, read, stream=True)
    wf.output("out", read)
    return wf


def lagging(n: int, ahead: int) -> Workflow:
    """A producer that waits once, for its reader to start, and never again."""
    return one_stream(fns.counted_frames, {"n": n, "name": "src", "gate": "reader"},
                      fns.lagging_reader, {"name": "src", "n": n, "ahead": ahead, "gate": "reader"})


async def test_a_producer_runs_at_most_capacity_frames_ahead_of_its_reader(kinds: KindRegistry):
    result = await run(kinds, lagging(50, CAPACITY))
    assert result.status == RunStatus.DONE, result.error
    # The channel's frames, and one more the producer holds while it waits for room.
    assert result.outputs["out"] == {"count": 50, "max_lead": CAPACITY + 1}


async def test_without_a_capacity_the_producer_runs_to_its_end_first(kinds: KindRegistry):
    result = await run(kinds, lagging(50, CAPACITY), capacity=0)
    assert result.status == RunStatus.DONE, result.error
    assert result.outputs["out"] == {"count": 50, "max_lead": 49}


async def test_a_reader_queued_behind_its_producer_does_not_hold_it(kinds: KindRegistry):
    """One slot: the reader runs only once the producer is done, so the producer must not
    wait for it meanwhile."""
    result = await run(kinds, one_stream(fns.counted_frames, {"n": 30, "name": "src"}, fns.consume_all,
                                         params={"capacity": 1}))
    assert result.status == RunStatus.DONE, result.error
    assert result.outputs["out"] == list(range(30))


async def test_plain_generator_and_reader_on_one_slot_per_replica_share_the_role(kinds: KindRegistry):
    """Two replicas of one slot each, in process: the generator holds a thread while it waits
    for its reader, so the reader needs a thread of its own."""
    result = await run(kinds, one_stream(fns.sync_frames, {"items": list(range(200))}, fns.consume_blocking,
                                         replicas=2, params={"capacity": 1}))
    assert result.status == RunStatus.DONE, result.error
    assert result.outputs["out"] == list(range(200))


async def test_a_reader_that_fails_releases_its_producer_and_the_run_fails(kinds: KindRegistry):
    wf = Workflow("fails")
    py = wf.role("py")
    src = wf.python(fns.counted_frames, role=py, id="src", stream=True, params={"n": 100, "name": "src"})
    read = wf.python(fns.fail_after, role=py, id="read", params={"k": 2})
    wf.edge(src, read, stream=True)
    wf.output("out", read)
    result = await run(kinds, wf)
    assert result.status == RunStatus.FAILED
    assert result.error == "node 'read' failed: ValueError: gave up after 2 frames"


async def test_cancelling_a_run_whose_producer_waits_for_room_ends_it(kinds: KindRegistry):
    executor = Executor(InProcessDispatcher(kinds), kinds, stream_capacity=CAPACITY)
    try:
        handle = await executor.submit(lagging(50, 10 * CAPACITY).to_spec(), timeout_s=DEADLINE_S)
        # The reader waits for frames the producer may not make: it stops at the capacity.
        await fns.COUNTS.reached("src", CAPACITY + 2)
        await handle.cancel()
        result = await asyncio.wait_for(handle.wait(), DEADLINE_S)
    finally:
        await executor.aclose()
    assert result.status == RunStatus.CANCELLED
    assert fns.COUNTS.values["src"] == CAPACITY + 2


async def test_a_plain_generator_runs_only_read_ahead_frames_beyond_its_reader(kinds: KindRegistry):
    unit = PythonUnit(RoleSpec(name="py", kind="python"), UnitContext(ops=OpConfig(default_ops(), allow_module_ops=True)))
    made: list[int] = []
    call = NodeCall("r", "src", f"{fns.__name__}:counted_sync_frames", {"n": 100, "made": made}, {}, ("out",),
                    True, False, 1, 1)
    frames = unit.execute_stream(call, NodeContext("r", "src", 1, 1, lambda f, m: None))
    try:
        for taken in range(1, 4):
            assert await anext(frames) == {"out": taken - 1}
            bound = taken + PythonUnit.READ_AHEAD
            await wait_for(lambda bound=bound: len(made) >= bound, f"frame {bound - 1} is made")
            assert len(made) <= bound, made  # then the generator waits for room
        await frames.aclose()  # the reader leaves: the generator is closed at its next frame
        await wait_for(lambda: made[-1] == -1, "the generator is closed")
        assert made == [0, 1, 2, 3, 4, -1]
    finally:
        await unit.close()


async def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Wait, by loop turns and with a deadline, for a thread of the unit to get somewhere."""
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE_S} s"
        await asyncio.sleep(0.001)


def ports_in_turn(n: int, reader: Any, **params: Any) -> Workflow:
    wf = Workflow("turns")
    py = wf.role("py")
    src = wf.python(fns.ports_in_turn, role=py, id="src", stream=True, params={"n": n},
                    outputs={"a": "json", "b": "json"})
    zipped = wf.python(reader, role=py, id="zip", params=params)
    wf.edge(src.out("a"), zipped.inp("a"), stream=True)
    wf.edge(src.out("b"), zipped.inp("b"), stream=True)
    wf.output("out", zipped)
    return wf


async def test_a_reader_taking_its_ports_in_turn_does_not_deadlock(kinds: KindRegistry):
    """Every `a` frame comes before the first `b`: a reader that wants a `b` after each `a`
    gets it only if `a`'s channel may outgrow its capacity while the reader waits on `b`."""
    n = 5 * CAPACITY
    result = await run(kinds, ports_in_turn(n, fns.zip_sum))
    assert result.status == RunStatus.DONE, result.error
    assert result.outputs["out"] == [11 * i for i in range(n)]


async def test_a_reader_that_stops_early_does_not_hold_its_producer(kinds: KindRegistry):
    wf = Workflow("early")
    py = wf.role("py")
    fns.early_reader(wf, fns.counted_frames, {"n": 40, "name": "src"}, py, py)
    result = await run(kinds, wf)
    assert result.status == RunStatus.DONE, result.error
    assert result.outputs == {"first": [0, 1, 2], "all": list(range(40))}


async def test_a_reader_that_fires_after_its_producer_ended_gets_every_frame(kinds: KindRegistry):
    """The reader needs a value made from the end of the stream it reads: its channel must
    hold the whole stream, as it cannot read before the producer finished."""
    wf = Workflow("after")
    py = wf.role("py")
    src = wf.python(fns.counted_frames, role=py, id="src", stream=True, params={"n": 30, "name": "src"})
    listed = wf.python(fns.collect, role=py, id="listed", inputs={"values": {"type": "json", "join": "ordered"}})
    both = wf.python(fns.stream_and_list, role=py, id="both")
    wf.edge(src, listed)
    wf.edge(src, both.inp("items"), stream=True)
    wf.edge(listed, both.inp("listed"))
    wf.output("out", both)
    result = await run(kinds, wf)
    assert result.status == RunStatus.DONE, result.error
    assert result.outputs["out"] == {"streamed": sum(range(30)), "listed": sum(range(30))}


def test_a_negative_capacity_is_refused(kinds: KindRegistry):
    with pytest.raises(ValueError, match="stream_capacity must be 0"):
        Executor(InProcessDispatcher(kinds), kinds, stream_capacity=-1)
