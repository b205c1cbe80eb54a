"""`IOLoop`: a client's background I/O thread, which carries many requests at a time.

`ZmqClient.pull` and `call` come here (what asyncio callers use): each queues an `_Op` holding
the `Transfer` the caller waits on and wakes the thread through a pipe. Everything else below
belongs to that thread: one `_Link` (a DEALER) per owner address, plain sockets to owners' bulk
channels, and the ops in flight by request id. A request flows: `_start` connects the link if it
has none (sending `HelloRequest`) and parks the op on it until the `HelloReply`; `_send_first`
sends its first request; `_drain` / `_drain_bulk` decode each reply and `_handle` / `_advance`
feed it to the op's `PullState` (or answer a control call), sending what the pull asks next,
until `_complete` or `_fail` finishes the handle.

Failure states, each finishing a handle with a `TransferError`:
* the handshake unanswered by an op's deadline -> `PeerUnavailable`; the link is dropped once
  nothing waits on it;
* an op past its deadline -> `TransferTimeout`; the link is dropped if nothing else runs on it,
  since replies still queued there are stale;
* no connection to send on, a refused handshake, another protocol version, or an owner that
  forgets our handshake again -> `PeerUnavailable` for every op on the link, which is dropped:
  the next request connects afresh. An owner that forgets it once (`HANDSHAKE_REQUIRED`: we
  were idle, or it restarted) is greeted again and the op resent from scratch;
* the client closed -> `PeerUnavailable` for everything queued or in flight.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from engine.data.channel import PeerUnavailable, Transfer, TransferError, TransferTimeout, remote_error
from engine.data.client.config import ClientConfig
from engine.data.client.sockets import OwnerSockets
from engine.data.codec import WireCodec, WireError
from engine.data.curve import BulkMode
from engine.data.pulls import Outgoing, OwnerInfo, PullState, release_discarded
from engine.data.shm import SegmentMapper
from engine.data.wire import (
    PROTOCOL_VERSION,
    BulkChunkRequest,
    BulkGrant,
    BulkMessage,
    ErrorCode,
    ErrorReply,
    HelloReply,
    HelloRequest,
    Message,
)

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Link:
    """A connection owned by the I/O thread."""

    address: str
    socket: zmq.Socket
    peer: OwnerInfo | None = None  # None until the handshake is answered
    waiting: list[_Op] = field(default_factory=list)
    ops: int = 0
    failed: bool = False


@dataclass(slots=True, eq=False)
class _Op:
    """One request in flight on the I/O thread: a pull, or a control call (`message`)."""

    handle: Transfer
    address: str
    deadline: float
    request_id: int = 0
    pull: PullState | None = None
    message: Callable[[int], Message] | None = None
    link: _Link | None = None
    retried: bool = False  # resent once after the owner forgot our handshake


class _BulkChannels:
    """The I/O thread's plain sockets to owners' bulk channels, by address, each registered
    with its poller from the first chunk request sent there until `close()`."""

    def __init__(self, sockets: OwnerSockets, poller: zmq.Poller) -> None:
        self._sockets = sockets
        self._poller = poller
        self._by_address: dict[str, zmq.Socket] = {}
        self._by_socket: dict[zmq.Socket, str] = {}
        self._codec = WireCodec(sockets.max_message_bytes, BulkMessage)

    def __contains__(self, socket: zmq.Socket) -> bool:
        return socket in self._by_socket

    def send(self, address: str, message: BulkChunkRequest) -> None:
        """Send without blocking: raises `zmq.Again` where there is no room (no connection)."""
        socket = self._by_address.get(address)
        if socket is None:
            socket = self._by_address[address] = self._sockets.bulk(address)
            self._by_socket[socket] = address
            self._poller.register(socket, zmq.POLLIN)
        socket.send(self._codec.encode(message), zmq.NOBLOCK)

    def receive(self, socket: zmq.Socket) -> Iterator[tuple[str, BulkMessage, list[zmq.Frame]]]:
        """The replies readable now on `socket`: the channel's address, the message and the frames
        after it. An unreadable one is logged and skipped."""
        address = self._by_socket[socket]
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                message = self._codec.decode(frames[0].buffer)
            except WireError as exc:
                log.warning("unreadable reply from the bulk channel %s: %s", address, exc)
                continue
            yield address, message, frames[1:]

    def close(self) -> None:
        for socket in self._by_socket:
            self._poller.unregister(socket)
            socket.close(linger=0)
        self._by_address.clear()
        self._by_socket.clear()


class IOLoop:
    """The I/O thread of one client, started at construction. `closed` is the client's: once it
    is set, `submit_*` fail the handle at once and `close()` stops the thread."""

    def __init__(self, config: ClientConfig, sockets: OwnerSockets, *, hello: HelloRequest, mapper: SegmentMapper,
                 bulk: BulkMode | None, request_ids: Iterator[int], closed: threading.Event) -> None:
        self._config = config
        self._sockets = sockets
        self._hello = hello
        self._mapper = mapper
        self._bulk_mode = bulk
        self._request_ids = request_ids  # shared with the blocking calls
        self._closed = closed
        self._commands: collections.deque[_Op] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # State below is touched by the I/O thread only.
        self._codec = WireCodec(config.limits.hard_max_message_bytes)
        self._links: dict[str, _Link] = {}
        self._by_socket: dict[zmq.Socket, _Link] = {}
        self._ops: dict[int, _Op] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._bulk_channels = _BulkChannels(sockets, self._poller)
        self._thread = threading.Thread(target=self._run, name=f"omniflow-{hello.peer}", daemon=True)
        self._thread.start()

    # --- any thread ------------------------------------------------------------------------------

    def submit_pull(self, transfer: Transfer, pull: PullState) -> None:
        """Carry `pull` of `transfer`'s ref to its end; the request id is set when it starts."""
        self._submit(_Op(transfer, pull.ref.owner, transfer.deadline, pull=pull))

    def submit_call(self, handle: Transfer, address: str, message: Callable[[int], Message]) -> None:
        """Send `message(request_id)` to `address`; `handle` finishes with the reply."""
        self._submit(_Op(handle, address, handle.deadline, message=message))

    def close(self) -> None:
        """Stop the thread, which fails what it still carries; called once `closed` is set."""
        self._wake()
        self._thread.join(timeout=5.0)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _submit(self, op: _Op) -> None:
        if self._closed.is_set():
            op.handle._finish(error=PeerUnavailable("client is closed"))
            return
        self._commands.append(op)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    # --- the I/O thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
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
                    elif socket in self._bulk_channels:
                        self._drain_bulk(socket)
                self._expire(time.monotonic())
        finally:
            self._shutdown()

    def _poll_timeout_ms(self) -> int:
        ops = self._all_ops()
        if not ops:
            return 1000
        nearest = min(op.deadline for op in ops)
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
        if op.pull is not None:
            op.pull.request_id = op.request_id
        link.ops += 1
        if link.failed:
            self._fail(op, PeerUnavailable(f"no connection to {op.address} to send on"))
            return
        if link.peer is None:
            link.waiting.append(op)
            return
        self._send_first(op)

    def _connect(self, address: str) -> _Link:
        socket = self._sockets.owner(address)
        link = _Link(address, socket)
        self._links[address] = link
        self._by_socket[socket] = link
        self._poller.register(socket, zmq.POLLIN)
        self._send(link, [self._hello])
        return link

    def _drop_link(self, link: _Link) -> None:
        if self._links.get(link.address) is link:
            del self._links[link.address]
        self._by_socket.pop(link.socket, None)
        self._poller.unregister(link.socket)
        link.socket.close(linger=0)
        link.failed = True

    def _send(self, link: _Link, messages: list[Outgoing], grant: BulkGrant | None = None) -> None:
        """Send without blocking the I/O thread: a socket with no connection to send on (the owner
        refused our handshake, or is gone and not back) fails everything on the link at once."""
        for message in messages:
            try:
                if isinstance(message, BulkChunkRequest):
                    assert grant is not None
                    self._bulk_channels.send(grant.address, message)
                else:
                    link.socket.send(self._codec.encode(message), zmq.NOBLOCK)
            except zmq.Again:
                self._fail_link(link, PeerUnavailable(f"no connection to {link.address} to send on (it refused"
                                                      " our handshake, or is gone)"))
                return


    def _drain_bulk(self, socket: zmq.Socket) -> None:
        for address, message, frames in self._bulk_channels.receive(socket):
            request_id = getattr(message, "request_id", None)
            op = self._ops.get(request_id) if request_id is not None else None
            if op is None or op.pull is None or op.pull.grant is None or op.pull.grant.address != address:
                continue  # a late answer to a transfer that already ended
            assert op.link is not None
            self._advance(op.link, op, message, frames)

    def _send_first(self, op: _Op) -> None:
        assert op.link is not None and op.link.peer is not None
        self._ops[op.request_id] = op
        if op.message is not None:
            self._send(op.link, [op.message(op.request_id)])
            return
        assert op.pull is not None
        try:
            requests = op.pull.start(op.link.peer, self._hello.host, self._config.chunk_bytes)
        except TransferError as exc:
            self._fail(op, exc)
            return
        self._send(op.link, requests)

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
        if isinstance(message, ErrorReply) and message.code == ErrorCode.HANDSHAKE_REQUIRED:
            lost = self._ops.get(request_id) if request_id is not None else None
            if lost is not None and lost.link is link and not lost.retried:
                self._retry_after_hello(link, lost)
                return
        if isinstance(message, ErrorReply) and (
            request_id is None or message.code == ErrorCode.HANDSHAKE_REQUIRED
        ):  # the handshake was refused, or the owner keeps forgetting us
            error = remote_error(message)
            self._fail_link(link, error if isinstance(error, PeerUnavailable) else PeerUnavailable(str(error)))
            return
        op = self._ops.get(request_id) if request_id is not None else None
        if op is None or op.link is not link:
            release_discarded(message)  # a late answer to a transfer that already ended
            return
        if op.pull is None:
            if isinstance(message, ErrorReply):
                self._fail(op, remote_error(message))
            else:
                self._complete(op, message)
            return
        self._advance(link, op, message, frames)

    def _advance(self, link: _Link, op: _Op, message: Message | BulkMessage, frames: list[zmq.Frame]) -> None:
        """Feed a pull its reply (from the owner's connection or its bulk channel)."""
        assert op.pull is not None
        try:
            requests = op.pull.on_reply(message, frames)
        except TransferError as exc:
            self._fail(op, exc)
            return
        op.handle._set_transferring()
        if op.pull.shm_failed and link.peer is not None:
            link.peer.shm_ok = False
        if op.pull.cuda_failed and link.peer is not None:
            link.peer.cuda_ok = False
        self._send(link, requests, op.pull.grant)
        if op.pull.result is not None:
            self._complete(op, op.pull.result)

    def _retry_after_hello(self, link: _Link, op: _Op) -> None:
        """The owner forgot our handshake (we were idle, or it restarted): greet it again and
        resend `op` from scratch, once. After a restart the ref is gone and says so."""
        op.retried = True
        self._ops.pop(op.request_id, None)
        if op.pull is not None:
            op.pull = PullState(op.pull.ref, op.pull.accepted, op.request_id, self._mapper, self._config.window,
                                bulk=self._bulk_mode)
        link.waiting.append(op)
        if link.peer is not None:
            link.peer = None
            self._send(link, [self._hello])

    def _on_hello(self, link: _Link, reply: HelloReply) -> None:
        if reply.protocol_version != PROTOCOL_VERSION:
            self._fail_link(link, PeerUnavailable(f"the owner speaks protocol {reply.protocol_version}"))
            return
        link.peer = OwnerInfo(reply.host, reply.max_chunk_bytes)
        waiting, link.waiting = link.waiting, []
        for op in waiting:
            self._send_first(op)

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
            if link.peer is not None:
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
        self._bulk_channels.close()
