"""The role worker's wire protocol, spoken by hand to a real worker process, and the
dispatcher against peers that never answer.

One worker (`python -m engine.worker`, role `py`) serves the whole module; every test opens
its own connections, so each starts from an unhandshaken connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from engine.data import framed
from engine.data.codec import MiB, WireCodec
from engine.data.curve import PlaneKeys, connect_as_client
from engine.data.peer import Peer, PeerConfig
from engine.data.shm import local_namespace
from engine.data.wire import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    ExecuteFrame,
    ExecuteRequest,
    ExecuteResult,
    ExecuteStarted,
    FrameCredit,
    HelloReply,
    HelloRequest,
    InputCredit,
    InputEnd,
    InputFrame,
    LoadReply,
    LoadRequest,
    PingReply,
    PingRequest,
    PortValue,
    ValueKind,
    WorkerMessage,
)
from engine.flow.discovery import InProcessRegistry, WorkerInfo
from engine.flow.remote import WorkerDispatcher, WorkerLost
from engine.spec.calls import CallHeader, NodeCall, NodeContext
from engine.spec.graph import RoleSpec, encode_spec
from engine.worker.announce import READY_PREFIX, REFUSED_METRIC
from tests.integration import workerfns
from tests.integration.workerfns import (
    LocalClient,
    RawClient,
    markers,
    wait_until,
    whoami_request,
    whoami_spec,
)

REPO = Path(__file__).resolve().parents[2]
CONTROL_LIMIT = 64 * MiB
"""The worker's default max message bytes (ZeroMQ MAXMSGSIZE on its control socket)."""


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real worker of role `py`; its READY details."""
    spec_path = tmp_path_factory.mktemp("protocol") / "whoami.json"
    spec_path.write_bytes(encode_spec(whoami_spec()))
    keys = PlaneKeys.generate()
    keys_dir = keys.write(spec_path.parent / "keys")
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.worker", "--role", "py", "--workflow", str(spec_path),
         "--heartbeat", "0.2", "--registry-ttl", "0.8", "--drain-timeout", "5", "--keys", str(keys_dir)],
        stdout=subprocess.PIPE, cwd=REPO,
    )
    try:
        assert process.stdout is not None
        details = None
        deadline = time.monotonic() + 30
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            while details is None:
                assert selector.select(max(0.0, deadline - time.monotonic())), "worker not ready within 30 s"
                line = process.stdout.readline().decode()
                assert line, f"worker exited with status {process.wait()} before it was ready"
                if line.startswith(READY_PREFIX):
                    details = json.loads(line[len(READY_PREFIX):])
        yield {**details, "keys": keys}
        assert process.poll() is None, "the worker died during the protocol tests"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def client(context: zmq.asyncio.Context, worker: dict[str, Any]) -> RawClient:
    return RawClient(context, worker["address"], worker["keys"])


@pytest.fixture(params=["tcp", "local"])
async def open_client(request, context, worker) -> AsyncIterator[Callable[[], Awaitable[RawClient | LocalClient]]]:
    """Opens connections to the worker's control endpoint: its ZeroMQ ROUTER over TCP, or its
    abstract Unix socket (a framed stream). Both speak the same protocol."""
    opened: list[RawClient | LocalClient] = []

    async def open_() -> RawClient | LocalClient:
        if request.param == "tcp":
            raw: RawClient | LocalClient = RawClient(context, worker["address"], worker["keys"])
        else:
            if local_namespace() is None:
                pytest.skip("abstract Unix sockets are Linux-only")
            raw = await LocalClient.connect(worker["local"])
        opened.append(raw)
        return raw

    yield open_
    for raw in opened:
        raw.close()


async def execute_ok(raw: RawClient | LocalClient, request_id: int, worker: dict[str, Any]) -> None:
    """A normal execution on `raw` (already greeted): ExecuteStarted, then the result (`whoami`
    is a plain function: it runs in the unit's thread pool, so the node suspends and is announced)."""
    assert await raw.call(whoami_request(request_id)) == ExecuteStarted(request_id, worker["worker_id"])
    result = await raw.recv()
    assert result == ExecuteResult(request_id, {"out": PortValue(ValueKind.INLINE,
                                                                 data={"x": request_id, "pid": worker["pid"]})})


def refused(reply: Any, code: ErrorCode, request_id: int | None) -> None:
    assert isinstance(reply, ErrorReply), reply
    assert (reply.code, reply.request_id) == (code, request_id), reply


# ------------------------------------------------------------------ handshake
async def test_hello_then_execute(open_client, worker):
    raw = await open_client()
    reply = await raw.hello()
    assert reply.protocol_version == PROTOCOL_VERSION
    assert reply.server == worker["worker_id"]
    assert reply.max_request_bytes == CONTROL_LIMIT
    await execute_ok(raw, 1, worker)
    assert await raw.call(PingRequest(7)) == PingReply(7)


async def test_a_ready_worker_has_frozen_what_it_loaded_out_of_the_collectors_passes(open_client, worker):
    """Full collector passes over torch's objects take about 150 ms: a worker freezes what it has
    loaded (its unit, the model code) before it says it is ready, so none lands inside a call."""
    raw = await open_client()
    await raw.hello()
    request = whoami_request(3)
    request = msgspec.structs.replace(request, call=msgspec.structs.replace(
        request.call, op=f"{workerfns.__name__}:frozen"))
    assert await raw.call(request) == ExecuteStarted(3, worker["worker_id"])
    result = await raw.recv()
    assert isinstance(result, ExecuteResult) and result.outputs["out"].data > 10_000, result


async def test_request_before_hello_is_refused(open_client, worker):
    raw = await open_client()
    refused(await raw.call(whoami_request(5)), ErrorCode.HANDSHAKE_REQUIRED, 5)
    refused(await raw.call(PingRequest(6)), ErrorCode.HANDSHAKE_REQUIRED, 6)
    await raw.hello()
    await execute_ok(raw, 7, worker)


async def test_wrong_protocol_version_is_refused(open_client, worker):
    raw = await open_client()
    refused(await raw.call(HelloRequest(PROTOCOL_VERSION + 1, "future", "127.0.0.1")),
            ErrorCode.VERSION_MISMATCH, None)
    # The refused hello did not open the connection.
    refused(await raw.call(whoami_request(1)), ErrorCode.HANDSHAKE_REQUIRED, 1)
    await raw.hello()
    await execute_ok(raw, 2, worker)


# ------------------------------------------------------------------ bad input
async def test_garbage_is_malformed_and_the_connection_carries_on(open_client, worker):
    raw = await open_client()
    await raw.hello()
    refused(await raw.call(b"\xc1 not msgpack \xff"), ErrorCode.MALFORMED, None)
    refused(await raw.call(msgspec.msgpack.encode(42)), ErrorCode.MALFORMED, None)
    refused(await raw.call(msgspec.msgpack.encode({"type": "ExecuteRequest", "request_id": "x"})),
            ErrorCode.MALFORMED, None)
    if isinstance(raw, RawClient):
        await raw.sock.send_multipart([b"one", b"two"])
        refused(await raw.recv(), ErrorCode.MALFORMED, None)
    await execute_ok(raw, 3, worker)


async def test_unknown_message_type(open_client, worker):
    raw = await open_client()
    await raw.hello()
    refused(await raw.call(msgspec.msgpack.encode({"type": "TeleportRequest", "request_id": 1})),
            ErrorCode.UNKNOWN_MESSAGE, None)
    await execute_ok(raw, 4, worker)


async def test_execute_for_another_role_is_refused(open_client, worker):
    raw = await open_client()
    await raw.hello()
    reply = await raw.call(whoami_request(8, role="llm"))
    refused(reply, ErrorCode.WRONG_ROLE, 8)
    assert "'py'" in reply.message and "'llm'" in reply.message
    await execute_ok(raw, 9, worker)


async def test_request_id_already_running_is_refused(open_client, worker, tmp_path: Path):
    raw = await open_client()
    await raw.hello()
    hold = ExecuteRequest(11, "py", CallHeader("raw", "hold", f"{workerfns.__name__}:hold", {"dir": str(tmp_path)},
                                               ("out",), False, False, 1, 1), {"x": PortValue(ValueKind.INLINE, data=1)})
    assert isinstance(await raw.call(hold), ExecuteStarted)
    refused(await raw.call(hold), ErrorCode.BAD_REQUEST, 11)
    workerfns.mark(tmp_path, "release")
    result = await raw.recv()
    assert isinstance(result, ExecuteResult) and result.request_id == 11
    assert markers(tmp_path, "started") == [worker["pid"]]


# ------------------------------------------------------------------ stream credit
async def frames_until(raw: RawClient | LocalClient, count: int) -> list[ExecuteFrame]:
    """The next `count` output frames (announcements skipped)."""
    frames: list[ExecuteFrame] = []
    while len(frames) < count:
        message = await raw.recv()
        if not isinstance(message, ExecuteStarted):
            assert isinstance(message, ExecuteFrame), message
            frames.append(message)
    return frames


async def test_a_stream_node_sends_frames_only_as_credit_allows(open_client, worker, tmp_path: Path):
    raw = await open_client()
    await raw.hello()
    await raw.send(ExecuteRequest(41, "py", CallHeader("raw", "frames", f"{workerfns.__name__}:counted_frames",
                                                       {"n": 10, "dir": str(tmp_path)}, ("out",), True, False, 1, 1),
                                  {}, window=2))
    assert [f.index for f in await frames_until(raw, 2)] == [0, 1]
    # The generator made frame 2 and waits with it: no later frame exists before credit comes.
    await wait_until(lambda: workerfns.counted(tmp_path, "produced") == 3, 10.0, "the producer makes frame 2")
    await raw.send(FrameCredit(41, 3))
    assert [f.index for f in await frames_until(raw, 3)] == [2, 3, 4]
    assert workerfns.counted(tmp_path, "produced") <= 6
    await raw.send(FrameCredit(41, 100))
    rest = await frames_until(raw, 5)
    assert [(f.index, f.outputs["out"].data) for f in rest] == [(i, i) for i in range(5, 10)]
    assert await raw.recv() == ExecuteResult(41, {})


async def test_a_worker_credits_stream_input_frames_as_its_node_reads_them(open_client, worker):
    raw = await open_client()
    await raw.hello()
    await raw.send(ExecuteRequest(42, "py", CallHeader("raw", "read", "tests.unit.flow.fns:consume_all", {},
                                                       ("out",), False, False, 1, 1),
                                  {"items": PortValue(ValueKind.STREAM)}, window=2))
    for i in range(2):
        await raw.send(InputFrame(42, "items", PortValue(ValueKind.INLINE, data=i)))
    credits = 0
    while credits < 2:  # a window of 2 is credited frame by frame
        message = await raw.recv()
        if isinstance(message, InputCredit):
            assert (message.request_id, message.port, message.frames) == (42, "items", 1)
            credits += message.frames
        else:
            assert isinstance(message, ExecuteStarted), message
    await raw.send(InputFrame(42, "items", PortValue(ValueKind.INLINE, data=2)))
    await raw.send(InputEnd(42, "items"))
    messages = [await raw.recv()]
    while not isinstance(messages[-1], ExecuteResult):
        messages.append(await raw.recv())
    assert [m for m in messages if not isinstance(m, ExecuteStarted)] == [InputCredit(42, "items", 1),
                        ExecuteResult(42, {"out": PortValue(ValueKind.INLINE, data=[0, 1, 2])})]


async def test_bad_windows_and_stray_credits_are_refused_or_ignored(open_client, worker):
    raw = await open_client()
    await raw.hello()
    bad = ExecuteRequest(43, "py", CallHeader("raw", "frames", f"{workerfns.__name__}:counted_frames",
                                              {"n": 1, "dir": "."}, ("out",), True, False, 1, 1), {}, window=-1)
    reply = await raw.call(bad)
    refused(reply, ErrorCode.BAD_REQUEST, 43)
    assert reply.message == "request 43: window must be 0 (no limit) or more, not -1"
    await raw.send(FrameCredit(999, 5))  # for no execution of this connection: nothing to credit
    reply = await raw.call(InputCredit(44, "items", 1))  # the executor's to receive, not the worker's
    refused(reply, ErrorCode.BAD_REQUEST, 44)
    assert reply.message == "a worker does not serve InputCredit"
    await execute_ok(raw, 45, worker)


async def test_oversized_frame_drops_that_connection_only(context, worker):
    steady = client(context, worker)
    await steady.hello()
    big = client(context, worker)
    await big.hello()
    monitor = big.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        await big.send(bytes(CONTROL_LIMIT + 1))
        event = await asyncio.wait_for(recv_monitor_message(monitor), 10)
        assert event["event"] == zmq.EVENT_DISCONNECTED
    finally:
        big.sock.disable_monitor()
        monitor.close()
    # Other clients are served as before, and a new connection works.
    await execute_ok(steady, 21, worker)
    fresh = client(context, worker)
    await fresh.hello()
    await execute_ok(fresh, 22, worker)


async def test_liveness_endpoint_answers_pings_only(context, worker):
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    connect_as_client(sock, worker["keys"])
    sock.connect(worker["liveness"])
    codec = WireCodec(64 * 1024, WorkerMessage)

    async def call(payload: bytes) -> Any:
        await sock.send(payload)
        return codec.decode(await asyncio.wait_for(sock.recv(), 5))

    assert await call(codec.encode(PingRequest(3))) == PingReply(3)
    refused(await call(b"\xc1"), ErrorCode.MALFORMED, None)
    refused(await call(codec.encode(whoami_request(4))), ErrorCode.BAD_REQUEST, None)
    assert await call(codec.encode(PingRequest(5))) == PingReply(5)


# ------------------------------------------------------------------ peers that never answer
ROLE = RoleSpec(name="py", kind="python")
HB = 0.2


def call_for(node: str) -> tuple[NodeCall, NodeContext]:
    call = NodeCall(run_id="r1", node_id=node, op=f"{workerfns.__name__}:noop", params={}, inputs={"x": 1},
                    output_ports=("out",), stream=False, router=False, iteration=1, attempt=1)
    return call, NodeContext("r1", node, 1, 1, lambda f, m: None)


async def fake_worker(context: zmq.asyncio.Context, registry: InProcessRegistry, worker_id: str
                      ) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """Bound ROUTERs registered as a worker of role `py`; nothing reads them unless the test does."""
    control = context.socket(zmq.ROUTER)
    liveness = context.socket(zmq.ROUTER)
    for sock in (control, liveness):
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:0")
    await registry.register(WorkerInfo(
        worker_id, "py", control.getsockopt_string(zmq.LAST_ENDPOINT),
        meta={"liveness": liveness.getsockopt_string(zmq.LAST_ENDPOINT)},
    ))
    return control, liveness


async def test_silent_peer_is_lost_within_the_connect_timeout(context):
    registry = InProcessRegistry(ttl_s=float("inf"))
    await fake_worker(context, registry, "silent-1")
    with Peer.start() as peer:
        dispatcher = WorkerDispatcher(registry, peer, heartbeat_s=HB, connect_timeout_s=1.0, no_worker_wait_s=0.5)
        try:
            call, ctx = call_for("never")
            t0 = time.monotonic()
            with pytest.raises(WorkerLost) as caught:
                await asyncio.wait_for(dispatcher.execute(ROLE, call, ctx, lambda ran_on: None), 10)
            assert time.monotonic() - t0 < 1.0 + 1.0
            assert "silent-1" in str(caught.value) and "'never'" in str(caught.value)
        finally:
            await dispatcher.close()


async def test_peer_that_stops_answering_after_hello_is_lost(context):
    """It answers the hello, then neither the execution nor pings: lost after two heartbeats."""
    registry = InProcessRegistry(ttl_s=float("inf"))
    control, _ = await fake_worker(context, registry, "mute-1")
    received: list[str] = []
    server = asyncio.create_task(answer_hello_only(control, "mute-1", received))
    with Peer.start() as peer:
        dispatcher = WorkerDispatcher(registry, peer, heartbeat_s=HB, connect_timeout_s=1.0, no_worker_wait_s=0.5)
        try:
            call, ctx = call_for("muted")
            t0 = time.monotonic()
            with pytest.raises(WorkerLost) as caught:
                await asyncio.wait_for(dispatcher.execute(ROLE, call, ctx, lambda ran_on: None), 10)
            elapsed = time.monotonic() - t0
            assert elapsed < 3 * HB + 0.5, elapsed
            assert "mute-1" in str(caught.value) and "'muted'" in str(caught.value)
            await wait_until(lambda: "ExecuteRequest" in received, 5, "the fake worker got the request")
            assert received[:2] == ["HelloRequest", "ExecuteRequest"]
            # The lost worker's sockets are closed (its liveness socket would keep reconnecting).
            lost = dispatcher._connections.by_worker["mute-1"]
            await wait_until(lambda: lost.liveness.closed, 5, "the lost worker's liveness socket closed")
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
            await dispatcher.close()


LINUX_ONLY = pytest.mark.skipif(local_namespace() is None, reason="abstract Unix sockets are Linux-only")


@LINUX_ONLY
@pytest.mark.parametrize("same_namespace", [True, False])
async def test_dispatcher_uses_the_local_socket_only_within_one_network_namespace(context, same_namespace: bool):
    """A worker advertises an abstract Unix socket with its namespace: an executor in the same
    namespace connects there, any other over TCP (seen by which endpoint gets the hello)."""
    registry = InProcessRegistry(ttl_s=float("inf"))
    tcp, liveness = (context.socket(zmq.ROUTER) for _ in range(2))
    for sock in (tcp, liveness):
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:0")
    local_address = framed.local_address(f"omniflow-test-{os.getpid()}-{time.monotonic_ns()}")
    local_hellos: asyncio.Queue[bytes] = asyncio.Queue()
    accepted: list[framed.FramedStream] = []

    def accept() -> framed.FramedStream:
        accepted.append(framed.FramedStream(local_hellos.put_nowait, max_message_bytes=CONTROL_LIMIT))
        return accepted[-1]

    server = await framed.listen(local_address, accept)
    namespace = local_namespace() if same_namespace else "another-host/net:1"
    await registry.register(WorkerInfo(
        "ns-1", "py", tcp.getsockopt_string(zmq.LAST_ENDPOINT),
        meta={"liveness": liveness.getsockopt_string(zmq.LAST_ENDPOINT), "local": local_address,
              "local_ns": namespace},
    ))
    codec = WireCodec(CONTROL_LIMIT, WorkerMessage)
    with Peer.start() as peer:
        dispatcher = WorkerDispatcher(registry, peer, heartbeat_s=HB, connect_timeout_s=5.0, no_worker_wait_s=0.5)
        call = asyncio.create_task(dispatcher.execute(ROLE, *call_for("where"), lambda ran_on: None))
        try:
            async with asyncio.timeout(5):
                if same_namespace:
                    payload = await local_hellos.get()
                else:
                    _, payload = await tcp.recv_multipart()
            assert isinstance(codec.decode(payload), HelloRequest)
            if same_namespace:
                assert not await tcp.poll(timeout=0)
            else:
                assert local_hellos.empty() and not accepted
        finally:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            await dispatcher.close()
            for stream in accepted:
                stream.close()
            server.close()
            for sock in (tcp, liveness):
                sock.close()


@LINUX_ONLY
async def test_a_worker_advertises_its_abstract_unix_socket(worker):
    assert worker["local_ns"] == local_namespace() and worker["local"].startswith(framed.SCHEME)


@LINUX_ONLY
async def test_oversized_message_on_the_local_socket_is_refused_and_ends_that_connection_only(worker):
    steady = await LocalClient.connect(worker["local"])
    big = await LocalClient.connect(worker["local"])
    try:
        await steady.hello()
        await big.hello()
        # A header announcing more than the worker takes: answered, then the connection ends
        # without the worker waiting for (or reading) the announced bytes.
        transport = big.stream._transport
        assert transport is not None
        transport.write(struct.pack("<I", CONTROL_LIMIT + 1) + b"\x00" * 16)
        refused(await big.recv(), ErrorCode.OVERSIZED, None)
        async with asyncio.timeout(5):
            await big.ended.wait()
        await execute_ok(steady, 23, worker)
    finally:
        steady.close()
        big.close()
    fresh = await LocalClient.connect(worker["local"])
    try:
        await fresh.hello()
        await execute_ok(fresh, 24, worker)
    finally:
        fresh.close()


@LINUX_ONLY
async def test_an_executor_that_disconnects_cancels_its_executions(worker, tmp_path: Path):
    """On the local socket the worker sees its caller go (ZeroMQ hides that): what the caller
    started is cancelled, since nobody is left to take the answer."""
    raw = await LocalClient.connect(worker["local"])
    await raw.hello()
    hold = ExecuteRequest(31, "py", CallHeader("raw", "hold", f"{workerfns.__name__}:hold", {"dir": str(tmp_path)},
                                               ("out",), False, False, 1, 1), {"x": PortValue(ValueKind.INLINE, data=1)})
    assert isinstance(await raw.call(hold), ExecuteStarted)
    await wait_until(lambda: markers(tmp_path, "started") == [worker["pid"]], 5, "the node started")
    raw.close()
    await wait_until(lambda: markers(tmp_path, "cancelled") == [worker["pid"]], 5, "the node was cancelled")


async def answer_hello_only(control: zmq.asyncio.Socket, worker_id: str, received: list[str]) -> None:
    """Serve a fake worker's control socket: answer the hello, then nothing."""
    codec = WireCodec(CONTROL_LIMIT, WorkerMessage)
    while True:
        identity, payload = await control.recv_multipart()
        message = codec.decode(payload)
        received.append(type(message).__name__)
        if isinstance(message, HelloRequest):
            await control.send_multipart([identity, codec.encode(
                HelloReply(PROTOCOL_VERSION, worker_id, "127.0.0.1", 0, CONTROL_LIMIT))])


def held_call(tmp_path: Path) -> tuple[NodeCall, NodeContext]:
    call = NodeCall(run_id="r1", node_id="held", op=f"{workerfns.__name__}:hold", params={"dir": str(tmp_path)},
                    inputs={"x": 1}, output_ports=("out",), stream=False, router=False, iteration=1, attempt=1)
    return call, NodeContext("r1", "held", 1, 1, lambda f, m: None)


@LINUX_ONLY
async def test_the_dispatcher_stops_polling_at_the_first_answer(worker, tmp_path: Path):
    """After a send the dispatcher keeps its loop polling, so a quick answer is read as it
    lands instead of after a wake-up; once the worker answered (here: ExecuteStarted) it
    sleeps again, even with a long window: a node that runs costs the executor no CPU.
    Seen as this process's CPU time while the node is held."""
    registry = InProcessRegistry(ttl_s=float("inf"))
    await registry.register(WorkerInfo(
        worker["worker_id"], "py", worker["address"], pid=worker["pid"],
        meta={k: worker[k] for k in ("liveness", "local", "local_ns")},
    ))
    held_s = 0.6
    with Peer.start(PeerConfig(keys=worker["keys"])) as peer:
        dispatcher = WorkerDispatcher(registry, peer, heartbeat_s=HB, poll_after_send_s=30.0)
        asyncio.get_running_loop().call_later(held_s, workerfns.mark, tmp_path, "release")
        cpu0, wall0 = time.process_time(), time.monotonic()
        try:
            result = await dispatcher.execute(ROLE, *held_call(tmp_path), lambda ran_on: None)
        finally:
            await dispatcher.close()
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert result.outputs["out"]["pid"] == worker["pid"]
    assert wall >= held_s and cpu < 0.25 * wall, (cpu, wall)


@pytest.mark.parametrize("window_s", [0.02, 30.0])
async def test_polling_for_an_answer_that_does_not_come_ends_with_the_window(context, window_s: float):
    """A worker that never answers the request: the dispatcher polls for `poll_after_send_s`,
    then sleeps until the worker is declared lost (two heartbeats)."""
    registry = InProcessRegistry(ttl_s=float("inf"))
    control, _ = await fake_worker(context, registry, "mute-2")
    server = asyncio.create_task(answer_hello_only(control, "mute-2", []))
    with Peer.start() as peer:
        dispatcher = WorkerDispatcher(registry, peer, heartbeat_s=HB, connect_timeout_s=1.0, no_worker_wait_s=0.5,
                                      poll_after_send_s=window_s)
        cpu0, wall0 = time.process_time(), time.monotonic()
        try:
            with pytest.raises(WorkerLost):
                await dispatcher.execute(ROLE, *call_for("muted"), lambda ran_on: None)
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
            await dispatcher.close()
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    if window_s < wall:
        assert cpu < 0.25 * wall, (cpu, wall)
    else:  # the whole wait was inside the window: the loop polled all along
        assert cpu > 0.3 * wall, (cpu, wall)


async def test_a_connection_attempt_cancelled_midway_is_withdrawn_not_left_hanging(context):
    """Call A connects and waits for the hello, call B waits on A's attempt; A is cancelled.
    B must not wait forever on an attempt nobody finishes: it connects afresh and completes."""
    registry = InProcessRegistry(ttl_s=float("inf"))
    control, _ = await fake_worker(context, registry, "slow-1")
    codec = WireCodec(CONTROL_LIMIT, WorkerMessage)
    hellos: list[bytes] = []

    async def serve() -> None:
        while True:
            identity, payload = await control.recv_multipart()
            message = codec.decode(payload)
            if isinstance(message, HelloRequest):
                hellos.append(identity)
                if len(hellos) == 1:
                    continue  # the first attempt gets no answer
                reply: Any = HelloReply(PROTOCOL_VERSION, "slow-1", "127.0.0.1", 0, CONTROL_LIMIT)
            else:
                assert isinstance(message, ExecuteRequest)
                reply = ExecuteResult(message.request_id, {"out": PortValue(ValueKind.INLINE, data="done")})
            await control.send_multipart([identity, codec.encode(reply)])

    server = asyncio.create_task(serve())
    with Peer.start() as peer:
        dispatcher = WorkerDispatcher(registry, peer, heartbeat_s=HB, connect_timeout_s=30.0)
        try:
            first = asyncio.create_task(dispatcher.execute(ROLE, *call_for("a"), lambda ran_on: None))
            await wait_until(lambda: len(hellos) == 1, 5, "the first hello")
            second = asyncio.create_task(dispatcher.execute(ROLE, *call_for("b"), lambda ran_on: None))
            await asyncio.sleep(0)  # B finds A's attempt and waits on it
            first.cancel()
            async with asyncio.timeout(10):
                result = await second
            assert result.outputs == {"out": "done"}
            assert len(hellos) == 2  # B connected afresh
            with pytest.raises(asyncio.CancelledError):
                await first
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
            await dispatcher.close()


@LINUX_ONLY
async def test_a_local_address_of_an_unknown_kind_is_not_used(context):
    """A worker of an older version advertised `ipc://@...` as its local socket: the dispatcher
    only dials `unix:@` streams there, so it goes over TCP instead of failing."""
    registry = InProcessRegistry(ttl_s=float("inf"))
    tcp, liveness = (context.socket(zmq.ROUTER) for _ in range(2))
    for sock in (tcp, liveness):
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:0")
    await registry.register(WorkerInfo(
        "old-1", "py", tcp.getsockopt_string(zmq.LAST_ENDPOINT),
        meta={"liveness": liveness.getsockopt_string(zmq.LAST_ENDPOINT), "local": "ipc://@omniflow-old",
              "local_ns": local_namespace()},
    ))
    codec = WireCodec(CONTROL_LIMIT, WorkerMessage)
    with Peer.start() as peer:
        dispatcher = WorkerDispatcher(registry, peer, heartbeat_s=HB, connect_timeout_s=5.0)
        call = asyncio.create_task(dispatcher.execute(ROLE, *call_for("where"), lambda ran_on: None))
        try:
            async with asyncio.timeout(5):
                _, payload = await tcp.recv_multipart()
            assert isinstance(codec.decode(payload), HelloRequest)
        finally:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            await dispatcher.close()
            for sock in (tcp, liveness):
                sock.close()


@LINUX_ONLY
async def test_closing_the_dispatcher_ends_the_calls_it_carries(worker, tmp_path: Path):
    """A call in flight when its dispatcher closes fails with WorkerLost at once instead of
    waiting for an answer nobody will read; the worker sees its caller go and cancels the node."""
    registry = InProcessRegistry(ttl_s=float("inf"))
    await registry.register(WorkerInfo(
        worker["worker_id"], "py", worker["address"], pid=worker["pid"],
        meta={k: worker[k] for k in ("liveness", "local", "local_ns")},
    ))
    with Peer.start(PeerConfig(keys=worker["keys"])) as peer:
        dispatcher = WorkerDispatcher(registry, peer, heartbeat_s=HB)
        call = asyncio.create_task(dispatcher.execute(ROLE, *held_call(tmp_path), lambda ran_on: None))
        await wait_until(lambda: markers(tmp_path, "started") == [worker["pid"]], 5, "the node started")
        await dispatcher.close()
        async with asyncio.timeout(5):
            with pytest.raises(WorkerLost, match="the dispatcher was closed"):
                await call
    await wait_until(lambda: markers(tmp_path, "cancelled") == [worker["pid"]], 5, "the node was cancelled")


@LINUX_ONLY
async def test_calls_blocked_on_a_worker_that_stopped_reading_end_when_the_dispatcher_closes(context):
    """A worker whose loop stopped reading (stuck, but its liveness thread still answers):
    requests back up until sends wait for room. Closing the dispatcher cuts the link, and
    every such call ends with WorkerLost instead of waiting for room forever."""
    registry = InProcessRegistry(ttl_s=float("inf"))
    liveness = context.socket(zmq.ROUTER)
    liveness.setsockopt(zmq.LINGER, 0)
    liveness.bind("tcp://127.0.0.1:0")
    address = framed.local_address(f"omniflow-test-stuck-{os.getpid()}-{time.monotonic_ns()}")
    codec = WireCodec(CONTROL_LIMIT, WorkerMessage)
    accepted: list[framed.FramedStream] = []

    def accept() -> framed.FramedStream:
        def on_message(payload: bytes) -> None:
            message = codec.decode(payload)
            if isinstance(message, HelloRequest):
                stream.send_nowait(codec.encode(HelloReply(PROTOCOL_VERSION, "stuck-1", "127.0.0.1", 0,
                                                           CONTROL_LIMIT)))
                assert stream._transport is not None
                stream._transport.pause_reading()  # the loop stops reading from now on

        stream = framed.FramedStream(on_message, max_message_bytes=CONTROL_LIMIT)
        accepted.append(stream)
        return stream

    server = await framed.listen(address, accept)
    await registry.register(WorkerInfo(
        "stuck-1", "py", "tcp://127.0.0.1:1",
        meta={"liveness": liveness.getsockopt_string(zmq.LAST_ENDPOINT), "local": address,
              "local_ns": local_namespace()},
    ))
    with Peer.start() as peer:
        dispatcher = WorkerDispatcher(registry, peer, heartbeat_s=60.0, connect_timeout_s=5.0)
        big = "x" * 200_000  # inline: a few of these fill the socket's buffers
        calls = []
        try:
            for i in range(64):
                call = NodeCall(run_id="r1", node_id=f"n{i}", op=f"{workerfns.__name__}:noop", params={},
                                inputs={"x": big}, output_ports=("out",), stream=False, router=False,
                                iteration=1, attempt=1)
                ctx = NodeContext("r1", f"n{i}", 1, 1, lambda f, m: None)
                calls.append(asyncio.create_task(dispatcher.execute(ROLE, call, ctx, lambda ran_on: None)))
            await wait_until(lambda: "stuck-1" in dispatcher._connections.by_worker
                             and isinstance(dispatcher._connections.by_worker["stuck-1"].control, framed.FramedStream)
                             and dispatcher._connections.by_worker["stuck-1"].control.paused, 10, "sends waiting for room")
        finally:
            await dispatcher.close()
        async with asyncio.timeout(5):
            results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, WorkerLost) for r in results), [type(r).__name__ for r in results]
    for stream in accepted:
        stream.abort()
    server.close()
    liveness.close()


