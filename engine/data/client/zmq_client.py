"""`ZmqClient`: the consumer side's public face, one object per process or plane.

It owns what both of its paths share (the config, this process's host and name, the ZeroMQ
context, the `SegmentMapper` of other processes' segments, the request ids and the `closed`
event) and turns each call into work for one of them:
* a same-host ref whose segment still holds it is read in place (`in_place.InPlaceReader`);
* `pull` / `call` hand an op to the I/O thread (`loop.IOLoop`) and return its `Transfer` at once;
* `fetch`, `fetch_to`, `fetch_granted` and `request` block, driving a link of their own in the
  caller's thread (`direct.DirectLinks`).
`close()` sets `closed`, stops the I/O thread (which fails what it carries) and closes the
blocking calls' links, then the mappings and a context of its own.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import time
from collections.abc import Callable

import zmq

from engine.data.channel import Transfer
from engine.data.client.config import ClientConfig
from engine.data.client.direct import DirectLinks
from engine.data.client.in_place import InPlaceReader
from engine.data.client.loop import IOLoop
from engine.data.client.sockets import OwnerSockets
from engine.data.codec import TensorData
from engine.data.curve import BulkMode, PlaneKeys
from engine.data.pulls import ChunkSink, Outgoing, OwnerInfo, PullState
from engine.data.shm import SegmentMapper, host_id
from engine.data.wire import PROTOCOL_VERSION, BulkGrant, HelloRequest, Message, TensorRef, Transport


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
        self._bulk = None if keys is None or not keys.bulk.bulk_channel else keys.bulk
        self.host = host or host_id()
        self.name = name or f"client-{os.getpid()}-{secrets.token_hex(4)}"
        self._own_context = context is None
        self._context = context or zmq.Context(io_threads=1)
        self._request_ids = itertools.count(1)
        self._closed = threading.Event()
        self._mapper = SegmentMapper(max_bytes=self.config.max_mapped_bytes)  # thread-safe
        self._in_place = InPlaceReader(self.host, self._mapper)
        sockets = OwnerSockets(self._context, self.config.limits.hard_max_message_bytes, keys)
        hello = HelloRequest(PROTOCOL_VERSION, self.name, self.host)
        self._direct = DirectLinks(sockets, hello, self._request_ids, self._closed)
        self._loop = IOLoop(self.config, sockets, hello=hello, mapper=self._mapper, bulk=self._bulk,
                            request_ids=self._request_ids, closed=self._closed)

    def pull(self, ref: TensorRef, transports: tuple[Transport, ...], timeout: float) -> Transfer:
        """Start pulling `ref` from its owner, accepting `transports` (best first)."""
        transfer = Transfer(ref, time.monotonic() + timeout)
        in_place = self._in_place.read(ref, transports)
        if in_place is not None:
            transfer._finish(in_place)
            return transfer
        self._loop.submit_pull(transfer, PullState(ref, transports, 0, self._mapper, self.config.window,
                                                   bulk=self._bulk))
        return transfer

    def call(self, address: str, message: Callable[[int], Message], timeout: float) -> Transfer:
        """Send the control request built by `message(request_id)`; the handle's result is the
        reply (an `ErrorReply` fails it with the matching `TransferError`)."""
        handle = Transfer(None, time.monotonic() + timeout)
        self._loop.submit_call(handle, address, message)
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
        in_place = self._in_place.read(ref, transports)
        if in_place is not None:
            return in_place
        chunk, window = self._chunks(chunk_bytes)

        def start(peer: OwnerInfo, request_id: int) -> tuple[PullState, list[Outgoing]]:
            pull = PullState(ref, transports, request_id, self._mapper, window, bulk=self._bulk, sink=sink,
                             align=align)
            return pull, pull.start(peer, self.host, chunk)

        return self._direct.pull(ref.owner, timeout, start)

    def fetch_granted(self, ref: TensorRef, grant: BulkGrant, timeout: float, sink: ChunkSink | None = None,
                      align: int = 1, chunk_bytes: int | None = None) -> TensorData | None:
        """Pull `ref` over its owner's bulk channel under `grant`, which the owner gave in another
        reply (a `KVFetchReply`): no `PullRequest` round trip. As `fetch_to` with `sink` (None
        returned), as `fetch` without."""
        if align < 1:
            raise ValueError(f"align must be positive, got {align}")
        chunk, window = self._chunks(chunk_bytes)

        def start(peer: OwnerInfo, request_id: int) -> tuple[PullState, list[Outgoing]]:
            pull = PullState(ref, (Transport.TCP,), request_id, self._mapper, window, bulk=self._bulk, sink=sink,
                             align=align)
            return pull, pull.start_granted(peer, chunk, grant)

        return self._direct.pull(ref.owner, timeout, start)

    def request(self, address: str, message: Callable[[int], Message], timeout: float) -> Message:
        """`call`, blocking in the calling thread; returns the reply."""
        return self._direct.request(address, message, timeout)

    @property
    def bulk_mode(self) -> BulkMode | None:
        """How TCP bytes travel on this plane: over owners' bulk channels (`clear`, `mac`), or
        None: inside the connection (plaintext, or `encrypted`)."""
        return self._bulk

    def owner_host(self, address: str) -> str | None:
        """The host the owner at `address` named when this client's blocking calls greeted it
        (None: not greeted yet)."""
        return self._direct.owner_host(address)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._loop.close()
        self._direct.close()
        self._mapper.clear()
        if self._own_context:
            self._context.term()

    def __enter__(self) -> ZmqClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
