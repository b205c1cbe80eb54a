"""The owner side of the wire: a ZeroMQ ROUTER that lets other processes pull from a store.

`TensorServer` binds, creates the `TensorStore` whose refs carry its address, and serves
from one thread. Each connection must open with a `HelloRequest` of our protocol version;
any frame it cannot read (malformed, unknown type, oversized, out of order) gets an
`ErrorReply` and the server carries on serving everyone else. A pull goes by the transport that
`engine.data.transport_choice.choose_transport` picks among those it accepts. Tensor bytes leave as
zero-copy frames, tracked so that a released segment is not recycled while ZeroMQ still
reads it. The thread also sweeps expired leases every `sweep_interval_s` and reclaims dead
processes' segments every `reclaim_interval_s`.

On the authenticated plane, unless its `BulkMode` is `encrypted`, the server also binds a bulk socket
(`engine.data.bulk.BulkEndpoint`) on the same interface and serves it from the same thread: a
TCP pull that asks for it gets a one-time grant in its `PullReply` and fetches its chunks there,
outside CURVE.

Request types beyond the tensor protocol (e.g. `KVFetchRequest`, answered by
`engine.data.kv.pull.KVPageServer`) are served by handlers registered with
`TensorServer.register_handler`; without one, such a request is refused as UNSUPPORTED.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import zmq

from engine.data import cuda_ipc
from engine.data.bulk import GRANT_S, BulkEndpoint, drop_stalled, send_routed
from engine.data.codec import Limits, WireCodec, WireError
from engine.data.curve import BulkMode, PlaneGuard, PlaneKeys
from engine.data.ref_table import StoredTensor
from engine.data.store_memory import SendHandle
from engine.data.tensor_store import RefNotFound, StoreConfig, TensorStore
from engine.data.transport_choice import NoTransport, choose_transport
from engine.data.wire import (
    PROTOCOL_VERSION,
    BulkGrant,
    ChunkReply,
    ChunkRequest,
    ErrorCode,
    ErrorReply,
    HelloReply,
    HelloRequest,
    LeaseReply,
    LeaseRequest,
    Message,
    PingReply,
    PingRequest,
    PullReply,
    PullRequest,
    ReleaseReply,
    ReleaseRequest,
    StatsReply,
    StatsRequest,
    TensorRef,
    Transport,
)

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Message)  # a member of the Message union

# Requests the server answers itself; no handler may take them over.
_BUILTIN_REQUESTS: frozenset[type] = frozenset(
    {HelloRequest, PullRequest, ChunkRequest, LeaseRequest, ReleaseRequest, StatsRequest, PingRequest}
)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    bind: str = "tcp://127.0.0.1:0"  # port 0: any free port; see TensorServer.address
    advertise_host: str | None = None  # host name to put in refs when bound to 0.0.0.0
    limits: Limits = Limits()
    sweep_interval_s: float = 0.25
    reclaim_interval_s: float = 10.0  # reclaim dead processes' segments this often
    idle_client_s: float = 600.0  # forget a connection's handshake after this much silence
    bulk_bind: str | None = None
    """The bulk channel's endpoint (`engine.data.bulk`; authenticated plane only). None: the
    interface of a `tcp://` `bind`, any free port (no bulk channel for other schemes)."""
    bulk_grant_s: float = GRANT_S
    """A bulk grant unused for this long is gone."""
    peer_timeout_s: float = 10.0
    """A connection whose peer acknowledges no byte sent to it for this long is dropped with the
    replies queued for it (`engine.data.bulk.drop_stalled`), so zero-copy sends end and what they
    read is freed (a released segment, KV pages lent from their slots) even when the peer stopped
    reading or its host vanished without closing its connections."""

    def bulk_endpoint(self) -> str | None:
        if self.bulk_bind is not None:
            return self.bulk_bind
        scheme, _, rest = self.bind.partition("://")
        if scheme != "tcp":
            return None
        return f"tcp://{rest.rsplit(':', 1)[0]}:0"


@dataclass(slots=True)
class _ClientState:
    name: str
    host: str
    last_seen: float


class TensorServer:
    """Serves pulls of `store`'s refs to other processes from a background thread."""

    def __init__(
        self,
        config: ServerConfig | None = None,
        store_config: StoreConfig | None = None,
        *,
        context: zmq.Context | None = None,
        keys: PlaneKeys | None = None,
    ) -> None:
        """`keys`: serve only the plane's CURVE peers (`engine.data.curve`); None: plaintext."""
        self.config = config or ServerConfig()
        self._own_context = context is None
        self._context = context or zmq.Context(io_threads=1)
        self._guard = None if keys is None else PlaneGuard(self._context, keys, name="tensor server")
        socket = self._context.socket(zmq.ROUTER)
        if self._guard is not None:
            self._guard.serve(socket)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.SNDHWM, 0)  # replies are bounded by what clients ask for
        socket.setsockopt(zmq.MAXMSGSIZE, self.config.limits.hard_max_message_bytes)
        drop_stalled(socket, self.config.peer_timeout_s)
        socket.bind(self.config.bind)
        self._socket = socket
        self.address = self._advertised(socket.getsockopt_string(zmq.LAST_ENDPOINT))
        self.store = TensorStore(self.address, store_config)
        bulk_bind = self.config.bulk_endpoint()
        self._bulk = None
        if keys is not None and keys.bulk.bulk_channel and bulk_bind is not None:
            self._bulk = BulkEndpoint(self._context, bulk_bind, self.store, mac=keys.bulk is BulkMode.MAC,
                                      limits=self.config.limits,
                                      grant_s=self.config.bulk_grant_s, advertise=self._advertised,
                                      peer_timeout_s=self.config.peer_timeout_s)
        self._codec = WireCodec(self.config.limits.max_request_bytes)
        self._clients: dict[bytes, _ClientState] = {}
        self._handlers: dict[type, Callable[[Any], Message]] = {}
        self._stop_r, self._stop_w = os.pipe()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="omniflow-tensor-server", daemon=True)
        self._thread.start()

    def _advertised(self, endpoint: str) -> str:
        host = self.config.advertise_host
        if host is None:
            return endpoint
        scheme, _, rest = endpoint.partition("://")
        return f"{scheme}://{host}:{rest.rsplit(':', 1)[1]}"

    def register_handler(self, message_type: type[R], handler: Callable[[R], Message]) -> None:
        """Answer requests of `message_type` (a request of the `Message` union that the server
        does not answer itself) with `handler(request)`'s reply.

        The handler runs on the serving thread, so every other request waits meanwhile: keep it
        short (copy bytes into the store and hand out a ref, never block on another process).
        It may raise `RequestRefused` to answer an `ErrorReply` of its code; any other exception
        is answered INTERNAL and logged. Replacing a handler is allowed; see `unregister_handler`.
        """
        if message_type not in Message.__args__:
            raise ValueError(f"{message_type.__name__} is not in the Message union: the codec cannot read it")
        if message_type in _BUILTIN_REQUESTS or not message_type.__name__.endswith("Request"):
            raise ValueError(f"{message_type.__name__} is not a request a handler may answer")
        self._handlers[message_type] = handler  # one dict store: safe against the serving thread

    def unregister_handler(self, message_type: type[Message]) -> None:
        """Stop answering `message_type` (refused as UNSUPPORTED from now on); no error if unknown."""
        self._handlers.pop(message_type, None)

    @property
    def refused(self) -> int:
        """Connections refused for want of an authorised CURVE key, and bulk requests refused
        for want of a live grant (0 on a plaintext server)."""
        return ((0 if self._guard is None else self._guard.refused)
                + (0 if self._bulk is None else self._bulk.refused))

    @property
    def bulk_address(self) -> str | None:
        """The bulk channel's endpoint; None without one."""
        return None if self._bulk is None else self._bulk.address

    def grant_bulk(self, ref: TensorRef) -> BulkGrant | None:
        """A one-time grant to read `ref`'s bytes over the bulk channel, for a handler's reply on
        the CURVE connection (handlers run on the serving thread, which keeps the grants); None
        without a bulk channel, or for an empty ref."""
        if self._bulk is None or ref.nbytes == 0:
            return None
        return self._bulk.grant(ref.id, ref.nbytes)

    @property
    def bulk_bytes(self) -> int:
        """Bytes served over the bulk channel so far."""
        return 0 if self._bulk is None else self._bulk.served_bytes

    def close(self) -> None:
        """Stop serving, then free the store (unlinking its segments)."""
        if self._stopping:
            return
        self._stopping = True
        os.write(self._stop_w, b"\0")
        self._thread.join(timeout=5.0)
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
        if self._guard is not None:
            self._guard.close()  # the socket is closed by the serving thread on its way out
        self.store.close()
        if self._own_context:
            self._context.term()

    # --- the serving thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        if self._bulk is not None:
            poller.register(self._bulk.socket, zmq.POLLIN)
        interval_ms = max(1, int(self.config.sweep_interval_s * 1000))
        next_sweep = time.monotonic()
        next_reclaim = time.monotonic() + self.config.reclaim_interval_s
        try:
            while not self._stopping:
                events = dict(poller.poll(interval_ms))
                if self._socket in events:
                    self._drain()
                if self._bulk is not None and self._bulk.socket in events:
                    self._bulk.drain()
                now = time.monotonic()
                if now >= next_sweep:
                    self.store.sweep()
                    self._forget_idle(now)
                    if self._bulk is not None:
                        self._bulk.sweep()
                    next_sweep = now + self.config.sweep_interval_s
                if now >= next_reclaim:
                    self.store.reclaim_dead()
                    next_reclaim = now + self.config.reclaim_interval_s
        finally:
            self._socket.close(linger=0)
            if self._bulk is not None:
                self._bulk.close()

    def _drain(self) -> None:
        for _ in range(1024):  # then sweep, even under a flood
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._serve(frames)

    def _serve(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        request_id: int | None = None
        try:
            if len(frames) != 2:
                raise RequestRefused(
                    ErrorCode.MALFORMED, f"expected one frame per request, got {len(frames) - 1}"
                )
            message = self._codec.decode(frames[1].buffer)
            request_id = getattr(message, "request_id", None)
            self._dispatch(identity, message)
        except WireError as exc:
            self._reply(identity, ErrorReply(request_id, exc.code, str(exc)))
        except RequestRefused as exc:
            self._reply(identity, ErrorReply(request_id, exc.code, exc.message))
        except RefNotFound as exc:
            self._reply(identity, ErrorReply(request_id, ErrorCode.NOT_FOUND, str(exc)))
        except NoTransport as exc:
            self._reply(identity, ErrorReply(request_id, ErrorCode.UNSUPPORTED, str(exc)))
        except Exception as exc:  # a bug in serving one request must not stop the server
            log.exception("internal error serving a request")
            self._reply(identity, ErrorReply(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    def _dispatch(self, identity: bytes, message: Message) -> None:
        if isinstance(message, HelloRequest):
            if message.protocol_version != PROTOCOL_VERSION:
                raise RequestRefused(
                    ErrorCode.VERSION_MISMATCH,
                    f"server speaks protocol {PROTOCOL_VERSION}, client {message.protocol_version}",
                )
            self._clients[identity] = _ClientState(message.peer, message.host, time.monotonic())
            limits = self.config.limits
            self._reply(
                identity,
                HelloReply(PROTOCOL_VERSION, self.address, self.store.host, limits.max_chunk_bytes,
                           limits.max_request_bytes),
            )
            return
        client = self._clients.get(identity)
        if client is None:
            raise RequestRefused(ErrorCode.HANDSHAKE_REQUIRED, "the first message must be a HelloRequest")
        client.last_seen = time.monotonic()
        handler = self._handlers.get(type(message))
        if handler is not None:
            self._reply(identity, handler(message))
            return
        match message:
            case ChunkRequest():
                self._serve_chunk(identity, message)
            case PullRequest():
                self._serve_pull(identity, message)
            case ReleaseRequest():
                released = self.store.release(message.ref_id)
                self._reply(identity, ReleaseReply(message.request_id, released))
            case LeaseRequest():
                try:
                    expires = self.store.extend(message.ref_id, message.seconds)
                except ValueError as exc:
                    raise RequestRefused(ErrorCode.BAD_REQUEST, str(exc)) from exc
                self._reply(identity, LeaseReply(message.request_id, expires))
            case StatsRequest():
                s = self.store.stats()
                self._reply(
                    identity,
                    StatsReply(message.request_id, s.live_refs, s.live_bytes, s.segments, s.pooled_segments,
                               s.pooled_bytes),
                )
            case PingRequest():
                self._reply(identity, PingReply(message.request_id))
            case _ if type(message).__name__.endswith("Request"):
                raise RequestRefused(
                    ErrorCode.UNSUPPORTED, f"this server does not answer {type(message).__name__}"
                )
            case _:
                raise RequestRefused(ErrorCode.BAD_REQUEST, f"{type(message).__name__} is not a request")

    def _serve_pull(self, identity: bytes, request: PullRequest) -> None:
        transport = choose_transport(self.store.get(request.ref_id), request.transports, self.store.config)

        def send(entry: StoredTensor) -> SendHandle | None:
            header = entry.header
            if transport is Transport.CUDA_IPC:
                assert entry.cuda is not None
                shared, offset = cuda_ipc.share(entry.cuda)
                reply = PullReply(request.request_id, request.ref_id, transport,
                                  msgspec.structs.replace(header, offset=offset), entry.ref.lease_expires_at,
                                  cuda=shared)
                return self._reply(identity, reply)
            if transport is Transport.TCP and request.bulk and self._bulk is not None and header.nbytes > 0:
                grant = self._bulk.grant(request.ref_id, header.nbytes)
                return self._reply(identity, PullReply(request.request_id, request.ref_id, transport, header,
                                                       entry.ref.lease_expires_at, bulk=grant))
            location = entry.location if transport is Transport.SHM else None
            if location is not None:
                header = msgspec.structs.replace(header, offset=location.offset)
            elif transport is Transport.SHM:  # staged into private memory (small): no segment after all
                raise RequestRefused(ErrorCode.UNSUPPORTED, "this tensor is not in shared memory")
            reply = PullReply(
                request.request_id,
                request.ref_id,
                transport,
                header,
                entry.ref.lease_expires_at,
                location.segment if location is not None else None,
                location.size if location is not None else 0,
            )
            inline = transport is Transport.INLINE and entry.data is not None
            return self._reply(identity, reply, [entry.data] if inline else None)

        self.store.serve(request.ref_id, send, host=transport is not Transport.CUDA_IPC)

    def _serve_chunk(self, identity: bytes, request: ChunkRequest) -> None:
        if request.length > self.config.limits.max_chunk_bytes:
            raise RequestRefused(ErrorCode.OVERSIZED, f"chunk of {request.length} bytes above the limit")

        def send(entry: StoredTensor) -> SendHandle | None:
            end = request.offset + request.length
            if request.offset < 0 or request.length <= 0 or end > entry.header.nbytes:
                raise RequestRefused(
                    ErrorCode.BAD_REQUEST, f"range [{request.offset}, {end}) outside the tensor"
                )
            reply = ChunkReply(request.request_id, request.offset, request.length)
            return self._reply(identity, reply, entry.byte_range(request.offset, end))

        self.store.serve(request.ref_id, send)

    def _reply(self, identity: bytes, message: Message, data: list[Any] | None = None) -> SendHandle | None:
        """Send `message` (and each buffer of `data` as a raw frame, zero-copy); returns a
        handle done once ZeroMQ no longer reads `data`."""
        try:
            return send_routed(self._socket, identity, self._codec.encode(message), data)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._clients.pop(identity, None)  # the client went away; nothing to answer
            return None

    def _forget_idle(self, now: float) -> None:
        limit = self.config.idle_client_s
        for identity in [i for i, c in self._clients.items() if now - c.last_seen > limit]:
            del self._clients[identity]


class RequestRefused(Exception):
    """A request the server (or a registered handler) declines, answered with an ErrorReply
    of `code`."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
