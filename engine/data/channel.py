"""Channels: how a consumer pulls the bytes behind a `TensorRef` from the ref's owner.

One `Channel` protocol, three transports:

* `InProcessChannel` - the owner's `TensorStore` lives in this process: a read-only view
  of the stored bytes, no copy, no socket.
* `SharedMemoryChannel` - the owner is on this host: one small request over ZeroMQ tells
  which segment holds the tensor; the consumer maps it read-only and reads in place (no
  copy). Mappings are cached, so a segment the owner recycles is not mapped twice.
* `ZmqChannel` - any host: the tensor arrives as raw frames over TCP, `chunk_bytes` per
  frame with at most `window` chunks requested ahead (credit-based back-pressure: the owner
  sends only what was asked for), written straight into the consumer's buffer.

The two ZeroMQ channels share a `ZmqClient`: one I/O thread owning one DEALER socket per
owner address, so transfers to many owners proceed concurrently and the caller's thread
(or asyncio loop) never blocks on a socket. Every transfer has a deadline; a peer that does
not answer fails it with `PeerUnavailable` / `TransferTimeout` by then, never later.
CUDA IPC is not implemented in protocol version 1: asking for it raises
`TransportUnavailable` (CUDA tensors are staged to host memory by `TensorStore.put`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import zmq

from engine.data.codec import Limits, MiB, TensorData, WireCodec, WireError, check_header
from engine.data.shm import SegmentError, SegmentMapper, host_id
from engine.data.tensor_store import RefNotFound, TensorStore
from engine.data.wire import (
    PROTOCOL_VERSION,
    ChunkReply,
    ChunkRequest,
    ErrorCode,
    ErrorReply,
    HelloReply,
    HelloRequest,
    Message,
    PullReply,
    PullRequest,
    TensorHeader,
    TensorRef,
    Transport,
)

log = logging.getLogger(__name__)


class TransferState(enum.Enum):
    PENDING = "pending"  # accepted, waiting for a connection or a reply
    TRANSFERRING = "transferring"  # the owner answered; bytes are on their way
    DONE = "done"
    FAILED = "failed"


class TransferError(Exception):
    """Base of every transfer failure."""


class TransferTimeout(TransferError):
    """The owner answered the handshake but the transfer did not finish in time."""


class PeerUnavailable(TransferError):
    """The owner did not answer at all in time, or restarted, or the client is closed."""


class TransportUnavailable(TransferError):
    """No transport that both sides accept can carry this tensor (e.g. CUDA IPC)."""


class RemoteError(TransferError):
    """The owner answered with an `ErrorReply`."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class RefGone(RemoteError):
    """The owner holds no such tensor: released, lease expired, or never existed."""


def remote_error(reply: ErrorReply) -> TransferError:
    if reply.code == ErrorCode.NOT_FOUND:
        return RefGone(reply.code, reply.message)
    if reply.code == ErrorCode.UNSUPPORTED:
        return TransportUnavailable(reply.message)
    if reply.code in (ErrorCode.HANDSHAKE_REQUIRED, ErrorCode.VERSION_MISMATCH):
        return PeerUnavailable(f"{reply.code.name}: {reply.message}")
    return RemoteError(reply.code, reply.message)


# --- handles ---------------------------------------------------------------------------------


