"""The protocol state of one pull (`PullState`), whichever thread drives its sockets.

Fed each reply of the owner (on its connection, or its bulk channel: `engine.data.bulk`), a
`PullState` answers with the requests to send next, raises a `TransferError`, or sets `result`.
`engine.data.client.ZmqClient` drives it from its I/O thread or from a blocking caller's.

A pull with a `sink` (a blocking caller's `ZmqClient.fetch_to`) hands each TCP chunk to it as it
arrives (its offset and the received frame's bytes, MAC checked first on a `mac` plane) instead of
copying it into a buffer of the whole tensor: the caller puts the bytes where they belong with
one copy (a KV pull: straight into its store's pages), overlapped with the chunks still on the
wire. `align` rounds the chunk size down to a multiple (a KV page), so a chunk holds whole pages.
A chunk may come in several frames (an owner serving pages lent from its KV store's slots
sends one per run of adjacent slots): the sink gets each at its offset.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import zmq

from engine.data import cuda_ipc
from engine.data.bulk import copy_parts_intact, parts_tag
from engine.data.channel import RemoteError, TransportUnavailable, remote_error
from engine.data.codec import TensorData, WireError, check_header, contiguous_strides
from engine.data.curve import BulkMode
from engine.data.shm import SegmentError, SegmentMapper
from engine.data.wire import (
    BulkChunkReply,
    BulkChunkRequest,
    BulkGrant,
    BulkMessage,
    ChunkReply,
    ChunkRequest,
    CudaIpcHandle,
    ErrorCode,
    ErrorReply,
    Message,
    PullReply,
    PullRequest,
    TensorHeader,
    TensorRef,
    Transport,
)

Outgoing = Message | BulkChunkRequest
"""A request a pull sends: on the owner's connection, or (a `BulkChunkRequest`) its bulk channel."""

ChunkSink = Callable[[int, memoryview], None]
"""Takes the bytes of a TCP pull's chunk at an offset (a view of the received frame, valid during the call)."""


@dataclass(slots=True, eq=False)
class OwnerInfo:
    """What an owner told us in its `HelloReply`."""

    host: str
    max_chunk: int
    shm_ok: bool = True
    cuda_ok: bool = True