# ------------------------------------------------------------------ who may use the worker
def touch_request(request_id: int, directory: Path) -> ExecuteRequest:
    """A valid ExecuteRequest for `touch`: it leaves an `executed-<pid>` marker when it runs."""
    return ExecuteRequest(request_id, "py", CallHeader("raw", "touch", f"{workerfns.__name__}:touch",
                                                       {"dir": str(directory)}, ("out",), False, False, 1, 1),
                          {"x": PortValue(ValueKind.INLINE, data=request_id)})


async def refusals(context: zmq.asyncio.Context, worker: dict[str, Any]) -> int:
    """The worker's `plane.refused` metric, asked on its liveness endpoint with the plane's key."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    connect_as_client(sock, worker["keys"])
    sock.connect(worker["liveness"])
    codec = WireCodec(64 * 1024, WorkerMessage)
    try:
        await sock.send(codec.encode(LoadRequest(1)))
        reply = codec.decode(await asyncio.wait_for(sock.recv(), 5))
    finally:
        sock.close()
    assert isinstance(reply, LoadReply), reply
    return int(reply.metrics[REFUSED_METRIC])


def foreign_dealer(context: zmq.asyncio.Context, address: str, keys: PlaneKeys | None,
                   server_key: str) -> zmq.asyncio.Socket:
    """A DEALER of a process without the plane's key: plaintext, or a CURVE keypair of its own
    that knows the worker's public key (public keys are no secret)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys.public.encode(), keys.secret.encode()
        sock.curve_serverkey = server_key.encode()
    sock.connect(address)
    return sock