class Transfer:
    """Handle on one pull: `poll()` its state, `wait()` / `await wait_async()` its data.

    Thread-safe. A transfer always ends, by its deadline at the latest; `wait(timeout)` with a
    shorter timeout raises `TransferTimeout` but leaves the transfer running."""

    __slots__ = ("_callbacks", "_done", "_error", "_lock", "_result", "_state", "deadline", "ref")

    def __init__(self, ref: TensorRef | None, deadline: float) -> None:
        self.ref = ref
        self.deadline = deadline
        self._state = TransferState.PENDING
        self._result: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Callable[[], None]] = []

    def poll(self) -> TransferState:
        return self._state

    @property
    def error(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | None = None) -> TensorData:
        """The data, once done; raises the transfer's error, or `TransferTimeout` when
        `timeout` (default: until the deadline) passes first."""
        remaining = self.deadline - time.monotonic()
        # The I/O thread fails the transfer at its deadline; the grace only guards against a
        # dead I/O thread, so that this can never hang.
        limit = remaining + 1.0 if timeout is None else min(timeout, remaining + 1.0)
        if not self._done.wait(max(limit, 0.0)):
            raise TransferTimeout(f"transfer not done after {max(limit, 0.0):.3f}s")
        return self._outcome()

    async def wait_async(self) -> TensorData:
        """Like `wait()`, without blocking the event loop."""
        if not self._done.is_set():
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()

            def settle() -> None:
                if not future.done():
                    future.set_result(None)

            self._add_callback(lambda: loop.call_soon_threadsafe(settle))
            remaining = self.deadline - time.monotonic() + 1.0
            try:
                await asyncio.wait_for(future, max(remaining, 0.0))
            except TimeoutError as exc:
                raise TransferTimeout("transfer not done by its deadline") from exc
        return self._outcome()

    def _outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def _add_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def _set_transferring(self) -> None:
        if self._state is TransferState.PENDING:
            self._state = TransferState.TRANSFERRING

    def _finish(self, result: Any = None, error: BaseException | None = None) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._result = result
            self._error = error
            self._state = TransferState.FAILED if error is not None else TransferState.DONE
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
        return True

    @classmethod
    def completed(cls, ref: TensorRef | None, result: Any = None, error: BaseException | None = None) -> Transfer:
        transfer = cls(ref, time.monotonic())
        transfer._finish(result, error)
        return transfer


class Channel(Protocol):
    """Pulls a ref's bytes from its owner. `pull` never blocks on the network: it returns a
    `Transfer` that ends by `timeout` seconds from now at the latest."""

    @property
    def transport(self) -> Transport: ...

    def pull(self, ref: TensorRef, timeout: float) -> Transfer: ...

    def close(self) -> None: ...


class InProcessChannel:
    """Reads refs owned by a store in this very process: a read-only view, no copy."""

    transport = Transport.LOCAL

    def __init__(self, store: TensorStore) -> None:
        self.store = store

    def pull(self, ref: TensorRef, timeout: float) -> Transfer:
        try:
            entry = self.store.get(ref.id)
        except RefNotFound as exc:
            return Transfer.completed(ref, error=RefGone(ErrorCode.NOT_FOUND, str(exc)))
        return Transfer.completed(ref, TensorData(entry.header, entry.data, Transport.LOCAL))

    def close(self) -> None:
        """Nothing to close: the store belongs to its owner."""


class SharedMemoryChannel:
    """Same host: maps the owner's segment; tensors small enough to travel inline do so."""

    transport = Transport.SHM

    def __init__(self, client: ZmqClient) -> None:
        self.client = client

    def pull(self, ref: TensorRef, timeout: float) -> Transfer:
        return self.client.pull(ref, (Transport.SHM, Transport.INLINE), timeout)

    def close(self) -> None:
        """The client is shared; its owner closes it."""


class ZmqChannel:
    """Any host: chunked raw frames over TCP."""

    transport = Transport.TCP

    def __init__(self, client: ZmqClient) -> None:
        self.client = client

    def pull(self, ref: TensorRef, timeout: float) -> Transfer:
        return self.client.pull(ref, (Transport.TCP, Transport.INLINE), timeout)

    def close(self) -> None:
        """The client is shared; its owner closes it."""


async def pull_async(channel: Channel, ref: TensorRef, timeout: float) -> TensorData:
    return await channel.pull(ref, timeout).wait_async()


# --- the ZeroMQ client -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientConfig:
    chunk_bytes: int = 8 * MiB
    window: int = 4  # chunks requested ahead per transfer
    max_mapped_bytes: int = 1 << 30  # cached read-only mappings of other processes' segments
    limits: Limits = Limits()


class _LinkState(enum.Enum):
    HELLO = "hello"
    READY = "ready"


@dataclass(slots=True, eq=False)
class _Link:
    address: str
    socket: zmq.Socket
    state: _LinkState = _LinkState.HELLO
    waiting: list[_Op] = field(default_factory=list)
    server_host: str = ""
    max_chunk: int = 0
    shm_ok: bool = True
    ops: int = 0
    failed: bool = False


