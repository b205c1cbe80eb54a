"""Node functions and helpers for the role-worker tests, named as `tests.integration.workerfns:NAME`.

These run inside real worker processes, so they cannot share memory with the test: they
report through marker files in a directory the test gives them as the `dir` param.

    started-<pid>     the node began executing in worker process <pid>
    cancelled-<pid>   the node's coroutine saw CancelledError in worker process <pid>
    release           written by the test: a held node may finish

`python -m tests.integration.workerfns parent ARGS...` is an intermediate parent: it
spawns `python -m engine.worker ARGS... --parent-pid <its own pid>` with its standard
output inherited (so the READY line reaches the test) and then waits to be killed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from engine.data import framed
from engine.data.codec import WireCodec
from engine.data.curve import PlaneKeys, connect_as_client
from engine.data.wire import (
    PROTOCOL_VERSION,
    ExecuteRequest,
    HelloReply,
    HelloRequest,
    PortValue,
    ValueKind,
    WorkerMessage,
)
from engine.flow.dsl import Workflow
from engine.spec.calls import CallHeader
from engine.spec.graph import GraphSpec

POLL_S = 0.005


def _write(directory: str | Path, name: str, text: str) -> None:
    """Write file `name` atomically (readers never see a half-written file)."""
    path = Path(directory)
    tmp = path / f".{name}.tmp"
    tmp.write_text(text)
    tmp.rename(path / name)


def mark(directory: str | Path, name: str) -> None:
    """Create marker `name`."""
    _write(directory, name, str(time.time()))


def markers(directory: str | Path, prefix: str) -> list[int]:
    """Pids of the `<prefix>-<pid>` markers in `directory`."""
    return sorted(int(p.name.rsplit("-", 1)[1]) for p in Path(directory).glob(f"{prefix}-*"))


# ------------------------------------------------------------------ node functions
def count(directory: str | Path, name: str, value: int) -> None:
    """Set counter `name`."""
    _write(directory, name, str(value))


def counted(directory: str | Path, name: str) -> int:
    path = Path(directory) / name
    return int(path.read_text()) if path.exists() else 0


def frozen(x: Any) -> int:
    """How many objects the worker process froze out of the garbage collector's passes."""
    import gc

    return gc.get_freeze_count()


def noop(x: Any) -> Any:
    return x


def touch(x: Any, dir: str) -> Any:
    """Mark `executed-<pid>`: the node ran."""
    mark(dir, f"executed-{os.getpid()}")
    return x


def whoami(x: Any) -> dict[str, Any]:
    """The input and the pid of the worker process that ran the node."""
    return {"x": x, "pid": os.getpid()}


async def hold(x: Any, dir: str) -> dict[str, Any]:
    """Mark `started-<pid>`, then wait for the test's `release` marker. When another worker
    already started this node (so this is a retry after that worker died), return at once.
    On cancellation mark `cancelled-<pid>`."""
    pid = os.getpid()
    earlier = [p for p in markers(dir, "started") if p != pid]
    mark(dir, f"started-{pid}")
    try:
        # The worker is a separate process: a file is the only thing it shares with the test.
        while not earlier and not (Path(dir) / "release").exists():
            await asyncio.sleep(POLL_S)
    except asyncio.CancelledError:
        mark(dir, f"cancelled-{pid}")
        raise
    return {"x": x, "pid": pid}


async def block_loop(x: Any, seconds: float) -> Any:
    """A node with a bug: it blocks its worker's event loop (a blocking call in an async op)."""
    time.sleep(seconds)
    return x


def die(x: Any) -> Any:
    """A poison input: the worker that runs this node dies."""
    os.kill(os.getpid(), signal.SIGKILL)
    return x


async def gated_power(x: int, dir: str, power: int) -> int:
    """`x ** power`, once the test's `release` marker exists."""
    while not (Path(dir) / "release").exists():
        await asyncio.sleep(POLL_S)
    return x**power


async def counted_frames(n: int, dir: str, gate: str | None = None) -> AsyncIterator[int]:
    """Yields 0..n-1; counter `produced`: the frames made so far. With `gate`, it waits for
    that marker after its first frame, and never again."""
    for i in range(n):
        count(dir, "produced", i + 1)
        yield i
        if gate is not None and i == 0:
            await wait_until(lambda: (Path(dir) / gate).exists(), 10.0, f"marker {gate}", interval=POLL_S)


async def lagging_reader(items: AsyncIterator[int], dir: str, n: int, ahead: int) -> dict[str, int]:
    """Reads the frames of `counted_frames(n, dir)` in another worker, letting it get `ahead`
    frames ahead before taking the next: returns how far ahead it was at most."""
    frames = lead = 0
    async for i in items:
        await wait_until(lambda i=i: counted(dir, "produced") >= min(n, i + 1 + ahead), 10.0,
                         f"the producer makes frame {i + ahead}", interval=POLL_S)
        lead = max(lead, counted(dir, "produced") - i - 1)
        frames += 1
    return {"count": frames, "max_lead": lead}