@pytest.mark.parametrize("foreign_keys", [None, PlaneKeys.generate()], ids=["plaintext", "another-key"])
async def test_a_peer_without_the_plane_key_gets_no_reply_and_no_execution(
    context, worker, tmp_path: Path, foreign_keys: PlaneKeys | None
):
    """A valid hello and ExecuteRequest from a process without the plane's key, on the
    control socket and on the liveness socket: no reply, the node never runs (no marker),
    and the worker counts the refusals. The keyed client's same request runs."""
    codec = WireCodec(CONTROL_LIMIT, WorkerMessage)
    before = await refusals(context, worker)
    # A key not authorised is counted by the ZAP handler, on each socket; a plaintext peer when the
    # worker sees the mechanism mismatch before the peer hangs up (not on every attempt, and a peer
    # may stop trying): until the worker has counted them, the intruder connects afresh.
    expected = before + (2 if foreign_keys is not None else 1)
    deadline = time.monotonic() + 20.0
    while True:
        sockets = [foreign_dealer(context, worker[endpoint], foreign_keys, worker["keys"].public)
                   for endpoint in ("address", "liveness")]
        try:
            for sock in sockets:
                await sock.send(codec.encode(HelloRequest(PROTOCOL_VERSION, "intruder", "127.0.0.1")))
                await sock.send(codec.encode(touch_request(7, tmp_path)))
                await sock.send(codec.encode(PingRequest(8)))
            for sock in sockets:
                assert await sock.poll(300) == 0, "the worker answered a peer without the key"
            assert markers(tmp_path, "executed") == []
        finally:
            for sock in sockets:
                sock.close()
        if await refusals(context, worker) >= expected:
            break
        assert time.monotonic() < deadline, "the worker never counted the refusals"
    keyed = client(context, worker)
    try:
        await keyed.hello()
        await keyed.send(touch_request(9, tmp_path))
        while not isinstance(reply := await keyed.recv(), ExecuteResult):
            assert isinstance(reply, ExecuteStarted), reply
        assert markers(tmp_path, "executed") == [worker["pid"]]
    finally:
        keyed.close()


async def _at_least(count: Awaitable[int], floor: int) -> int:
    value = await count
    return value if value >= floor else 0


@LINUX_ONLY
async def test_a_process_of_another_uid_gets_no_answer_on_the_local_socket(context, worker, tmp_path: Path):
    """The local control socket (no CURVE: an abstract Unix socket) refuses a process of
    another uid before its first message: no hello back, no execution, counted."""
    from tests.foreign_uid import NOBODY, Outcome, call_as

    codec = WireCodec(CONTROL_LIMIT, WorkerMessage)
    before = await refusals(context, worker)
    hello = codec.encode(HelloRequest(PROTOCOL_VERSION, "intruder", "127.0.0.1"))
    reply = await asyncio.to_thread(call_as, NOBODY, worker["local"], hello, 2.0)
    assert reply.outcome is Outcome.CLOSED
    assert await refusals(context, worker) == before + 1
    same_uid = await asyncio.to_thread(call_as, os.getuid(), worker["local"], hello, 5.0)
    assert same_uid.outcome is Outcome.ANSWERED
    assert isinstance(codec.decode(same_uid.data[4:]), HelloReply)
    assert markers(tmp_path, "executed") == []
