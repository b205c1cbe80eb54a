"""`DirectLinks`: a client's blocking calls, driven in the caller's own thread.

`ZmqClient.fetch`, `fetch_to`, `fetch_granted` and `request` come here; doing the I/O in the
caller's thread saves the two thread hand-offs per round trip that the I/O thread (`loop`) costs.
Each owner address has one `_DirectLink`: a DEALER, and a plain socket to the owner's bulk
channel once a grant named one. A call takes the link's lock (calls to one owner from several
threads take turns), greets the owner if the link has not yet, sends its request and polls the
socket itself for the reply, in slices of `POLL_SLICE_MS` so that it notices the client closing.
A pull goes on the same way: its `PullState` says what to send after each reply.

Failure states: the link stays busy past the timeout -> `TransferTimeout`; the handshake
unanswered or refused, or no connection to send on -> `PeerUnavailable`; no reply by the deadline
-> `TransferTimeout`; the client closed -> `PeerUnavailable`. After a timeout or an unavailable
owner the link's sockets are closed (replies may still be queued for them) and the next call
connects afresh. An owner that forgot the handshake (`HANDSHAKE_REQUIRED`: we were idle, or it
restarted) is greeted again and the call redone, once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from engine.data.channel import PeerUnavailable, TransferTimeout, remote_error
from engine.data.client.sockets import OwnerSockets
from engine.data.codec import TensorData, WireCodec, WireError
from engine.data.pulls import Outgoing, OwnerInfo, PullState, release_discarded
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

StartPull = Callable[[OwnerInfo, int], tuple[PullState, list[Outgoing]]]
"""Builds a pull for the greeted owner under a fresh request id: its state and its first requests."""


class _HandshakeLost(Exception):
    """The owner answered HANDSHAKE_REQUIRED: it no longer knows this connection."""


@dataclass(slots=True, eq=False)
class _DirectLink:
    """A connection used by the thread that holds `lock`, for blocking calls."""

    address: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    socket: zmq.Socket | None = None
    peer: OwnerInfo | None = None
    bulk_address: str | None = None
    bulk_socket: zmq.Socket | None = None  # to the owner's bulk channel, once a grant named it


class DirectLinks:
    """The blocking calls of one client, by owner address. `closed` is the client's: once it is
    set, calls in progress raise `PeerUnavailable` within one poll slice and new ones at once."""

    POLL_SLICE_MS = 100  # how often a blocking call checks that the client is still open

    def __init__(self, sockets: OwnerSockets, hello: HelloRequest, request_ids: Iterator[int],
                 closed: threading.Event) -> None:
        self._sockets = sockets
        self._hello = hello
        self._request_ids = request_ids  # shared with the I/O thread
        self._closed = closed
        self._links: dict[str, _DirectLink] = {}
        self._lock = threading.Lock()
        self._per_thread = threading.local()

    def pull(self, address: str, timeout: float, start: StartPull) -> TensorData | None:
        """Drive the pull `start` builds to its end: its result, or None where a sink took the bytes."""

        def drive(link: _DirectLink, deadline: float) -> TensorData | None:
            assert link.peer is not None
            pull, requests = start(link.peer, next(self._request_ids))
            return self._drive(link, pull, requests, deadline)

        return self._with_link(address, timeout, drive)

    def request(self, address: str, message: Callable[[int], Message], timeout: float) -> Message:
        """Send the control request `message(request_id)` and return the reply (an `ErrorReply`
        raises the matching `TransferError`)."""

        def drive(link: _DirectLink, deadline: float) -> Message:
            request_id = next(self._request_ids)
            self._send(link, [message(request_id)], deadline)
            reply, _frames = self._reply(link, request_id, deadline)
            if isinstance(reply, ErrorReply):
                raise remote_error(reply)
            return reply

        return self._with_link(address, timeout, drive)

    def owner_host(self, address: str) -> str | None:
        """The host the owner at `address` named when it was greeted (None: not greeted yet)."""
        with self._lock:
            link = self._links.get(address)
        peer = None if link is None else link.peer
        return None if peer is None else peer.host

    def close(self) -> None:
        """Close every link's sockets; called once `closed` is set."""
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            # A blocking call in progress notices `closed` within one poll slice.
            if link.lock.acquire(timeout=1.0):
                self._reset(link)
                link.lock.release()

    def _with_link(self, address: str, timeout: float, drive: Callable[[_DirectLink, float], Any]) -> Any:
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._closed.is_set():
                raise PeerUnavailable("client is closed")
            link = self._links.setdefault(address, _DirectLink(address))
        if not link.lock.acquire(timeout=max(timeout, 0.0)):
            raise TransferTimeout(f"the connection to {address} stayed busy for {timeout}s")
        try:
            if link.socket is None:
                link.socket = self._sockets.owner(address)
            for _attempt in range(2):
                if link.peer is None:
                    self._greet(link, deadline)
                try:
                    return drive(link, deadline)
                except _HandshakeLost:
                    continue  # the owner forgot us (we were idle, or it restarted): greet it again, once
            raise PeerUnavailable(f"{address} keeps refusing requests after a handshake")
        except (TransferTimeout, PeerUnavailable):
            self._reset(link)  # replies may still be queued for it: start over next time
            raise
        finally:
            if self._closed.is_set():
                self._reset(link)
            link.lock.release()

    def _drive(self, link: _DirectLink, pull: PullState, requests: list[Outgoing],
               deadline: float) -> TensorData | None:
        """Send a pull's first requests, then feed it replies until it is done."""
        assert link.peer is not None
        self._send(link, requests, deadline, pull.grant)
        while not pull.finished:
            if pull.grant is None:
                message, frames = self._reply(link, pull.request_id, deadline)
            else:
                message, frames = self._bulk_reply(link, pull.request_id, deadline)
            requests = pull.on_reply(message, frames)
            if pull.shm_failed:
                link.peer.shm_ok = False
            if pull.cuda_failed:
                link.peer.cuda_ok = False
            self._send(link, requests, deadline, pull.grant)
        return pull.result

    def _greet(self, link: _DirectLink, deadline: float) -> None:
        self._send(link, [self._hello], deadline)
        try:
            reply, _frames = self._reply(link, None, deadline)
        except TransferTimeout as exc:
            raise PeerUnavailable(f"no answer from {link.address}") from exc
        if isinstance(reply, ErrorReply):
            raise PeerUnavailable(f"{link.address} refused the handshake: {reply.message}")
        if not isinstance(reply, HelloReply) or reply.protocol_version != PROTOCOL_VERSION:
            raise PeerUnavailable(f"{link.address} answered the handshake with {reply!r}")
        link.peer = OwnerInfo(reply.host, reply.max_chunk_bytes)

    def _send(self, link: _DirectLink, messages: list[Outgoing], deadline: float,
              grant: BulkGrant | None = None) -> None:
        assert link.socket is not None
        for message in messages:
            if isinstance(message, BulkChunkRequest):
                assert grant is not None
                if link.bulk_socket is None or link.bulk_address != grant.address:
                    if link.bulk_socket is not None:
                        link.bulk_socket.close(linger=0)
                    link.bulk_socket, link.bulk_address = self._sockets.bulk(grant.address), grant.address
                self._put(link.bulk_socket, grant.address, self._bulk_codec().encode(message), deadline)
            else:
                self._put(link.socket, link.address, self._codec().encode(message), deadline)

    def _put(self, socket: zmq.Socket, address: str, data: bytes, deadline: float) -> None:
        """Send, waiting for room at most until `deadline`: a DEALER with no connection (its peer
        refused our handshake, or is gone and not back) would block a plain send forever."""
        while True:
            try:
                socket.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            if self._closed.is_set():
                raise PeerUnavailable("client closed")
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise PeerUnavailable(f"no connection to {address} to send on (it refused our handshake,"
                                      " or is gone)")
            socket.poll(min(remaining_ms, self.POLL_SLICE_MS), zmq.POLLOUT)

    def _bulk_reply(self, link: _DirectLink, request_id: int,
                    deadline: float) -> tuple[Message | BulkMessage, list[zmq.Frame]]:
        """The next reply to `request_id` on the owner's bulk channel; stale ones are skipped."""
        assert link.bulk_socket is not None
        codec = self._bulk_codec()
        where = f"the bulk channel of {link.address}"
        while True:
            message, frames = self._next_message(link.bulk_socket, codec, link.address, where, deadline)
            if getattr(message, "request_id", None) == request_id:
                return message, frames[1:]

    def _reply(self, link: _DirectLink, request_id: int | None, deadline: float) -> tuple[Message, list[zmq.Frame]]:
        """The next reply to `request_id` (None: the handshake); stale replies are skipped."""
        assert link.socket is not None
        codec = self._codec()
        while True:
            message, frames = self._next_message(link.socket, codec, link.address, link.address, deadline)
            got = getattr(message, "request_id", None)
            if isinstance(message, ErrorReply) and message.code == ErrorCode.HANDSHAKE_REQUIRED:
                link.peer = None
                raise _HandshakeLost(link.address)
            if got == request_id or (request_id is None and isinstance(message, HelloReply | ErrorReply)):
                return message, frames[1:]
            release_discarded(message)  # a stale answer to a pull that already ended

    def _next_message(self, socket: zmq.Socket, codec: WireCodec, address: str, where: str,
                      deadline: float) -> tuple[Message | BulkMessage, list[zmq.Frame]]:
        """The next readable message on `socket` and its frames (the first is the message);
        an unreadable one is logged (as from `where`) and skipped."""
        while True:
            if self._closed.is_set():
                raise PeerUnavailable("client closed")
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise TransferTimeout(f"no complete answer from {address} in time")
            if not socket.poll(min(remaining_ms, self.POLL_SLICE_MS), zmq.POLLIN):
                continue
            frames = socket.recv_multipart(copy=False)
            try:
                return codec.decode(frames[0].buffer), frames
            except WireError as exc:
                log.warning("unreadable reply from %s: %s", where, exc)

    def _codec(self) -> WireCodec:
        codec = getattr(self._per_thread, "codec", None)
        if codec is None:  # msgspec encoders and decoders must not be shared between threads
            codec = self._per_thread.codec = WireCodec(self._sockets.max_message_bytes)
        return codec

    def _bulk_codec(self) -> WireCodec:
        codec = getattr(self._per_thread, "bulk_codec", None)
        if codec is None:
            codec = self._per_thread.bulk_codec = WireCodec(self._sockets.max_message_bytes, BulkMessage)
        return codec

    @staticmethod
    def _reset(link: _DirectLink) -> None:
        for socket in (link.socket, link.bulk_socket):
            if socket is not None:
                socket.close(linger=0)
        link.socket = link.bulk_socket = link.bulk_address = None
        link.peer = None
