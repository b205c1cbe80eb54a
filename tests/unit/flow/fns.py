"""Node operations for the Control Flow tests, named as `tests.unit.flow.fns:NAME`.

Functions that must wait for the test (or for each other) take a `gate` param: the
name of an `asyncio.Event` in `GATES`. Functions that must report what happened to
them (cancellation, start) append to `LOG`. Both are cleared by the tests' `gates`
fixture, so each test starts from nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from engine.spec.calls import NodeContext, Route
from engine.spec.kinds import BuiltinModel


class Gates:
    """Named asyncio events shared by a test and the node functions its runs call."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def __getitem__(self, name: str) -> asyncio.Event:
        event = self._events.get(name)
        if event is None:
            event = self._events[name] = asyncio.Event()
        return event

    def clear(self) -> None:
        self._events.clear()


class Counters:
    """Named counters a node function sets and another waits on."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self._changed: dict[str, asyncio.Event] = {}

    def set(self, name: str, value: int) -> None:
        self.values[name] = value
        event = self._changed.pop(name, None)
        if event is not None:
            event.set()

    async def reached(self, name: str, value: int) -> None:
        while self.values.get(name, 0) < value:
            await self._changed.setdefault(name, asyncio.Event()).wait()

    def clear(self) -> None:
        self.values.clear()
        self._changed.clear()


GATES = Gates()
LOG: list[str] = []
COUNTS = Counters()


# ------------------------------------------------------------------ plain values
def inc(x: int) -> int:
    return x + 1


def double(x: int) -> int:
    return x * 2


def square(x: int) -> int:
    return x * x


def cube(x: int) -> int:
    return x * x * x


def add(a: int, b: int) -> int:
    return a + b


def total(values: list[int]) -> int:
    return sum(values)


def collect(values: list[Any]) -> list[Any]:
    return list(values)


def identity(x: Any) -> Any:
    return x


def maybe(x: int, y: int = 100) -> int:
    """`y` is an optional port: missing (its source skipped) means the default."""
    return x + y


def shout(text: str) -> str:
    return text.upper()


def split(x: int) -> dict[str, int]:
    """Two output ports, `lo` and `hi`."""
    return {"lo": x - 1, "hi": x + 1}


def wrong_keys(x: int) -> dict[str, int]:
    """Declared with ports `lo` and `hi`, returns `lo` and `bogus`."""
    return {"lo": x, "bogus": x}


def boom(x: Any) -> Any:
    raise ValueError(f"boom on {x!r}")


def with_progress(x: int, ctx: NodeContext) -> int:
    ctx.progress(0.5, "half")
    return x


def flaky(x: int, ctx: NodeContext, fail_times: int) -> int:
    """Fails its first `fail_times` attempts, then returns `x` tagged with the attempt."""
    LOG.append(f"flaky:attempt{ctx.attempt}")
    if ctx.attempt <= fail_times:
        raise RuntimeError(f"attempt {ctx.attempt} failed")
    return x * 10 + ctx.attempt


# ------------------------------------------------------------------ routers
def route_to(x: Any, to: list[str]) -> Route:
    """Routes to the successors named in the `to` param, passing `x` on."""
    return Route(to, x)


def route_by_sign(x: int) -> Route:
    return Route(["pos" if x >= 0 else "neg"], x)


def route_fake(x: Any) -> Route:
    """A plain (non-router) node returning a Route."""
    return Route(["anything"], x)


def not_a_route(x: Any) -> Any:
    """A router returning a plain value."""
    return x


# ------------------------------------------------------------------ loops
def loop_start(value: int, target: int) -> dict[str, int]:
    return {"value": value, "target": target, "steps": 0}


def loop_grow(state: dict[str, int]) -> dict[str, int]:
    return {**state, "value": state["value"] * 2, "steps": state["steps"] + 1}


def loop_check(state: dict[str, int]) -> Route:
    return Route(["finish"] if state["value"] >= state["target"] else ["grow"], state)


def loop_finish(state: dict[str, int]) -> dict[str, int]:
    return {"value": state["value"], "steps": state["steps"]}


# ------------------------------------------------------------------ gated (async)
async def gated(x: Any, gate: str) -> Any:
    """Announces `started:<gate>`, then returns `x` once the test opens `gate`."""
    LOG.append(f"started:{gate}")
    GATES[f"started:{gate}"].set()
    await GATES[gate].wait()
    return x


async def gated_square(x: int, gate: str) -> int:
    return await gated(x * x, gate)


async def gated_cube(x: int, gate: str) -> int:
    return await gated(x * x * x, gate)


async def hang(x: Any, name: str) -> Any:
    """Never returns on its own; records whether it was cancelled."""
    LOG.append(f"{name}:started")
    GATES[f"started:{name}"].set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        LOG.append(f"{name}:cancelled")
        raise
    return x


async def task_of(x: Any, name: str) -> Any:
    """Records the task it runs in, as `name:<the task's id>`, never letting the event loop turn."""
    LOG.append(f"{name}:{id(asyncio.current_task())}")
    return x


async def waiting_task_of(x: Any, name: str) -> Any:
    """`task_of` after letting the event loop turn once (`sleep(0)`: a yield, not a timed wait), as a
    node waiting on anything does (a worker's answer, a plain function's thread)."""
    await asyncio.sleep(0)
    return await task_of(x, name)


async def gated_boom(x: Any, gate: str) -> Any:
    """Raises once the test opens `gate`."""
    await GATES[gate].wait()
    raise ValueError(f"boom on {x!r}")


# ------------------------------------------------------------------ streams
async def frames(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def sync_frames(items: list[Any]) -> Iterator[Any]:
    yield from items


async def no_frames(x: Any) -> AsyncIterator[Any]:
    return
    yield  # pragma: no cover - makes this an async generator


async def handshake_frames(first: Any, second: Any, gate: str) -> AsyncIterator[Any]:
    """Yields `first`, then waits until the consumer opened `gate` before yielding `second`:
    a consumer that starts only after the stream ends would wait forever."""
    yield first
    await GATES[gate].wait()
    LOG.append("producer:second")
    yield second


async def consume_and_open(items: AsyncIterator[Any], gate: str) -> list[Any]:
    """A stream-mode consumer: opens `gate` as soon as it starts, then reads every frame."""
    LOG.append("consumer:started")
    GATES[gate].set()
    return [item async for item in items]


async def gated_frames(items: list[Any], gate: str) -> AsyncIterator[Any]:
    """Yields every item after `gate` opens."""
    await GATES[gate].wait()
    for item in items:
        yield item


async def stream_upper(words: AsyncIterator[str]) -> AsyncIterator[str]:
    async for word in words:
        yield word.upper()


async def consume_all(items: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in items]


def consume_blocking(items: Iterator[Any]) -> list[Any]:
    """A plain function reading a stream-mode input (runs in the unit's thread pool)."""
    return list(items)


async def self_cancel(x: Any) -> Any:
    """Raises CancelledError on its own, as awaiting a future someone else cancelled does."""
    future = asyncio.get_running_loop().create_future()
    future.cancel()
    return await future


def port_frames(x: Any) -> Iterator[dict[str, Any]]:
    """A stream over ports `a` and `b`: each frame carries some of them."""
    yield {"a": 1}
    yield {"b": 2}
    yield {"a": 3}


# ------------------------------------------------------------------ back-pressure
async def counted_frames(n: int, name: str, gate: str | None = None) -> AsyncIterator[int]:
    """Yields 0..n-1; `COUNTS[name]`: the frames made so far. With `gate`, it waits for the
    gate after its first frame (its reader opens it as it starts), and never again."""
    for i in range(n):
        COUNTS.set(name, i + 1)
        yield i
        if gate is not None and i == 0:
            await GATES[gate].wait()


def counted_sync_frames(n: int, made: list[int]) -> Iterator[int]:
    """A plain generator (run in a thread) of 0..n-1; `made` gets each frame as it is made,
    and -1 once the generator was closed."""
    try:
        for i in range(n):
            made.append(i)
            yield i
    finally:
        made.append(-1)


async def lagging_reader(items: AsyncIterator[int], name: str, n: int, ahead: int,
                         gate: str | None = None) -> dict[str, int]:
    """Reads the frames of `counted_frames(n, name)`, letting it get `ahead` frames ahead
    before taking the next: returns how far ahead it was at most. Opens `gate` first."""
    if gate is not None:
        GATES[gate].set()
    count = lead = 0
    async for i in items:
        await COUNTS.reached(name, min(n, i + 1 + ahead))
        lead = max(lead, COUNTS.values[name] - i - 1)
        count += 1
    return {"count": count, "max_lead": lead}


def ports_in_turn(n: int) -> Iterator[dict[str, int]]:
    """`n` frames on port `a`, then `n` on port `b`."""
    for i in range(n):
        yield {"a": i}
    for i in range(n):
        yield {"b": 10 * i}


async def zip_sum(a: AsyncIterator[int], b: AsyncIterator[int]) -> list[int]:
    """Reads its two stream inputs in turn, a frame of each."""
    return [x + await anext(b) async for x in a]


async def fail_after(items: AsyncIterator[Any], k: int) -> None:
    """Takes `k` frames, then fails."""
    for _ in range(k):
        await anext(items)
    raise ValueError(f"gave up after {k} frames")


def early_reader(wf: Any, producer: Any, params: dict[str, Any], src_role: Any, dst_role: Any) -> None:
    """`producer` streams to `head` (takes three frames and stops) and, buffered, to `rest`
    (all of them): outputs `first` and `all`."""
    src = wf.python(producer, role=src_role, id="src", stream=True, params=params)
    head = wf.python(first_frames, role=dst_role, id="head", params={"k": 3})
    rest = wf.python(collect, role=dst_role, id="rest", inputs={"values": {"type": "json", "join": "ordered"}})
    wf.edge(src, head, stream=True)
    wf.edge(src, rest)
    wf.output("first", head)
    wf.output("all", rest)


async def first_frames(items: AsyncIterator[Any], k: int) -> list[Any]:
    """Takes the first `k` frames of a stream and leaves the rest unread."""
    taken: list[Any] = []
    async for item in items:
        taken.append(item)
        if len(taken) == k:
            break
    return taken


async def stream_and_list(items: AsyncIterator[int], listed: list[int]) -> dict[str, int]:
    """A reader that fires only once `listed`, made from the end of the same stream, arrived."""
    return {"streamed": sum([i async for i in items]), "listed": sum(listed)}


def two_models() -> list[BuiltinModel]:
    """The built-in models of the validation tests' `lm` role kind."""
    return [BuiltinModel("real-lm", False, "real weights"), BuiltinModel("tiny-lm", True, "seeded")]


def to_bytes(x: str) -> bytes:
    return x.encode()


def blob_album(x: list[str]) -> dict[str, Any]:
    """Blobs in a list and in a dict beside plain values; 65 more in a list too long to open."""
    return {"list": [x[0].encode(), x[1].encode()], "nested": {"k": x[2].encode()}, "n": len(x),
            "many": [b"m"] * 65}


async def byte_frames(x: list[str]) -> AsyncIterator[bytes]:
    for item in x:
        yield item.encode()