def make_tensor(seed: int, n: int) -> Any:
    """`n` float32 normals from a seeded generator (the test recomputes them locally)."""
    import torch

    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def make_bf16(seed: int, n: int) -> Any:
    import torch

    return make_tensor(seed, n).to(torch.bfloat16)


def inspect_tensor(t: Any, b: Any) -> dict[str, Any]:
    """What arrived (sha256 of the raw bytes, dtype, type) and a tensor computed from it."""
    import torch

    return {
        "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest(),
        "bf16_sha256": hashlib.sha256(b.view(torch.uint8).numpy().tobytes()).hexdigest(),
        "kind": f"{type(t).__module__}.{type(t).__name__}:{t.dtype}:{b.dtype}",
        "doubled": t * 2,
    }


# ------------------------------------------------------------------ test helpers
def whoami_spec() -> GraphSpec:
    """x -> whoami -> out, on one role `py`."""
    wf = Workflow("whoami")
    py = wf.role("py", kind="python")
    x = wf.input("x", default=0)
    node = wf.python(whoami, role=py)
    wf.edge(x, node)
    wf.output("out", node)
    return wf.to_spec()


async def wait_until(predicate: Callable[[], Any | Awaitable[Any]], timeout: float, what: str,
                     interval: float = 0.01) -> Any:
    """Poll `predicate` (sync or async) until it returns something truthy; return it.
    Raises AssertionError naming `what` when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(interval)


class RawClient:
    """A bare DEALER on a worker's control endpoint: what the dispatcher does, by hand."""

    def __init__(self, context: zmq.asyncio.Context, address: str, keys: PlaneKeys | None = None) -> None:
        """`keys`: the worker plane's keys (a CURVE client); None: a plaintext peer."""
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        connect_as_client(self.sock, keys)
        self.sock.connect(address)
        self.codec = WireCodec(1 << 30, WorkerMessage)

    async def send(self, message: Any) -> None:
        """Send a message, or raw bytes as they are."""
        await self.sock.send(message if isinstance(message, bytes) else self.codec.encode(message))

    async def call(self, message: Any, timeout: float = 5.0) -> Any:
        await self.send(message)
        return await self.recv(timeout)

    async def recv(self, timeout: float = 5.0) -> Any:
        return self.codec.decode(await asyncio.wait_for(self.sock.recv(), timeout))

    async def hello(self) -> Any:
        reply = await self.call(HelloRequest(PROTOCOL_VERSION, "test", "127.0.0.1"))
        assert isinstance(reply, HelloReply), reply
        return reply

    def close(self) -> None:
        self.sock.close()


class LocalClient:
    """A framed stream on a worker's local socket (`engine.data.framed`): what a dispatcher in
    the same network namespace does, by hand. Same calls as `RawClient`."""

    def __init__(self) -> None:
        self.codec = WireCodec(1 << 30, WorkerMessage)
        self.received: asyncio.Queue[bytes] = asyncio.Queue()
        self.ended = asyncio.Event()
        self.stream = framed.FramedStream(self.received.put_nowait, max_message_bytes=1 << 30,
                                          on_closed=lambda reason: self.ended.set())

    @classmethod
    async def connect(cls, address: str) -> LocalClient:
        client = cls()
        await framed.connect(address, client.stream, timeout_s=5.0)
        return client

    async def send(self, message: Any) -> None:
        """Send a message, or raw bytes as they are."""
        await self.stream.send(message if isinstance(message, bytes) else self.codec.encode(message))

    async def call(self, message: Any, timeout: float = 5.0) -> Any:
        await self.send(message)
        return await self.recv(timeout)

    async def recv(self, timeout: float = 5.0) -> Any:
        async with asyncio.timeout(timeout):
            return self.codec.decode(await self.received.get())

    async def hello(self) -> Any:
        reply = await self.call(HelloRequest(PROTOCOL_VERSION, "test", "127.0.0.1"))
        assert isinstance(reply, HelloReply), reply
        return reply

    def close(self) -> None:
        self.stream.close()


def whoami_request(request_id: int, role: str = "py", x: Any = None) -> ExecuteRequest:
    """An ExecuteRequest for `whoami` with input `x` (default: the request id)."""
    return ExecuteRequest(request_id, role, CallHeader("raw", "whoami", f"{__name__}:whoami", {}, ("out",), False,
                                                       False, 1, 1),
                          {"x": PortValue(ValueKind.INLINE, data=request_id if x is None else x)})


def _parent(args: list[str]) -> int:
    worker = subprocess.Popen([sys.executable, "-m", "engine.worker", *args, "--parent-pid", str(os.getpid())])
    print(f"CHILD {worker.pid}", flush=True)
    return worker.wait()


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "parent":
        sys.exit("usage: python -m tests.integration.workerfns parent WORKER-ARGS...")
    sys.exit(_parent(sys.argv[2:]))


def whoami_in(x: Any, session: str | None = None) -> dict[str, Any]:
    """`whoami` for a call that may carry a session param."""
    return {"x": x, "pid": os.getpid(), "session": session}
