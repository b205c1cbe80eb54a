"""Length-prefixed message streams over abstract Unix sockets, served by the event loop.

The control path between a dispatcher and a role worker in one network namespace: each
message is a 4-byte little-endian length followed by that many bytes (one msgpack message).
Against a ZeroMQ socket over `ipc://` it spares both ends ZeroMQ's I/O thread: a message is
one write and one read on the loop's own thread, with no thread hand-off on either side
(a round trip of about 12 us against about 40 us on two cores; see `omniflow bench hops`).
Across hosts the control path stays ZeroMQ over TCP.

Addresses read `unix:@NAME`: Linux's abstract namespace, so there is no file to clean up and
the name goes away with the process that bound it. An abstract socket has no file mode, so
anyone in the network namespace may connect: both ends read the other's credentials
(SO_PEERCRED) before the first message, and a peer of another uid is refused — closed,
logged and counted (`Admission.refused`) — before a byte of it is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

log = logging.getLogger(__name__)

SCHEME = "unix:@"
_HEADER = struct.Struct("<I")
_PEERCRED = struct.Struct("3i")
"""`struct ucred`: pid, uid, gid."""
_SPLIT_WRITE_BYTES = 64 * 1024
"""From this size on, the header and the payload are written as two buffers, not joined."""


class StreamClosedError(ConnectionError):
    """A send on a stream whose connection has ended."""


def local_address(name: str) -> str:
    """The address of the abstract Unix socket `name`."""
    if not name or "\0" in name:
        raise ValueError(f"bad abstract socket name {name!r}")
    return SCHEME + name


def _socket_name(address: str) -> str:
    name = address[len(SCHEME):]
    if not address.startswith(SCHEME) or not name or "\0" in name:  # as local_address
        raise ValueError(f"{address!r} is not a local stream address ({SCHEME}NAME)")
    return "\0" + name


class PeerRefusedError(ConnectionError):
    """The process at the other end runs as another user."""


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """Who is at the other end of the connected Unix socket `sock` (as of its connect)."""
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return PeerCredentials(pid, uid, gid)


class FramedStream(asyncio.Protocol):
    """One end of a connection carrying whole messages.

    `on_message(payload)` gets each message as it arrives, on the loop's thread. A length
    above `max_message_bytes` calls `on_oversized(length)` (which may still send, say, an
    error reply) and ends the connection: the rest of the stream cannot be trusted.
    `on_closed(reason)` is called once when the peer ends the connection or it breaks, not
    after this end's own `close()` or `abort()`.
    """

    def __init__(
        self,
        on_message: Callable[[bytes], None],
        *,
        max_message_bytes: int,
        on_oversized: Callable[[int], None] | None = None,
        on_closed: Callable[[str], None] | None = None,
    ) -> None:
        self._on_message = on_message
        self._on_oversized = on_oversized
        self._on_closed = on_closed
        self._max = max_message_bytes
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._paused = False
        self._drained: list[asyncio.Future[None]] = []
        self._closed = False

    @property
    def closed(self) -> bool:
        """No more sends: ended by either side, or closing (its transport is shutting down)."""
        return self._closed or (self._transport is not None and self._transport.is_closing())

    @property
    def paused(self) -> bool:
        """Sends are waiting for room: the peer does not read as fast as this end writes."""
        return self._paused

    # ------------------------------------------------------------------ protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        if buffer:
            buffer += data
            view: bytes | bytearray = buffer
        else:
            view = data
        offset, total = 0, len(view)
        while total - offset >= _HEADER.size and not self._closed:
            (size,) = _HEADER.unpack_from(view, offset)
            if size > self._max:
                self._oversized(size)
                return
            end = offset + _HEADER.size + size
            if end > total:
                break
            message = bytes(view[offset + _HEADER.size:end])
            offset = end
            try:
                self._on_message(message)
            except Exception:  # one bad message must not end the stream
                log.exception("handling a message of %d bytes failed", size)
        if view is buffer:
            del buffer[:offset]
        elif offset < total:
            buffer += view[offset:]

    def _oversized(self, size: int) -> None:
        self._buffer.clear()
        if self._on_oversized is not None:
            try:
                self._on_oversized(size)
            except Exception:  # the connection ends anyway
                log.exception("answering an oversized message failed")
        self._closed = True  # on_closed still runs: the connection ends because of the peer
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._buffer.clear()
        self._fail_waiters()
        if self._on_closed is not None:
            callback, self._on_closed = self._on_closed, None
            callback(f"connection lost: {exc}" if exc is not None else "connection closed")

    def _fail_waiters(self) -> None:
        waiters, self._drained = self._drained, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(StreamClosedError("connection closed"))
                waiter.exception()  # a sender that gave up waiting need not read it

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        for waiter in self._drained:
            if not waiter.done():
                waiter.set_result(None)
        self._drained.clear()

    # ------------------------------------------------------------------- sending
    def send_nowait(self, payload: bytes, *, waiter: bool = True) -> asyncio.Future[None] | None:
        """Queue `payload` for sending (in order, never dropped while the connection lasts).
        Returns None, or (with `waiter`) a future done when the transport's buffer has
        drained below its high-water mark. Raises StreamClosedError once the connection has
        ended or is closing."""
        transport = self._transport
        if self._closed or transport is None or transport.is_closing():
            raise StreamClosedError("connection closed")
        if len(payload) > self._max:
            raise ValueError(f"message of {len(payload)} bytes is over the limit of {self._max}")
        header = _HEADER.pack(len(payload))
        if len(payload) >= _SPLIT_WRITE_BYTES:
            transport.writelines((header, payload))
        else:
            transport.write(header + payload)
        if not self._paused or not waiter:
            return None
        drained = asyncio.get_running_loop().create_future()
        self._drained.append(drained)
        return drained

    async def send(self, payload: bytes) -> None:
        waiter = self.send_nowait(payload)
        if waiter is not None:
            await waiter

    def close(self) -> None:
        """End the connection after what was sent has been written (senders waiting for room
        fail at once: the transport may wait for a peer that never reads)."""
        self._closed = True
        self._on_closed = None
        self._fail_waiters()
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """End the connection now, dropping what was not written."""
        self._closed = True
        self._on_closed = None
        self._fail_waiters()
        if self._transport is not None:
            self._transport.abort()


class Admission(asyncio.Protocol):
    """What a listener runs first on each connection: a peer of this process's uid is handed
    to the stream `accept()` makes (which sees the connection from its start); any other is
    closed unread, logged and counted in `counter.refused`."""

    def __init__(self, accept: Callable[[], FramedStream], counter: RefusalCounter) -> None:
        self._accept = accept
        self._counter = counter

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        credentials = peer_credentials(sock)
        if credentials.uid != os.getuid():
            self._counter.refused += 1
            log.warning("refused a local connection from pid %d: uid %d is not this process's uid %d",
                        credentials.pid, credentials.uid, os.getuid())
            transport.abort()
            return
        stream = self._accept()
        transport.set_protocol(stream)
        stream.connection_made(transport)

    def data_received(self, data: bytes) -> None:  # only a refused peer's, before the abort lands
        return


@dataclass(slots=True)
class RefusalCounter:
    refused: int = 0
    """Connections refused: the peer ran as another user."""


async def listen(address: str, accept: Callable[[], FramedStream], *, backlog: int = 256,
                 counter: RefusalCounter | None = None) -> asyncio.Server:
    """Serve the abstract Unix socket `address`; each connection of a process of this uid gets
    the stream `accept()` makes, any other is refused (counted in `counter`)."""
    counter = counter if counter is not None else RefusalCounter()
    with contextlib.ExitStack() as undo:
        sock = undo.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        sock.bind(_socket_name(address))
        sock.listen(backlog)
        sock.setblocking(False)
        server = await asyncio.get_running_loop().create_unix_server(lambda: Admission(accept, counter), sock=sock)
        undo.pop_all()
    return server


async def connect(address: str, stream: FramedStream, *, timeout_s: float) -> FramedStream:
    """Connect `stream` to `address`. Raises ConnectionError (nobody listens there),
    PeerRefusedError (the listener runs as another user: a name squatted by someone else) or
    TimeoutError (the listener does not accept within `timeout_s`)."""
    loop = asyncio.get_running_loop()
    with contextlib.ExitStack() as undo:
        sock = undo.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        sock.setblocking(False)
        async with asyncio.timeout(timeout_s):
            await loop.sock_connect(sock, _socket_name(address))
            credentials = peer_credentials(sock)
            if credentials.uid != os.getuid():
                raise PeerRefusedError(f"{address} is served by uid {credentials.uid} (pid {credentials.pid}),"
                                       f" not by this process's uid {os.getuid()}")
            await loop.create_unix_connection(lambda: stream, sock=sock)
        undo.pop_all()
    return stream
