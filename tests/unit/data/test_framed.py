"""Framed streams over abstract Unix sockets (real sockets, no mocks): round trips both ways,
parsing under any fragmentation, large messages, the size limit, closing from either end,
refused and malformed addresses, back-pressure, and a failing handler; the socket-level
scenarios run on asyncio's default loop and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import signal
import socket
import struct
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from engine.data.framed import FramedStream, StreamClosedError, connect, listen, local_address

HEADER = struct.Struct("<I")
WAIT_S = 5.0
_names = itertools.count()

Runner = Callable[[Coroutine[Any, Any, None]], None]
LOOPS = [pytest.param(asyncio.run, id="asyncio"), pytest.param(uvloop.run, id="uvloop")]


def fresh_address(tag: str) -> str:
    return local_address(f"omniflow-test-framed-{os.getpid()}-{tag}-{next(_names)}-{uuid.uuid4().hex[:8]}")


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


class Endpoint(FramedStream):
    """A real FramedStream that records what reaches its callbacks, for a test to await."""

    def __init__(
        self,
        *,
        max_message_bytes: int = 4 << 20,
        handle: Callable[[bytes], None] | None = None,
        on_oversized: Callable[[Endpoint, int], None] | None = None,
    ) -> None:
        self.messages: list[bytes] = []
        self.oversized: list[int] = []
        self.closed_reasons: list[str] = []
        self.transport: asyncio.Transport | None = None
        self.made: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._changed = asyncio.Event()
        self._handle = handle
        self._oversized_hook = on_oversized
        super().__init__(
            self._got,
            max_message_bytes=max_message_bytes,
            on_oversized=self._got_oversized,
            on_closed=self._got_closed,
        )

    def _got(self, payload: bytes) -> None:
        self.messages.append(payload)
        self._changed.set()
        if self._handle is not None:
            self._handle(payload)

    def _got_oversized(self, size: int) -> None:
        self.oversized.append(size)
        self._changed.set()
        if self._oversized_hook is not None:
            self._oversized_hook(self, size)

    def _got_closed(self, reason: str) -> None:
        self.closed_reasons.append(reason)
        self._changed.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport
        self.made.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self.lost.done():
            self.lost.set_result(None)
        self._changed.set()

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT_S):
            while not predicate():
                await self._changed.wait()
                self._changed.clear()

    async def receive(self, count: int) -> list[bytes]:
        await self.until(lambda: len(self.messages) >= count)
        return self.messages

    async def wait_lost(self) -> None:
        async with asyncio.timeout(WAIT_S):
            await self.lost


class Harness:
    """Opens listeners, streams and plain sockets, and closes every one of them at the end."""

    def __init__(self) -> None:
        self.streams: list[Endpoint] = []
        self.servers: list[asyncio.Server] = []
        self.sockets: list[socket.socket] = []
        self.accepted: list[Endpoint] = []
        self._accepted_changed = asyncio.Event()

    async def listen(self, **endpoint: Any) -> str:
        address = fresh_address("srv")

        def accept() -> Endpoint:
            stream = Endpoint(**endpoint)
            self.streams.append(stream)
            self.accepted.append(stream)
            self._accepted_changed.set()
            return stream

        self.servers.append(await listen(address, accept))
        return address

    async def connect(self, address: str, **endpoint: Any) -> Endpoint:
        stream = Endpoint(**endpoint)
        self.streams.append(stream)
        returned = await connect(address, stream, timeout_s=WAIT_S)
        assert returned is stream and stream.transport is not None
        return stream

    async def accept(self, index: int = 0) -> Endpoint:
        """The `index`-th stream the listeners accepted, once it is connected."""
        async with asyncio.timeout(WAIT_S):
            while len(self.accepted) <= index:
                await self._accepted_changed.wait()
                self._accepted_changed.clear()
            stream = self.accepted[index]
            await stream.made
        return stream

    async def pair(self, **endpoint: Any) -> tuple[Endpoint, Endpoint]:
        """(client, server) ends of one fresh connection."""
        address = await self.listen(**endpoint)
        index = len(self.accepted)
        client = await self.connect(address, **endpoint)
        return client, await self.accept(index)

    async def raw_socket(self, address: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sockets.append(sock)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, "\0" + address.removeprefix("unix:@"))
        return sock

    async def aclose(self) -> None:
        for stream in self.streams:
            if stream.transport is not None and not stream.lost.done():
                stream.abort()
        for server in self.servers:
            server.close()
        for sock in self.sockets:
            sock.close()
        async with asyncio.timeout(WAIT_S):
            for stream in self.streams:
                if stream.transport is not None:
                    await stream.lost
            for server in self.servers:
                await server.wait_closed()


@contextlib.asynccontextmanager
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    try:
        yield h
    finally:
        await h.aclose()


def run_with_harness(run: Runner, scenario: Callable[[Harness], Awaitable[None]]) -> None:
    async def main() -> None:
        async with harness() as h:
            await scenario(h)

    run(main())


async def read_until_eof(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    received = bytearray()
    async with asyncio.timeout(WAIT_S):
        while chunk := await loop.sock_recv(sock, 65536):
            received += chunk
    return bytes(received)


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("run", LOOPS)
def test_round_trip_both_ways_in_order(run: Runner) -> None:
    async def scenario(h: Harness) -> None:
        client, server = await h.pair()
        to_server = [b"", b"one", b"", bytes(range(256)), b"\x00" * 1000] + [b"m%d" % i for i in range(200)]
        to_client = [b"reply", b"", b"\xff" * 70_000] + [b"r%d" % i for i in range(200)]
        for payload in to_server:
            assert client.send_nowait(payload) is None
        for payload in to_client:
            await server.send(payload)
        assert await server.receive(len(to_server)) == to_server
        assert await client.receive(len(to_client)) == to_client
        assert not client.closed and not server.closed
        assert client.closed_reasons == [] and server.closed_reasons == []

    run_with_harness(run, scenario)


@pytest.mark.parametrize("run", LOOPS)
def test_large_message_arrives_byte_identical(run: Runner) -> None:
    big = random.Random(7).randbytes(3 * 1024 * 1024 + 13)  # past 64 KiB: header and payload written apart

    async def scenario(h: Harness) -> None:
        client, server = await h.pair()
        await client.send(big)
        await client.send(b"after")
        assert await server.receive(2) == [big, b"after"]
        await server.send(big[::-1])
        assert await client.receive(1) == [big[::-1]]

    run_with_harness(run, scenario)


@pytest.mark.parametrize("run", LOOPS)
def test_many_connections_to_one_listener_stay_apart(run: Runner) -> None:
    async def scenario(h: Harness) -> None:
        address = await h.listen()
        clients = [await h.connect(address) for _ in range(5)]
        servers = [await h.accept(i) for i in range(5)]
        for i, client in enumerate(clients):
            client.send_nowait(b"from %d" % i)
        for server in servers:
            (message,) = await server.receive(1)
            server.send_nowait(message + b" back")
        for i, client in enumerate(clients):
            assert await client.receive(1) == [b"from %d back" % i]

    run_with_harness(run, scenario)


# -------------------------------------------------------------------------- fragmentation
MESSAGES = [b"", b"a", b"hello", b"", bytes(range(256)) * 40, b"\x00\x00\x00", b"tail"]
WIRE = b"".join(frame(m) for m in MESSAGES)


async def test_parsing_one_byte_at_a_time() -> None:
    async with harness() as h:
        client, _ = await h.pair()
        for i in range(len(WIRE)):
            client.data_received(WIRE[i:i + 1])
        assert client.messages == MESSAGES
        client.data_received(frame(b"next"))  # nothing left over from the byte-wise feed
        assert client.messages == [*MESSAGES, b"next"]


async def test_parsing_all_messages_in_one_chunk() -> None:
    async with harness() as h:
        client, _ = await h.pair()
        many = [b"%d" % i * (i % 7) for i in range(1000)]
        client.data_received(WIRE + b"".join(frame(m) for m in many))
        assert client.messages == MESSAGES + many


async def test_parsing_at_every_split_point() -> None:
    small = [b"", b"ab", b"xyz", b""]
    wire = b"".join(frame(m) for m in small) * 2
    async with harness() as h:
        client, _ = await h.pair()
        for cut in range(len(wire) + 1):
            client.messages.clear()
            client.data_received(wire[:cut])
            client.data_received(wire[cut:])
            assert client.messages == small * 2, cut


async def test_parsing_random_chunks() -> None:
    rng = random.Random(3)
    async with harness() as h:
        client, _ = await h.pair()
        for _ in range(50):
            client.messages.clear()
            offset = 0
            while offset < len(WIRE):
                step = rng.randint(1, 3000)
                client.data_received(WIRE[offset:offset + step])
                offset += step
            assert client.messages == MESSAGES


async def test_raw_bytes_to_a_listener() -> None:
    loop = asyncio.get_running_loop()
    async with harness() as h:
        address = await h.listen()
        sock = await h.raw_socket(address)
        server = await h.accept()
        for i in range(len(WIRE)):  # byte by byte (the kernel may still join some)
            await loop.sock_sendall(sock, WIRE[i:i + 1])
        many = [os.urandom(i % 50) for i in range(2000)]
        await loop.sock_sendall(sock, b"".join(frame(m) for m in many))  # all in one write
        assert await server.receive(len(MESSAGES) + len(many)) == MESSAGES + many
        server.send_nowait(b"pong")
        server.close()
        assert await read_until_eof(sock) == frame(b"pong")


# ------------------------------------------------------------------------------ the limit
@pytest.mark.parametrize("run", LOOPS)
def test_oversized_header_ends_only_that_connection(run: Runner) -> None:
    def answer(stream: Endpoint, size: int) -> None:
        stream.send_nowait(b"too big: %d" % size)  # still possible from on_oversized

    async def scenario(h: Harness) -> None:
        address = await h.listen(max_message_bytes=1024, on_oversized=answer)
        client = await h.connect(address, max_message_bytes=1 << 20)
        server = await h.accept(0)
        await client.send(b"x" * 1024)  # exactly the limit is fine
        assert await server.receive(1) == [b"x" * 1024]
        client.send_nowait(b"y" * 2048)
        await server.until(lambda: bool(server.oversized))
        assert server.oversized == [2048]
        assert server.closed
        with pytest.raises(StreamClosedError):
            server.send_nowait(b"late")
        await server.wait_lost()
        assert len(server.closed_reasons) == 1  # the peer ended it: on_closed runs on this side
        await client.wait_lost()
        assert client.messages == [b"too big: 2048"]
        assert len(client.closed_reasons) == 1 and client.closed
        assert server.messages == [b"x" * 1024]

        # A raw header alone: the listener answers, then the client reads EOF.
        sock = await h.raw_socket(address)
        raw_server = await h.accept(1)
        await asyncio.get_running_loop().sock_sendall(sock, HEADER.pack(1025))
        assert await read_until_eof(sock) == frame(b"too big: 1025")
        await raw_server.wait_lost()
        assert raw_server.oversized == [1025] and len(raw_server.closed_reasons) == 1

        # The listener still serves.
        again = await h.connect(address)
        again_server = await h.accept(2)
        await again.send(b"still here")
        assert await again_server.receive(1) == [b"still here"]
        await again_server.send(b"yes")
        assert await again.receive(1) == [b"yes"]

    run_with_harness(run, scenario)


async def test_send_over_the_limit_raises_value_error() -> None:
    async with harness() as h:
        client, server = await h.pair(max_message_bytes=100)
        with pytest.raises(ValueError, match="over the limit"):
            client.send_nowait(b"z" * 101)
        with pytest.raises(ValueError):
            await client.send(b"z" * 101)
        await client.send(b"z" * 100)
        assert await server.receive(1) == [b"z" * 100]
        assert not client.closed


# ------------------------------------------------------------------------------- closing
@pytest.mark.parametrize("run", LOOPS)
@pytest.mark.parametrize("how", ["close", "abort"])
def test_closing_end_gets_no_on_closed_and_peer_does(run: Runner, how: str) -> None:
    async def scenario(h: Harness) -> None:
        client, server = await h.pair()
        server.send_nowait(b"last words")
        getattr(server, how)()
        assert server.closed
        with pytest.raises(StreamClosedError):
            server.send_nowait(b"after my own close")
        await client.wait_lost()
        await server.wait_lost()
        assert len(client.closed_reasons) == 1 and client.closed
        assert server.closed_reasons == []  # not after a stream's own close() or abort()
        if how == "close":
            assert client.messages == [b"last words"]  # close() flushes first
        with pytest.raises(StreamClosedError):
            client.send_nowait(b"to nobody")
        with pytest.raises(StreamClosedError):
            await client.send(b"to nobody")
        client.close()  # closing an ended stream is harmless
        assert len(client.closed_reasons) == 1

    run_with_harness(run, scenario)


async def test_stream_closed_error_is_a_connection_error() -> None:
    assert issubclass(StreamClosedError, ConnectionError)
    stream = Endpoint()
    with pytest.raises(StreamClosedError):  # never connected
        stream.send_nowait(b"x")


# ------------------------------------------------------------------------------ addresses
@pytest.mark.parametrize("run", LOOPS)
def test_connect_to_nobody_is_refused_quickly(run: Runner) -> None:
    async def scenario(h: Harness) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        stream = Endpoint()
        with pytest.raises(ConnectionRefusedError):
            await connect(fresh_address("nobody"), stream, timeout_s=30)
        assert loop.time() - started < 1.0
        assert stream.transport is None and stream.closed_reasons == []

    run_with_harness(run, scenario)


async def test_a_closed_listener_refuses() -> None:
    async with harness() as h:
        address = await h.listen()
        server = h.servers[0]
        server.close()
        await server.wait_closed()
        with pytest.raises(ConnectionError):
            await connect(address, Endpoint(), timeout_s=WAIT_S)


@pytest.mark.parametrize("name", ["", "a\0b", "\0"])
def test_local_address_rejects_bad_names(name: str) -> None:
    with pytest.raises(ValueError):
        local_address(name)


def test_local_address_form() -> None:
    assert local_address("worker-1") == "unix:@worker-1"


@pytest.mark.parametrize(
    "address", ["", "unix:@", "unix:/tmp/sock", "tcp://127.0.0.1:5555", "ipc://x", "unix:@a\0b", "@name"]
)
async def test_bad_addresses_raise_value_error(address: str) -> None:
    with pytest.raises(ValueError):
        await connect(address, Endpoint(), timeout_s=WAIT_S)
    with pytest.raises(ValueError):
        await listen(address, Endpoint)


async def test_listening_twice_on_one_address_fails() -> None:
    async with harness() as h:
        address = await h.listen()
        with pytest.raises(OSError):
            await listen(address, Endpoint)


# -------------------------------------------------------------------------- back-pressure
@pytest.mark.parametrize("run", LOOPS)
def test_back_pressure_waits_for_the_reader(run: Runner) -> None:
    async def scenario(h: Harness) -> None:
        client, server = await h.pair(max_message_bytes=1 << 20)
        assert server.transport is not None
        server.transport.pause_reading()
        sent: list[bytes] = []
        waiter = None
        for i in range(2000):  # a few MiB at most before the kernel and the transport fill
            payload = i.to_bytes(4, "little") * (16 * 1024 - 1)
            sent.append(payload)
            waiter = client.send_nowait(payload)
            if waiter is not None:
                break
        assert waiter is not None, "send_nowait never signalled back-pressure"
        assert not waiter.done()
        later = asyncio.ensure_future(client.send(b"after the pause"))  # waits too
        sent.append(b"after the pause")
        server.transport.resume_reading()
        async with asyncio.timeout(WAIT_S):
            await waiter
            await later
        assert await server.receive(len(sent)) == sent
        assert client.send_nowait(b"flowing again") is None
        assert await server.receive(len(sent) + 1) == [*sent, b"flowing again"]

    run_with_harness(run, scenario)


@pytest.mark.parametrize("run", LOOPS)
def test_back_pressure_waiter_fails_when_the_connection_ends(run: Runner) -> None:
    async def scenario(h: Harness) -> None:
        client, server = await h.pair(max_message_bytes=1 << 20)
        assert server.transport is not None
        server.transport.pause_reading()
        waiter = None
        for _ in range(2000):
            waiter = client.send_nowait(b"\x01" * (64 * 1024))
            if waiter is not None:
                break
        assert waiter is not None
        server.abort()
        with pytest.raises(StreamClosedError):
            async with asyncio.timeout(WAIT_S):
                await waiter
        await client.wait_lost()
        assert len(client.closed_reasons) == 1

    run_with_harness(run, scenario)


# ------------------------------------------------------------------------ failing handler
async def test_failing_handler_is_logged_and_the_stream_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    def handle(payload: bytes) -> None:
        if payload.startswith(b"boom"):
            raise RuntimeError(f"cannot handle {payload!r}")

    caplog.set_level(logging.ERROR, logger="engine.data.framed")
    async with harness() as h:
        address = await h.listen(handle=handle)
        client = await h.connect(address)
        server = await h.accept()
        for payload in (b"a", b"boom1", b"b"):
            await client.send(payload)
        assert await server.receive(3) == [b"a", b"boom1", b"b"]
        server.data_received(frame(b"c") + frame(b"boom2") + frame(b"d"))  # later ones in one chunk too
        assert server.messages == [b"a", b"boom1", b"b", b"c", b"boom2", b"d"]
        assert not server.closed
        await server.send(b"alive")
        assert await client.receive(1) == [b"alive"]

    failures = [r for r in caplog.records if r.name == "engine.data.framed" and r.levelno == logging.ERROR]
    assert len(failures) == 2
    assert all(r.exc_info is not None and r.exc_info[0] is RuntimeError for r in failures)


# ------------------------------------------------------------------ who may connect
@pytest.mark.parametrize("run", LOOPS)
def test_a_peer_of_another_uid_is_refused_before_its_first_message(run: Runner) -> None:
    """The listener reads the connecting process's credentials (SO_PEERCRED): a process of
    another uid (a forked child that became `nobody`) is closed unanswered and counted, and
    the stream factory never sees it; a process of this uid is answered."""
    from engine.data.framed import RefusalCounter
    from tests.foreign_uid import NOBODY, Outcome, call_as

    async def main() -> None:
        address = fresh_address("uid")
        counter = RefusalCounter()
        accepted: list[FramedStream] = []

        def accept() -> FramedStream:
            stream = FramedStream(lambda payload: stream.send_nowait(b"echo:" + payload), max_message_bytes=1024)
            accepted.append(stream)
            return stream

        server = await listen(address, accept, counter=counter)
        try:
            foreign = await asyncio.to_thread(call_as, NOBODY, address, b"hello", 1.0)
            assert foreign.outcome is Outcome.CLOSED
            assert (counter.refused, accepted) == (1, [])
            same = await asyncio.to_thread(call_as, os.getuid(), address, b"hello", WAIT_S)
            assert same.outcome is Outcome.ANSWERED and same.data == frame(b"echo:hello")
            assert (counter.refused, len(accepted)) == (1, 1)
        finally:
            server.close()
            for stream in accepted:
                stream.close()

    run(main())


def test_connecting_to_a_listener_of_another_uid_is_refused() -> None:
    """A name another user bound first (a squatter) is not talked to: `connect` checks the
    listener's credentials before the stream sees the connection."""
    from engine.data.framed import PeerRefusedError

    address = fresh_address("squat")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the squatter: binds as nobody, says so, then waits to be killed
        try:
            os.close(ready_r)
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind("\0" + address.removeprefix("unix:@"))
            sock.listen(4)
            os.write(ready_w, b"1")
            signal.pause()
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1", "the squatter did not bind"

        async def main() -> None:
            stream = FramedStream(lambda payload: None, max_message_bytes=1024)
            with pytest.raises(PeerRefusedError, match="uid 65534"):
                await connect(address, stream, timeout_s=WAIT_S)

        asyncio.run(main())
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
