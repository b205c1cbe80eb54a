"""The consumer side of the wire: `ZmqClient`.

`ZmqClient` pulls from any number of owners: one I/O thread owning one DEALER socket per
owner carries `Transfer`s (many at a time, what asyncio callers use), and blocking calls
drive a connection of their own in the caller's thread (two thread hand-offs fewer per
round trip); a same-host ref is read straight from the owner's segment while its generation
word says the segment still holds it (no round trip).
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
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from engine.data import cuda_ipc
from engine.data.channel import (
    PeerUnavailable,
    RemoteError,
    Transfer,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    remote_error,
)
from engine.data.codec import Limits, MiB, TensorData, WireCodec, WireError, check_header, contiguous_strides
from engine.data.curve import PlaneKeys, connect_as_client
from engine.data.shm import SegmentError, SegmentMapper, host_id, parse_segment_name
from engine.data.wire import (
    PROTOCOL_VERSION,
    ChunkReply,
    ChunkRequest,
    CudaIpcHandle,
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

if TYPE_CHECKING:
    pass

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
class _PeerInfo:
    """What an owner told us in its `HelloReply`."""

    host: str
    max_chunk: int
    shm_ok: bool = True
    cuda_ok: bool = True


@dataclass(slots=True, eq=False)
class _Pull:
    """The protocol state of one pull, whichever thread drives its socket: fed each reply,
    it answers with the requests to send next, raises a `TransferError`, or sets `result`."""

    ref: TensorRef
    accepted: tuple[Transport, ...]
    request_id: int
    mapper: SegmentMapper
    window: int
    chunk: int = 0
    header: TensorHeader | None = None
    dest: np.ndarray | None = None
    next_offset: int = 0
    received: int = 0
    outstanding: set[int] = field(default_factory=set)
    result: TensorData | None = None
    shm_failed: bool = False  # mapping failed: this owner's segments are not visible here
    cuda_failed: bool = False  # opening failed: this owner's GPU memory is not reachable from here

    def start(self, peer: _PeerInfo, host: str, chunk_bytes: int) -> list[Message]:
        transports = self.accepted
        if not (peer.shm_ok and peer.host == host):
            transports = tuple(t for t in transports if t is not Transport.SHM)
        # torch's reference counts of shared CUDA blocks live in /dev/shm: where the owner's is not
        # ours (shm_ok False), a mapping could never give its reference back.
        if not (peer.cuda_ok and peer.shm_ok and peer.host == host and cuda_ipc.available()):
            transports = tuple(t for t in transports if t is not Transport.CUDA_IPC)
        if not transports:
            raise TransportUnavailable(f"{self.ref.owner} is not on this host (or this process has no CUDA):"
                                       f" {', '.join(t.value for t in self.accepted)} impossible")
        self.chunk = max(1, min(chunk_bytes, peer.max_chunk or chunk_bytes))
        return [PullRequest(self.request_id, self.ref.id, transports)]

    def on_reply(self, message: Message, frames: list[zmq.Frame]) -> list[Message]:
        if isinstance(message, ErrorReply):
            raise remote_error(message)
        if isinstance(message, PullReply):
            return self._on_pull_reply(message, frames)
        if isinstance(message, ChunkReply):
            return self._on_chunk(message, frames)
        raise RemoteError(ErrorCode.BAD_REQUEST, f"unexpected {type(message).__name__}")

    def _on_pull_reply(self, reply: PullReply, frames: list[zmq.Frame]) -> list[Message]:
        header = reply.header
        try:
            check_header(header)
        except WireError as exc:
            release_discarded(reply)
            raise RemoteError(ErrorCode.MALFORMED, str(exc)) from exc
        if header.nbytes != self.ref.nbytes or header.dtype != self.ref.dtype:
            release_discarded(reply)
            raise RemoteError(ErrorCode.BAD_REQUEST, "the owner describes another tensor than the ref")
        if reply.cuda is not None and (reply.transport is not Transport.CUDA_IPC
                                       or Transport.CUDA_IPC not in self.accepted):
            release_discarded(reply)
            raise RemoteError(ErrorCode.BAD_REQUEST, f"a CUDA IPC handle with a {reply.transport} reply")
        if reply.transport is Transport.CUDA_IPC and reply.cuda is not None:
            return self._open_cuda(reply.cuda, header)
        if reply.transport is Transport.INLINE:
            if len(frames) != 1 or len(frames[0].buffer) != header.nbytes:
                raise RemoteError(ErrorCode.MALFORMED, "inline reply without its bytes")
            data = np.frombuffer(frames[0].buffer, np.uint8).copy()  # small; private and writable
            self.result = TensorData(header, data, Transport.INLINE)
            return []
        if reply.transport is Transport.SHM and reply.segment is not None:
            try:
                if header.offset + header.nbytes > reply.segment_size:
                    raise SegmentError("tensor lies outside its segment")
                mapping = self.mapper.map(reply.segment, reply.segment_size)
            except (SegmentError, OSError) as exc:
                if Transport.TCP not in self.accepted:
                    raise TransportUnavailable(f"cannot map {reply.segment}: {exc}") from exc
                # Same host by name but not the same /dev/shm (containers): TCP from now on.
                self.shm_failed = True
                return [PullRequest(self.request_id, self.ref.id, (Transport.TCP, Transport.INLINE))]
            self.result = TensorData(header, mapping, Transport.SHM)
            return []
        if reply.transport is Transport.TCP:
            self.header = header
            if header.nbytes == 0:
                self.result = TensorData(header, np.empty(0, np.uint8), Transport.TCP)
                return []
            self.dest = np.empty(header.nbytes, np.uint8)
            return [r for r in (self._next_chunk() for _ in range(self.window)) if r is not None]
        raise TransportUnavailable(f"the owner offered {reply.transport}, which was not asked for")

    def _open_cuda(self, shared: CudaIpcHandle, header: TensorHeader) -> list[Message]:
        try:
            tensor = cuda_ipc.open_shared(shared, header)
        except (cuda_ipc.CudaIpcUnavailable, ValueError) as exc:  # nothing mapped: give its reference back
            cuda_ipc.release_unopened(shared)
            rest = tuple(t for t in self.accepted if t is not Transport.CUDA_IPC)
            if not rest:
                raise TransportUnavailable(f"cannot open the owner's CUDA memory: {exc}") from exc
            # Same host by name but not the same GPUs (containers, CUDA_VISIBLE_DEVICES): host
            # memory from now on.
            self.cuda_failed = True
            return [PullRequest(self.request_id, self.ref.id, rest)]
        self.result = TensorData(header, tensor, Transport.CUDA_IPC)
        return []

    def _next_chunk(self) -> ChunkRequest | None:
        assert self.header is not None
        if self.next_offset >= self.header.nbytes:
            return None
        length = min(self.chunk, self.header.nbytes - self.next_offset)
        request = ChunkRequest(self.request_id, self.ref.id, self.next_offset, length)
        self.outstanding.add(self.next_offset)
        self.next_offset += length
        return request

    def _on_chunk(self, reply: ChunkReply, frames: list[zmq.Frame]) -> list[Message]:
        if self.header is None or self.dest is None:
            raise RemoteError(ErrorCode.MALFORMED, "a chunk before the pull reply")
        if reply.offset not in self.outstanding or len(frames) != 1 or len(frames[0].buffer) != reply.length:
            raise RemoteError(ErrorCode.MALFORMED, f"unexpected chunk at offset {reply.offset}")
        self.outstanding.discard(reply.offset)
        self.dest[reply.offset : reply.offset + reply.length] = np.frombuffer(frames[0].buffer, np.uint8)
        self.received += reply.length
        if self.received == self.header.nbytes:
            self.result = TensorData(self.header, self.dest, Transport.TCP)
            return []
        request = self._next_chunk()
        return [] if request is None else [request]


def release_discarded(message: Message) -> None:
    """A pull reply this client will not use: give back the CUDA reference its handle counted
    (else the owner's GPU block stays allocated until the owner exits)."""
    if isinstance(message, PullReply) and message.cuda is not None and cuda_ipc.available():
        cuda_ipc.release_unopened(message.cuda)


@dataclass(slots=True, eq=False)
class _Link:
    """A connection owned by the I/O thread."""

    address: str
    socket: zmq.Socket
    peer: _PeerInfo | None = None  # None until the handshake is answered
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
    pull: _Pull | None = None
    message: Callable[[int], Message] | None = None
    link: _Link | None = None
    retried: bool = False  # resent once after the owner forgot our handshake


@dataclass(slots=True, eq=False)
class _DirectLink:
    """A connection used by the thread that holds `lock`, for blocking calls."""

    address: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    socket: zmq.Socket | None = None
    peer: _PeerInfo | None = None


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
        pull = _Pull(ref, transports, 0, self._mapper, self.config.window)
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
        in_place = self._read_in_place(ref, transports)
        if in_place is not None:
            return in_place

        def drive(link: _DirectLink, deadline: float) -> TensorData:
            assert link.peer is not None
            pull = _Pull(ref, transports, next(self._request_ids), self._mapper, self.config.window)
            self._direct_send(link, pull.start(link.peer, self.host, self.config.chunk_bytes))
            while pull.result is None:
                message, frames = self._direct_reply(link, pull.request_id, deadline)
                requests = pull.on_reply(message, frames)
                if pull.shm_failed:
                    link.peer.shm_ok = False
                if pull.cuda_failed:
                    link.peer.cuda_ok = False
                self._direct_send(link, requests)
            return pull.result

        return self._with_direct(ref.owner, timeout, drive)

    def request(self, address: str, message: Callable[[int], Message], timeout: float) -> Message:
        """`call`, blocking in the calling thread; returns the reply."""

        def drive(link: _DirectLink, deadline: float) -> Message:
            request_id = next(self._request_ids)
            self._direct_send(link, [message(request_id)])
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
        self._direct_send(link, [HelloRequest(PROTOCOL_VERSION, self.name, self.host)])
        try:
            reply, _frames = self._direct_reply(link, None, deadline)
        except TransferTimeout as exc:
            raise PeerUnavailable(f"no answer from {link.address}") from exc
        if isinstance(reply, ErrorReply):
            raise PeerUnavailable(f"{link.address} refused the handshake: {reply.message}")
        if not isinstance(reply, HelloReply) or reply.protocol_version != PROTOCOL_VERSION:
            raise PeerUnavailable(f"{link.address} answered the handshake with {reply!r}")
        link.peer = _PeerInfo(reply.host, reply.max_chunk_bytes)

    def _direct_send(self, link: _DirectLink, messages: list[Message]) -> None:
        assert link.socket is not None
        for message in messages:
            link.socket.send(self._codec_for_thread().encode(message))

    def _direct_reply(
        self, link: _DirectLink, request_id: int | None, deadline: float
    ) -> tuple[Message, list[zmq.Frame]]:
        """The next reply to `request_id` (None: the handshake); stale replies are skipped."""
        assert link.socket is not None
        codec = self._codec_for_thread()
        while True:
            if self._closed:
                raise PeerUnavailable("client closed")
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise TransferTimeout(f"no complete answer from {link.address} in time")
            if not link.socket.poll(min(remaining_ms, self._POLL_SLICE_MS), zmq.POLLIN):
                continue
            frames = link.socket.recv_multipart(copy=False)
            try:
                message = codec.decode(frames[0].buffer)
            except WireError as exc:
                log.warning("unreadable reply from %s: %s", link.address, exc)
                continue
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

    def _reset_direct(self, link: _DirectLink) -> None:
        if link.socket is not None:
            link.socket.close(linger=0)
        link.socket = None
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

    def _send(self, link: _Link, messages: list[Message]) -> None:
        for message in messages:
            link.socket.send(self._codec.encode(message))

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
        self._send(link, requests)
        if op.pull.result is not None:
            self._complete(op, op.pull.result)

    def _retry_after_hello(self, link: _Link, op: _Op) -> None:
        """The owner forgot our handshake (we were idle, or it restarted): greet it again and
        resend `op` from scratch, once. After a restart the ref is gone and says so."""
        op.retried = True
        self._ops.pop(op.request_id, None)
        if op.pull is not None:
            op.pull = _Pull(op.pull.ref, op.pull.accepted, op.request_id, self._mapper, self.config.window)
        link.waiting.append(op)
        if link.peer is not None:
            link.peer = None
            self._send(link, [HelloRequest(PROTOCOL_VERSION, self.name, self.host)])

    def _on_hello(self, link: _Link, reply: HelloReply) -> None:
        if reply.protocol_version != PROTOCOL_VERSION:
            self._fail_link(link, PeerUnavailable(f"the owner speaks protocol {reply.protocol_version}"))
            return
        link.peer = _PeerInfo(reply.host, reply.max_chunk_bytes)
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
