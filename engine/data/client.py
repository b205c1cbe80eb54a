"""The consumer side of the wire: `ZmqClient`.

`ZmqClient` pulls from any number of owners: one I/O thread owning one DEALER socket per
owner carries `Transfer`s (many at a time, what asyncio callers use), and blocking calls
drive a connection of their own in the caller's thread (two thread hand-offs fewer per
round trip); a same-host ref is read straight from the owner's segment while its generation
word says the segment still holds it (no round trip).
On the authenticated plane, unless its `BulkMode` is `encrypted`, a TCP pull asks for the owner's
bulk channel: the chunks come over a plain socket of the owner's under a one-time grant
(`engine.data.bulk`), in `mac` mode each checked against its MAC as it is copied.
`engine.data.peer.Peer` bundles it with a tensor server.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from engine.data.channel import (
    PeerUnavailable,
    Transfer,
    TransferError,
    TransferTimeout,
    remote_error,
)
from engine.data.codec import Limits, MiB, TensorData, WireCodec, WireError, check_header, contiguous_strides
from engine.data.curve import BulkMode, PlaneKeys, connect_as_client
from engine.data.pulls import ChunkSink, Outgoing, OwnerInfo, PullState, release_discarded
from engine.data.shm import SegmentError, SegmentMapper, host_id, parse_segment_name
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
    TensorHeader,
    TensorRef,
    Transport,
)

log = logging.getLogger(__name__)


class _HandshakeLost(Exception):
    """The owner answered HANDSHAKE_REQUIRED: it no longer knows this connection."""


@dataclass(frozen=True, slots=True)
class ClientConfig:
    chunk_bytes: int = 8 * MiB
    window: int = 4  # chunks requested ahead per transfer: the credit the owner may use
    max_mapped_bytes: int = 1 << 30  # cached read-only mappings of other processes' segments
    limits: Limits = Limits()


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


@dataclass(slots=True, eq=False)
class _DirectLink:
    """A connection used by the thread that holds `lock`, for blocking calls."""

    address: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    socket: zmq.Socket | None = None
    peer: OwnerInfo | None = None
    bulk_address: str | None = None
    bulk_socket: zmq.Socket | None = None  # to the owner's bulk channel, once a grant named it


class ZmqClient:
    """The consumer side of the wire: pulls and control calls to any number of owners.

    Two ways to drive a request, same protocol:
    * `pull` / `call` return a `Transfer` at once and let the client's I/O thread move the
      bytes (many transfers at a time; what an asyncio caller wants).
    * `fetch` / `request` block the calling thread and drive a connection of their own, which
      saves two thread hand-offs per round trip (what a plain synchronous consumer wants).
      Blocking calls to one owner from several threads take turns.
    Either way, a same-host ref whose segment still holds it (see `ShmLocation`) is read in
    place with no request at all; otherwise the owner is asked.
    `close()` stops the I/O thread and fails what it still carries with `PeerUnavailable`."""

    def __init__(
        self,
        config: ClientConfig | None = None,
        *,
        context: zmq.Context | None = None,
        host: str | None = None,
        name: str | None = None,
        keys: PlaneKeys | None = None,
    ) -> None:
        """`keys`: connect to owners as a CURVE client of the plane (`engine.data.curve`); None: plaintext."""
        self.config = config or ClientConfig()
        self._keys = keys
        self._bulk = None if keys is None or not keys.bulk.bulk_channel else keys.bulk
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
        self._mapper = SegmentMapper(max_bytes=self.config.max_mapped_bytes)  # thread-safe
        self._direct: dict[str, _DirectLink] = {}
        self._direct_lock = threading.Lock()
        self._per_thread = threading.local()
        self._shm_refused: set[str] = set()  # owners whose segments this process cannot map
        # State below is touched by the I/O thread only.
        self._codec = WireCodec(self.config.limits.hard_max_message_bytes)
        self._links: dict[str, _Link] = {}
        self._by_socket: dict[zmq.Socket, _Link] = {}
        self._bulk_sockets: dict[str, zmq.Socket] = {}  # owners' bulk channels, by address
        self._bulk_by_socket: dict[zmq.Socket, str] = {}
        self._bulk_codec = WireCodec(self.config.limits.hard_max_message_bytes, BulkMessage)
        self._ops: dict[int, _Op] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name=f"omniflow-{self.name}", daemon=True)
        self._thread.start()

    # --- API (any thread) ----------------------------------------------------------------------

    def pull(self, ref: TensorRef, transports: tuple[Transport, ...], timeout: float) -> Transfer:
        """Start pulling `ref` from its owner, accepting `transports` (best first)."""
        transfer = Transfer(ref, time.monotonic() + timeout)
        in_place = self._read_in_place(ref, transports)
        if in_place is not None:
            transfer._finish(in_place)
            return transfer
        pull = PullState(ref, transports, 0, self._mapper, self.config.window, bulk=self._bulk)
        self._submit(_Op(transfer, ref.owner, transfer.deadline, pull=pull))
        return transfer

    def _read_in_place(self, ref: TensorRef, transports: tuple[Transport, ...]) -> TensorData | None:
        """The tensor straight from the owner's segment, without a round trip, when the ref says
        where it is, its lease runs and the segment still holds it (its generation word matches);
        None otherwise, and the owner is asked instead."""
        location = ref.shm
        if (
            location is None
            or Transport.SHM not in transports
            or ref.host != self.host
            or ref.owner in self._shm_refused
            or ref.lease_expires_at <= time.time()
            or location.offset < 8
            or location.offset + ref.nbytes > location.size
        ):
            return None
        owner = parse_segment_name(location.segment)
        if owner is None or not owner.alive():
            return None  # a dead owner is an error, which the owner's silence will tell
        try:
            mapping = self._mapper.map(location.segment, location.size)
        except (SegmentError, OSError):
            self._shm_refused.add(ref.owner)  # not our /dev/shm after all: the owner decides
            return None
        if int.from_bytes(mapping[:8], "little") != location.generation:
            return None  # released, maybe recycled: only the owner can tell
        header = TensorHeader(ref.dtype, ref.shape, contiguous_strides(ref.shape), ref.nbytes, location.offset)
        try:
            check_header(header)
        except WireError:
            return None
        return TensorData(header, mapping, Transport.SHM)

    def call(self, address: str, message: Callable[[int], Message], timeout: float) -> Transfer:
        """Send the control request built by `message(request_id)`; the handle's result is the
        reply (an `ErrorReply` fails it with the matching `TransferError`)."""
        handle = Transfer(None, time.monotonic() + timeout)
        self._submit(_Op(handle, address, handle.deadline, message=message))
        return handle

    def fetch(self, ref: TensorRef, transports: tuple[Transport, ...], timeout: float) -> TensorData:
        """Pull `ref` in the calling thread; returns by `timeout` or raises a `TransferError`."""
        data = self._fetch(ref, transports, timeout, None, 1)
        assert data is not None
        return data

    def fetch_to(self, ref: TensorRef, transports: tuple[Transport, ...], timeout: float, sink: ChunkSink,
                 align: int = 1, chunk_bytes: int | None = None) -> TensorData | None:
        """`fetch`, but bytes that come as TCP chunks go to `sink` as each arrives (see
        `engine.data.pulls`), in chunks of a multiple of `align` bytes where the owner allows:
        returns None then. Bytes readable in place (shared memory, CUDA IPC, an inline reply)
        are returned as `fetch` returns them, and `sink` is not called. `chunk_bytes`: see
        `_chunks`."""
        if align < 1:
            raise ValueError(f"align must be positive, got {align}")
        return self._fetch(ref, transports, timeout, sink, align, chunk_bytes)

    def _chunks(self, chunk_bytes: int | None) -> tuple[int, int]:
        """The chunk size and window of a pull: the config's, or chunks of `chunk_bytes` (at most
        the config's) with a window that keeps as many bytes asked ahead as the config's does.
        Smaller chunks suit a sink: it starts on the first bytes sooner, and the last chunk's
        bytes, which it handles with nothing left on the wire, are fewer."""
        if chunk_bytes is None:
            return self.config.chunk_bytes, self.config.window
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        chunk = min(chunk_bytes, self.config.chunk_bytes)
        ahead = self.config.chunk_bytes * self.config.window
        return chunk, max(self.config.window, -(-ahead // chunk))

    def _fetch(self, ref: TensorRef, transports: tuple[Transport, ...], timeout: float, sink: ChunkSink | None,
               align: int, chunk_bytes: int | None = None) -> TensorData | None:
        in_place = self._read_in_place(ref, transports)
        if in_place is not None:
            return in_place
        chunk, window = self._chunks(chunk_bytes)

        def drive(link: _DirectLink, deadline: float) -> TensorData | None:
            assert link.peer is not None
            pull = PullState(ref, transports, next(self._request_ids), self._mapper, window,
                             bulk=self._bulk, sink=sink, align=align)
            return self._drive(link, pull, pull.start(link.peer, self.host, chunk), deadline)

        return self._with_direct(ref.owner, timeout, drive)

    def fetch_granted(self, ref: TensorRef, grant: BulkGrant, timeout: float, sink: ChunkSink | None = None,
                      align: int = 1, chunk_bytes: int | None = None) -> TensorData | None:
        """Pull `ref` over its owner's bulk channel under `grant`, which the owner gave in another
        reply (a `KVFetchReply`): no `PullRequest` round trip. As `fetch_to` with `sink` (None
        returned), as `fetch` without."""
        if align < 1:
            raise ValueError(f"align must be positive, got {align}")
        chunk, window = self._chunks(chunk_bytes)

        def drive(link: _DirectLink, deadline: float) -> TensorData | None:
            assert link.peer is not None
            pull = PullState(ref, (Transport.TCP,), next(self._request_ids), self._mapper, window,
                             bulk=self._bulk, sink=sink, align=align)
            return self._drive(link, pull, pull.start_granted(link.peer, chunk, grant), deadline)

        return self._with_direct(ref.owner, timeout, drive)

    @property
    def bulk_mode(self) -> BulkMode | None:
        """How TCP bytes travel on this plane: over owners' bulk channels (`clear`, `mac`), or
        None: inside the connection (plaintext, or `encrypted`)."""
        return self._bulk

    def owner_host(self, address: str) -> str | None:
        """The host the owner at `address` named when this client's blocking calls greeted it
        (None: not greeted yet)."""
        with self._direct_lock:
            link = self._direct.get(address)
        peer = None if link is None else link.peer
        return None if peer is None else peer.host

    def _drive(self, link: _DirectLink, pull: PullState, requests: list[Outgoing],
               deadline: float) -> TensorData | None:
        """Send a pull's first requests, then feed it replies until it is done."""
        assert link.peer is not None
        self._direct_send(link, requests, deadline, pull.grant)
        while not pull.finished:
            if pull.grant is None:
                message, frames = self._direct_reply(link, pull.request_id, deadline)
            else:
                message, frames = self._direct_bulk_reply(link, pull.request_id, deadline)
            requests = pull.on_reply(message, frames)
            if pull.shm_failed:
                link.peer.shm_ok = False
            if pull.cuda_failed:
                link.peer.cuda_ok = False
            self._direct_send(link, requests, deadline, pull.grant)
        return pull.result

    def request(self, address: str, message: Callable[[int], Message], timeout: float) -> Message:
        """`call`, blocking in the calling thread; returns the reply."""

        def drive(link: _DirectLink, deadline: float) -> Message:
            request_id = next(self._request_ids)
            self._direct_send(link, [message(request_id)], deadline)
            reply, _frames = self._direct_reply(link, request_id, deadline)
            if isinstance(reply, ErrorReply):
                raise remote_error(reply)
            return reply

        return self._with_direct(address, timeout, drive)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(timeout=5.0)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        with self._direct_lock:
            links = list(self._direct.values())
            self._direct.clear()
        for link in links:
            # A blocking call in progress notices `_closed` within one poll slice.
            if link.lock.acquire(timeout=1.0):
                self._reset_direct(link)
                link.lock.release()
        self._mapper.clear()
        if self._own_context:
            self._context.term()

    def __enter__(self) -> ZmqClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- blocking calls (caller's thread) ----------------------------------------------------------

    _POLL_SLICE_MS = 100  # how often a blocking call checks that the client is still open

    def _with_direct(self, address: str, timeout: float, drive: Callable[[_DirectLink, float], Any]) -> Any:
        deadline = time.monotonic() + timeout
        with self._direct_lock:
            if self._closed:
                raise PeerUnavailable("client is closed")
            link = self._direct.setdefault(address, _DirectLink(address))
        if not link.lock.acquire(timeout=max(timeout, 0.0)):
            raise TransferTimeout(f"the connection to {address} stayed busy for {timeout}s")
        try:
            if link.socket is None:
                link.socket = self._new_socket(address)
            for _attempt in range(2):
                if link.peer is None:
                    self._direct_hello(link, deadline)
                try:
                    return drive(link, deadline)
                except _HandshakeLost:
                    continue  # the owner forgot us (we were idle, or it restarted): greet it again, once
            raise PeerUnavailable(f"{address} keeps refusing requests after a handshake")
        except (TransferTimeout, PeerUnavailable):
            self._reset_direct(link)  # replies may still be queued for it: start over next time
            raise
        finally:
            if self._closed:
                self._reset_direct(link)
            link.lock.release()

    def _direct_hello(self, link: _DirectLink, deadline: float) -> None:
        self._direct_send(link, [HelloRequest(PROTOCOL_VERSION, self.name, self.host)], deadline)
        try:
            reply, _frames = self._direct_reply(link, None, deadline)
        except TransferTimeout as exc:
            raise PeerUnavailable(f"no answer from {link.address}") from exc
        if isinstance(reply, ErrorReply):
            raise PeerUnavailable(f"{link.address} refused the handshake: {reply.message}")
        if not isinstance(reply, HelloReply) or reply.protocol_version != PROTOCOL_VERSION:
            raise PeerUnavailable(f"{link.address} answered the handshake with {reply!r}")
        link.peer = OwnerInfo(reply.host, reply.max_chunk_bytes)

    def _direct_send(self, link: _DirectLink, messages: list[Outgoing], deadline: float,
                     grant: BulkGrant | None = None) -> None:
        assert link.socket is not None
        for message in messages:
            if isinstance(message, BulkChunkRequest):
                assert grant is not None
                if link.bulk_socket is None or link.bulk_address != grant.address:
                    if link.bulk_socket is not None:
                        link.bulk_socket.close(linger=0)
                    link.bulk_socket, link.bulk_address = self._new_bulk_socket(grant.address), grant.address
                self._direct_put(link.bulk_socket, grant.address, self._bulk_codec_for_thread().encode(message),
                                 deadline)
            else:
                self._direct_put(link.socket, link.address, self._codec_for_thread().encode(message), deadline)

    def _direct_put(self, socket: zmq.Socket, address: str, data: bytes, deadline: float) -> None:
        """Send, waiting for room at most until `deadline`: a DEALER with no connection (its peer
        refused our handshake, or is gone and not back) would block a plain send forever."""
        while True:
            try:
                socket.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            if self._closed:
                raise PeerUnavailable("client closed")
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise PeerUnavailable(f"no connection to {address} to send on (it refused our handshake,"
                                      " or is gone)")
            socket.poll(min(remaining_ms, self._POLL_SLICE_MS), zmq.POLLOUT)

    def _direct_bulk_reply(self, link: _DirectLink, request_id: int,
                           deadline: float) -> tuple[Message | BulkMessage, list[zmq.Frame]]:
        """The next reply to `request_id` on the owner's bulk channel; stale ones are skipped."""
        assert link.bulk_socket is not None
        codec = self._bulk_codec_for_thread()
        where = f"the bulk channel of {link.address}"
        while True:
            message, frames = self._direct_message(link.bulk_socket, codec, link.address, where, deadline)
            if getattr(message, "request_id", None) == request_id:
                return message, frames[1:]

    def _direct_message(self, socket: zmq.Socket, codec: WireCodec, address: str, where: str,
                        deadline: float) -> tuple[Message | BulkMessage, list[zmq.Frame]]:
        """The next readable message on `socket` and its frames (the first is the message);
        an unreadable one is logged (as from `where`) and skipped."""
        while True:
            if self._closed:
                raise PeerUnavailable("client closed")
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise TransferTimeout(f"no complete answer from {address} in time")
            if not socket.poll(min(remaining_ms, self._POLL_SLICE_MS), zmq.POLLIN):
                continue
            frames = socket.recv_multipart(copy=False)
            try:
                return codec.decode(frames[0].buffer), frames
            except WireError as exc:
                log.warning("unreadable reply from %s: %s", where, exc)

    def _direct_reply(
        self, link: _DirectLink, request_id: int | None, deadline: float
    ) -> tuple[Message, list[zmq.Frame]]:
        """The next reply to `request_id` (None: the handshake); stale replies are skipped."""
        assert link.socket is not None
        codec = self._codec_for_thread()
        while True:
            message, frames = self._direct_message(link.socket, codec, link.address, link.address, deadline)
            got = getattr(message, "request_id", None)
            if isinstance(message, ErrorReply) and message.code == ErrorCode.HANDSHAKE_REQUIRED:
                link.peer = None
                raise _HandshakeLost(link.address)
            if got == request_id or (request_id is None and isinstance(message, HelloReply | ErrorReply)):
                return message, frames[1:]
            release_discarded(message)  # a stale answer to a pull that already ended

    def _codec_for_thread(self) -> WireCodec:
        codec = getattr(self._per_thread, "codec", None)
        if codec is None:  # msgspec encoders and decoders must not be shared between threads
            codec = self._per_thread.codec = WireCodec(self.config.limits.hard_max_message_bytes)
        return codec

    def _bulk_codec_for_thread(self) -> WireCodec:
        codec = getattr(self._per_thread, "bulk_codec", None)
        if codec is None:
            codec = self._per_thread.bulk_codec = WireCodec(self.config.limits.hard_max_message_bytes, BulkMessage)
        return codec

    def _reset_direct(self, link: _DirectLink) -> None:
        for socket in (link.socket, link.bulk_socket):
            if socket is not None:
                socket.close(linger=0)
        link.socket = link.bulk_socket = link.bulk_address = None
        link.peer = None

    def _new_socket(self, address: str) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(12))
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self.config.limits.hard_max_message_bytes)
        connect_as_client(socket, self._keys)
        socket.connect(address)
        return socket

    def _new_bulk_socket(self, address: str) -> zmq.Socket:
        """A plain connection to an owner's bulk channel: what it admits is each request's
        grant, which only the CURVE connection handed out (`engine.data.bulk`)."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self.config.limits.hard_max_message_bytes)
        socket.connect(address)
        return socket

    # --- the I/O thread ---------------------------------------------------------------------------

    def _submit(self, op: _Op) -> None:
        if self._closed:
            op.handle._finish(error=PeerUnavailable("client is closed"))
            return
        self._commands.append(op)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

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
                    elif socket in self._bulk_by_socket:
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
        socket = self._new_socket(address)
        link = _Link(address, socket)
        self._links[address] = link
        self._by_socket[socket] = link
        self._poller.register(socket, zmq.POLLIN)
        self._send(link, [HelloRequest(PROTOCOL_VERSION, self.name, self.host)])
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
                    self._bulk_socket(grant.address).send(self._bulk_codec.encode(message), zmq.NOBLOCK)
                else:
                    link.socket.send(self._codec.encode(message), zmq.NOBLOCK)
            except zmq.Again:
                self._fail_link(link, PeerUnavailable(f"no connection to {link.address} to send on (it refused"
                                                      " our handshake, or is gone)"))
                return

    def _bulk_socket(self, address: str) -> zmq.Socket:
        socket = self._bulk_sockets.get(address)
        if socket is None:
            socket = self._bulk_sockets[address] = self._new_bulk_socket(address)
            self._bulk_by_socket[socket] = address
            self._poller.register(socket, zmq.POLLIN)
        return socket

    def _drain_bulk(self, socket: zmq.Socket) -> None:
        address = self._bulk_by_socket[socket]
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                message = self._bulk_codec.decode(frames[0].buffer)
            except WireError as exc:
                log.warning("unreadable reply from the bulk channel %s: %s", address, exc)
                continue
            request_id = getattr(message, "request_id", None)
            op = self._ops.get(request_id) if request_id is not None else None
            if op is None or op.pull is None or op.pull.grant is None or op.pull.grant.address != address:
                continue  # a late answer to a transfer that already ended
            assert op.link is not None
            self._advance(op.link, op, message, frames[1:])

    def _send_first(self, op: _Op) -> None:
        assert op.link is not None and op.link.peer is not None
        self._ops[op.request_id] = op
        if op.message is not None:
            self._send(op.link, [op.message(op.request_id)])
            return
        assert op.pull is not None
        try:
            requests = op.pull.start(op.link.peer, self.host, self.config.chunk_bytes)
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
            op.pull = PullState(op.pull.ref, op.pull.accepted, op.request_id, self._mapper, self.config.window,
                            bulk=self._bulk)
        link.waiting.append(op)
        if link.peer is not None:
            link.peer = None
            self._send(link, [HelloRequest(PROTOCOL_VERSION, self.name, self.host)])

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
        for socket in self._bulk_by_socket:
            self._poller.unregister(socket)
            socket.close(linger=0)
        self._bulk_sockets.clear()
        self._bulk_by_socket.clear()