@dataclass(slots=True, eq=False)
class _Op:
    """One request in flight: a pull (`ref` set) or a control call (`message` set)."""

    handle: Transfer
    address: str
    deadline: float
    request_id: int = 0
    ref: TensorRef | None = None
    transports: tuple[Transport, ...] = ()
    message: Callable[[int], Message] | None = None
    link: _Link | None = None
    header: TensorHeader | None = None
    dest: np.ndarray | None = None
    next_offset: int = 0
    received: int = 0
    chunk: int = 0
    outstanding: set[int] = field(default_factory=set)


class ZmqClient:
    """The consumer side of the wire: pulls and control calls to any number of owners.

    Owns one daemon I/O thread; `close()` stops it and fails what is still in flight with
    `PeerUnavailable`. Use one client per process (or per worker) and share it."""

    def __init__(
        self,
        config: ClientConfig | None = None,
        *,
        context: zmq.Context | None = None,
        host: str | None = None,
        name: str | None = None,
    ) -> None:
        self.config = config or ClientConfig()
        self.host = host or host_id()
        self.name = name or f"client-{os.getpid()}-{secrets.token_hex(4)}"
        self._own_context = context is None
        self._context = context or zmq.Context(io_threads=1)
        self._commands: collections.deque[_Op] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._request_ids = itertools.count(1)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"omniflow-{self.name}", daemon=True)
        # State below is touched by the I/O thread only.
        self._codec = WireCodec(self.config.limits.hard_max_message_bytes)
        self._links: dict[str, _Link] = {}
        self._by_socket: dict[zmq.Socket, _Link] = {}
        self._ops: dict[int, _Op] = {}
        self._mapper = SegmentMapper(max_bytes=self.config.max_mapped_bytes)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._thread.start()

    # --- API (any thread) ----------------------------------------------------------------------

    def pull(self, ref: TensorRef, transports: tuple[Transport, ...], timeout: float) -> Transfer:
        """Start pulling `ref` from its owner, accepting `transports` (best first)."""
        transfer = Transfer(ref, time.monotonic() + timeout)
        if Transport.CUDA_IPC in transports:
            transfer._finish(error=TransportUnavailable("CUDA IPC is not implemented in protocol v1"))
            return transfer
        op = _Op(transfer, ref.owner, transfer.deadline, ref=ref, transports=transports)
        self._submit(op)
        return transfer

    def call(self, address: str, message: Callable[[int], Message], timeout: float) -> Transfer:
        """Send the control request built by `message(request_id)`; the handle's result is the
        reply message (an `ErrorReply` fails it with the matching `TransferError`)."""
        handle = Transfer(None, time.monotonic() + timeout)
        self._submit(_Op(handle, address, handle.deadline, message=message))
        return handle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(timeout=5.0)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        if self._own_context:
            self._context.term()

    def __enter__(self) -> ZmqClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _submit(self, op: _Op) -> None:
        if self._closed:
            op.handle._finish(error=PeerUnavailable("client is closed"))
            return
        self._commands.append(op)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    # --- I/O thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed:
                events = dict(self._poller.poll(self._poll_timeout_ms()))
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                while self._commands:
                    self._start(self._commands.popleft())
                for socket in [s for s in events if isinstance(s, zmq.Socket)]:
                    link = self._by_socket.get(socket)
                    if link is not None:
                        self._drain(link)
                self._expire(time.monotonic())
        finally:
            self._shutdown()

    def _poll_timeout_ms(self) -> int:
        if not self._ops and not any(link.waiting for link in self._links.values()):
            return 1000
        nearest = min(op.deadline for op in self._all_ops())
        return max(0, int((nearest - time.monotonic()) * 1000) + 1)

    def _all_ops(self) -> list[_Op]:
        ops = list(self._ops.values())
        for link in self._links.values():
            ops.extend(link.waiting)
        return ops

    def _start(self, op: _Op) -> None:
        link = self._links.get(op.address)
        if link is None:
            link = self._connect(op.address)
        op.link = link
        op.request_id = next(self._request_ids)
        link.ops += 1
        if link.state is _LinkState.HELLO:
            link.waiting.append(op)
            return
        self._send_first(op)

    def _connect(self, address: str) -> _Link:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(12))
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self.config.limits.hard_max_message_bytes)
        socket.connect(address)
        link = _Link(address, socket)
        self._links[address] = link
        self._by_socket[socket] = link
        self._poller.register(socket, zmq.POLLIN)
        self._send(link, HelloRequest(PROTOCOL_VERSION, self.name, self.host))
        return link

    def _drop_link(self, link: _Link) -> None:
        if self._links.get(link.address) is link:
            del self._links[link.address]
        self._by_socket.pop(link.socket, None)
        self._poller.unregister(link.socket)
        link.socket.close(linger=0)
        link.failed = True

    def _send(self, link: _Link, message: Message, *frames: Any) -> None:
        link.socket.send(self._codec.encode(message), zmq.SNDMORE if frames else 0)
        for i, frame in enumerate(frames):
            link.socket.send(frame, zmq.SNDMORE if i < len(frames) - 1 else 0, copy=False)

    def _send_first(self, op: _Op) -> None:
        assert op.link is not None
        self._ops[op.request_id] = op
        if op.message is not None:
            self._send(op.link, op.message(op.request_id))
            return
        assert op.ref is not None
        transports = op.transports
        if not (op.link.shm_ok and op.link.server_host == self.host):
            transports = tuple(t for t in transports if t is not Transport.SHM)
        if not transports:
            self._fail(op, TransportUnavailable(f"{op.ref.owner} is not on this host; shared memory impossible"))
            return
        self._send(op.link, PullRequest(op.request_id, op.ref.id, transports))

    def _drain(self, link: _Link) -> None:
        while not link.failed:
            try:
                frames = link.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                message = self._codec.decode(frames[0].buffer)
            except WireError as exc:
                log.warning("unreadable reply from %s: %s", link.address, exc)
                continue
            self._handle(link, message, frames[1:])

    def _handle(self, link: _Link, message: Message, frames: list[zmq.Frame]) -> None:
        if isinstance(message, HelloReply):
            self._on_hello(link, message)
            return
        request_id = getattr(message, "request_id", None)
        if request_id is None:  # an ErrorReply to our hello, or to something unreadable
            if isinstance(message, ErrorReply):
                error = remote_error(message)
                self._fail_link(link, error if isinstance(error, PeerUnavailable) else PeerUnavailable(str(error)))
            return
        op = self._ops.get(request_id)
        if op is None or op.link is not link:
            return  # a late answer to a transfer that already ended
        if isinstance(message, ErrorReply):
            if message.code == ErrorCode.HANDSHAKE_REQUIRED:  # the owner restarted
                self._fail_link(link, remote_error(message))
            else:
                self._fail(op, remote_error(message))
        elif op.message is not None:
            self._complete(op, message)
        elif isinstance(message, PullReply):
            self._on_pull_reply(op, message, frames)
        elif isinstance(message, ChunkReply):
            self._on_chunk(op, message, frames)
        else:
            self._fail(op, RemoteError(ErrorCode.BAD_REQUEST, f"unexpected {type(message).__name__}"))

    def _on_hello(self, link: _Link, reply: HelloReply) -> None:
        if reply.protocol_version != PROTOCOL_VERSION:
            self._fail_link(link, PeerUnavailable(f"owner speaks protocol {reply.protocol_version}"))
            return
        link.state = _LinkState.READY
        link.server_host = reply.host
        link.max_chunk = reply.max_chunk_bytes
        waiting, link.waiting = link.waiting, []
        for op in waiting:
            self._send_first(op)

    def _on_pull_reply(self, op: _Op, reply: PullReply, frames: list[zmq.Frame]) -> None:
        assert op.ref is not None and op.link is not None
        header = reply.header
        try:
            check_header(header)
        except WireError as exc:
            self._fail(op, RemoteError(ErrorCode.MALFORMED, str(exc)))
            return
        if header.nbytes != op.ref.nbytes or header.dtype != op.ref.dtype:
            self._fail(op, RemoteError(ErrorCode.BAD_REQUEST, "owner describes another tensor than the ref"))
            return
        op.handle._set_transferring()
        if reply.transport is Transport.INLINE:
            if len(frames) != 1 or len(frames[0].buffer) != header.nbytes:
                self._fail(op, RemoteError(ErrorCode.MALFORMED, "inline reply without its bytes"))
                return
            data = np.frombuffer(frames[0].buffer, np.uint8).copy()  # small; private and writable
            self._complete(op, TensorData(header, data, Transport.INLINE))
        elif reply.transport is Transport.SHM and reply.segment is not None:
            try:
                if header.offset + header.nbytes > reply.segment_size:
                    raise SegmentError("tensor lies outside its segment")
                mapping = self._mapper.map(reply.segment, reply.segment_size)
            except (SegmentError, OSError) as exc:
                if Transport.TCP not in op.transports:
                    self._fail(op, TransportUnavailable(f"cannot map {reply.segment}: {exc}"))
                    return
                # Same host by name but not the same /dev/shm (containers): TCP from now on.
                op.link.shm_ok = False
                self._send(op.link, PullRequest(op.request_id, op.ref.id, (Transport.TCP, Transport.INLINE)))
                return
            self._complete(op, TensorData(header, mapping, Transport.SHM))
        elif reply.transport is Transport.TCP:
            op.header = header
            if header.nbytes == 0:
                self._complete(op, TensorData(header, np.empty(0, np.uint8), Transport.TCP))
                return
            op.dest = np.empty(header.nbytes, np.uint8)
            op.chunk = max(1, min(self.config.chunk_bytes, op.link.max_chunk or self.config.chunk_bytes))
            for _ in range(self.config.window):
                self._request_chunk(op)
        else:
            self._fail(op, TransportUnavailable(f"owner offered {reply.transport} which was not asked for"))

    def _request_chunk(self, op: _Op) -> None:
        assert op.header is not None and op.link is not None and op.ref is not None
        if op.next_offset >= op.header.nbytes:
            return
        length = min(op.chunk, op.header.nbytes - op.next_offset)
        self._send(op.link, ChunkRequest(op.request_id, op.ref.id, op.next_offset, length))
        op.outstanding.add(op.next_offset)
        op.next_offset += length

    def _on_chunk(self, op: _Op, reply: ChunkReply, frames: list[zmq.Frame]) -> None:
        assert op.header is not None and op.dest is not None
        if reply.offset not in op.outstanding or len(frames) != 1 or len(frames[0].buffer) != reply.length:
            self._fail(op, RemoteError(ErrorCode.MALFORMED, f"unexpected chunk at offset {reply.offset}"))
            return
        op.outstanding.discard(reply.offset)
        op.dest[reply.offset : reply.offset + reply.length] = np.frombuffer(frames[0].buffer, np.uint8)
        op.received += reply.length
        if op.received == op.header.nbytes:
            self._complete(op, TensorData(op.header, op.dest, Transport.TCP))
        else:
            self._request_chunk(op)

    def _complete(self, op: _Op, result: Any) -> None:
        self._end(op)
        op.handle._finish(result)

    def _fail(self, op: _Op, error: BaseException) -> None:
        self._end(op)
        op.handle._finish(error=error)

    def _end(self, op: _Op) -> None:
        self._ops.pop(op.request_id, None)
        if op.link is not None:
            op.link.ops -= 1
            with contextlib.suppress(ValueError):
                op.link.waiting.remove(op)

    def _fail_link(self, link: _Link, error: TransferError) -> None:
        """Fail everything on `link` and close it; the next request reconnects afresh."""
        for op in [op for op in self._all_ops() if op.link is link]:
            self._fail(op, error)
        self._drop_link(link)

    def _expire(self, now: float) -> None:
        for link in list(self._links.values()):
            if link.state is not _LinkState.HELLO:
                continue
            expired = [op for op in link.waiting if op.deadline <= now]
            for op in expired:
                # Nobody answered the handshake: the owner is dead, absent or not one of ours.
                self._fail(op, PeerUnavailable(f"no answer from {link.address}"))
            if expired and not link.waiting:
                self._drop_link(link)
        for op in [op for op in self._ops.values() if op.deadline <= now]:
            assert op.link is not None
            self._fail(op, TransferTimeout(f"no complete answer from {op.address} in time"))
            if op.link.ops == 0 and not op.link.failed:
                # Whatever is still queued on this connection is stale; start over next time.
                self._drop_link(op.link)

    def _shutdown(self) -> None:
        while self._commands:
            self._commands.popleft().handle._finish(error=PeerUnavailable("client closed"))
        for link in list(self._links.values()):
            self._fail_link(link, PeerUnavailable("client closed"))
        self._mapper.clear()