@dataclass(slots=True, eq=False)
class PullState:
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
    bulk: BulkMode | None = None  # ask for the owner's bulk channel for TCP bytes (`mac`: insist on MACs)
    grant: BulkGrant | None = None  # given: the chunks are BulkChunkRequests to `grant.address`
    sink: ChunkSink | None = None  # TCP chunks go here, not into `dest`
    align: int = 1  # the chunk size is a multiple of this where the owner's limit allows
    sunk: bool = False  # every byte went to `sink`: done, without a `result`

    @property
    def finished(self) -> bool:
        return self.result is not None or self.sunk

    def start(self, peer: OwnerInfo, host: str, chunk_bytes: int) -> list[Outgoing]:
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
        self._chunking(peer, chunk_bytes)
        return [PullRequest(self.request_id, self.ref.id, transports, bulk=self.bulk is not None and Transport.TCP in transports)]

    def start_granted(self, peer: OwnerInfo, chunk_bytes: int, grant: BulkGrant) -> list[Outgoing]:
        """Start past the `PullRequest`: the owner granted this ref's bytes over its bulk channel
        already, in another reply on the CURVE connection (a `KVFetchReply`), so the chunks are
        asked at once."""
        if self.bulk is None:
            raise RemoteError(ErrorCode.BAD_REQUEST, "a bulk grant on a plane without the bulk channel")
        if self.bulk is BulkMode.MAC and not grant.key:
            raise RemoteError(ErrorCode.BAD_REQUEST, "a bulk grant without a MAC key on a `mac` plane")
        header = TensorHeader(self.ref.dtype, self.ref.shape, contiguous_strides(self.ref.shape), self.ref.nbytes)
        try:
            check_header(header)
        except WireError as exc:
            raise RemoteError(ErrorCode.MALFORMED, str(exc)) from exc
        self._chunking(peer, chunk_bytes)
        self.header = header
        self.grant = grant
        return self._tcp_start()

    def _chunking(self, peer: OwnerInfo, chunk_bytes: int) -> None:
        self.chunk = max(1, min(chunk_bytes, peer.max_chunk or chunk_bytes))
        if self.align > 1 and self.chunk >= self.align:
            self.chunk -= self.chunk % self.align

    def _tcp_start(self) -> list[Outgoing]:
        assert self.header is not None
        if self.header.nbytes == 0:
            self.result = TensorData(self.header, np.empty(0, np.uint8), Transport.TCP)
            return []
        if self.sink is None:
            self.dest = np.empty(self.header.nbytes, np.uint8)
        return [r for r in (self._next_chunk() for _ in range(self.window)) if r is not None]

    def on_reply(self, message: Message | BulkMessage, frames: list[zmq.Frame]) -> list[Outgoing]:
        if isinstance(message, ErrorReply):
            raise remote_error(message)
        if isinstance(message, PullReply):
            return self._on_pull_reply(message, frames)
        if isinstance(message, ChunkReply | BulkChunkReply):
            return self._on_chunk(message, frames)
        raise RemoteError(ErrorCode.BAD_REQUEST, f"unexpected {type(message).__name__}")

    def _on_pull_reply(self, reply: PullReply, frames: list[zmq.Frame]) -> list[Outgoing]:
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
        if reply.bulk is not None and (reply.transport is not Transport.TCP or self.bulk is None):
            raise RemoteError(ErrorCode.BAD_REQUEST, f"a bulk grant not asked for, with a {reply.transport} reply")
        if reply.bulk is not None and self.bulk is BulkMode.MAC and not reply.bulk.key:
            raise RemoteError(ErrorCode.BAD_REQUEST, "a bulk grant without a MAC key on a `mac` plane")
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
            self.grant = reply.bulk
            return self._tcp_start()
        raise TransportUnavailable(f"the owner offered {reply.transport}, which was not asked for")

    def _open_cuda(self, shared: CudaIpcHandle, header: TensorHeader) -> list[Outgoing]:
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

    def _next_chunk(self) -> ChunkRequest | BulkChunkRequest | None:
        assert self.header is not None
        if self.next_offset >= self.header.nbytes:
            return None
        length = min(self.chunk, self.header.nbytes - self.next_offset)
        request: ChunkRequest | BulkChunkRequest
        if self.grant is None:
            request = ChunkRequest(self.request_id, self.ref.id, self.next_offset, length)
        else:
            request = BulkChunkRequest(self.request_id, self.grant.token, self.ref.id, self.next_offset, length)
        self.outstanding.add(self.next_offset)
        self.next_offset += length
        return request

    def _on_chunk(self, reply: ChunkReply | BulkChunkReply, frames: list[zmq.Frame]) -> list[Outgoing]:
        if self.header is None or (self.dest is None and self.sink is None):
            raise RemoteError(ErrorCode.MALFORMED, "a chunk before the pull reply")
        buffers = [frame.buffer for frame in frames]  # one, or one per buffer the owner sends it from
        if reply.offset not in self.outstanding or not buffers or sum(len(b) for b in buffers) != reply.length:
            raise RemoteError(ErrorCode.MALFORMED, f"unexpected chunk at offset {reply.offset}")
        if (self.grant is None) != isinstance(reply, ChunkReply):
            raise RemoteError(ErrorCode.MALFORMED, f"a {type(reply).__name__} on the wrong channel")
        key = self.grant.key if isinstance(reply, BulkChunkReply) and self.grant is not None else b""
        if self.sink is not None:
            if key and not hmac.compare_digest(parts_tag(key, self.ref.id, reply.offset, buffers), reply.tag):
                raise _altered(reply.offset)
            offset = reply.offset
            for data in buffers:
                self.sink(offset, data)
                offset += len(data)
        else:
            assert self.dest is not None
            dest = self.dest[reply.offset : reply.offset + reply.length]
            if key:
                if not copy_parts_intact(key, self.ref.id, reply.offset, buffers, reply.tag, dest):
                    raise _altered(reply.offset)
            else:
                at = 0
                for data in buffers:
                    dest[at : at + len(data)] = np.frombuffer(data, np.uint8)
                    at += len(data)
        self.outstanding.discard(reply.offset)
        self.received += reply.length
        if self.received == self.header.nbytes:
            if self.dest is None:
                self.sunk = True
            else:
                self.result = TensorData(self.header, self.dest, Transport.TCP)
            return []
        request = self._next_chunk()
        return [] if request is None else [request]


def _altered(offset: int) -> RemoteError:
    return RemoteError(ErrorCode.MALFORMED, f"the chunk at offset {offset} fails its MAC: altered on its way"
                                            " from the owner")


def release_discarded(message: Message) -> None:
    """A pull reply this client will not use: give back the CUDA reference its handle counted
    (else the owner's GPU block stays allocated until the owner exits)."""
    if isinstance(message, PullReply) and message.cuda is not None and cuda_ipc.available():
        cuda_ipc.release_unopened(message.cuda)


