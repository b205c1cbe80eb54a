"""A SGLang PD transfer backend over Omni-Flow's Data Flow: `--disaggregation-transfer-backend omniflow`.

SGLang 0.5.23 picks a backend's classes with `sglang.srt.disaggregation.utils.get_kv_class`
from a closed `TransferBackend` enum; `engine.compute.sglang.plugin.register` (the
`sglang.srt.plugins` entry point) extends both. The classes here subclass SGLang's
`BaseKVManager`, `BaseKVSender`, `BaseKVReceiver` and `BaseKVBootstrapServer`.

How one request's KV moves (room = SGLang's bootstrap room):

1. Every prefill manager registers its control endpoint at the bootstrap server
   (`host:disaggregation_bootstrap_port`) under its (dp rank, tp rank).
2. The decode receiver looks the endpoint up (`init`), and once SGLang has allocated its
   pages (`send_metadata`) asks the prefill for the room (`KVReceiveRequest`). The sender
   now polls `WaitingForInput`.
3. `send` gathers the pages from the prefill's KV buffers into host memory; after the last
   chunk the payload goes into the prefill's tensor store and the decode gets its ref
   (`KVReadyEvent`). Sender and receiver poll `Transferring`.
4. The receiver pulls the ref with `engine.data.peer.Peer` (shared memory on one host, TCP
   otherwise), writes the pages into its own KV buffers when polled, and reports
   `KVDoneRequest`; both sides poll `Success`.

No pickle anywhere: control messages are msgspec structs (`messages.py`), KV bytes are raw
frames or shared memory. Every phase has a deadline (`TransferConfig`); `poll()` checks it
itself, so it reaches `Success` or `Failed` even when the I/O thread or the peer is dead.
While a decode waits for the prefill to compute, it probes the prefill every
`timeout_s / 4` (`KVStatusRequest`); a prefill that stops answering for `timeout_s` fails the
receiver then, not at the end of the longer waiting deadline.

Buffers are read and written through the raw pointers SGLang hands over in `KVArgs`: KV
buffers on the server's device (`server_args.device`: `cuda` or `cpu`), aux (metadata)
buffers in host memory, where SGLang's `MetadataBuffers` keep them. Supported: equal
attention tp on both sides (decode rank r reads prefill rank r), pp 1, no state buffers
(Mamba/SWA/DSA state indices fail the transfer), device destinations only.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from engine.compute.sglang.messages import (
    TRANSFER_PROTOCOL_VERSION,
    BootstrapLookupReply,
    BootstrapLookupRequest,
    BootstrapMessage,
    BootstrapRegisterReply,
    BootstrapRegisterRequest,
    KVDoneReply,
    KVDoneRequest,
    KVFailedEvent,
    KVReadyEvent,
    KVReceiveRequest,
    KVStatusReply,
    KVStatusRequest,
    PrefillTopology,
    TransferMessage,
)
from engine.data.channel import Transfer, TransferState
from engine.data.codec import WireCodec, WireError
from engine.data.peer import Peer, PeerConfig, ServerConfig
from engine.data.wire import TensorRef

log = logging.getLogger(__name__)

BACKEND_NAME = "omniflow"
_MAX_CONTROL_BYTES = 1 << 20
_POLL_MS = 20
_LOOKUP_RETRY_S = 0.2


class KVTransferError(Exception):
    """A transfer of the omniflow backend failed; the message says in which phase and why."""


class KVTransferConfigError(KVTransferError):
    """The backend cannot serve this configuration (bad setting, unsupported layout)."""


# --- configuration ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Deadlines and addresses of the backend, read once per manager.

    `timeout_s` bounds every phase that waits on the other side (bootstrap lookup, the
    pull, the decode's acknowledgement) and the silence of a prefill the decode probes;
    `waiting_timeout_s` bounds waiting for the prefill to compute (decode) or for the
    decode to show up and the scheduler to send (prefill). `host` is the address the
    control and data endpoints bind and advertise."""

    timeout_s: float = 30.0
    waiting_timeout_s: float = 300.0
    host: str = "127.0.0.1"

    ENV_TIMEOUT = "OMNIFLOW_SGLANG_KV_TIMEOUT_S"
    ENV_WAITING = "OMNIFLOW_SGLANG_KV_WAITING_TIMEOUT_S"
    ENV_HOST = "OMNIFLOW_SGLANG_KV_HOST"

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or not self.waiting_timeout_s > 0:
            raise KVTransferConfigError(
                f"timeouts must be positive (timeout_s={self.timeout_s}, waiting_timeout_s={self.waiting_timeout_s})"
            )
        if not self.host:
            raise KVTransferConfigError("an empty host for the KV transfer endpoints")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TransferConfig:
        """The config SGLang's processes get (they build managers with a fixed signature)."""
        default = cls()
        return cls(
            timeout_s=_seconds(environ, cls.ENV_TIMEOUT, default.timeout_s),
            waiting_timeout_s=_seconds(environ, cls.ENV_WAITING, default.waiting_timeout_s),
            host=environ.get(cls.ENV_HOST, default.host),
        )


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise KVTransferConfigError(f"{name}={raw!r} is not a number of seconds") from exc
    if not value > 0:
        raise KVTransferConfigError(f"{name}={raw!r} must be positive")
    return value


def split_bootstrap_addr(bootstrap_addr: str) -> str:
    """SGLang's `host:port` (IPv6 in brackets) as a ZeroMQ endpoint."""
    host, sep, port = bootstrap_addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise KVTransferConfigError(f"bootstrap address {bootstrap_addr!r} is not host:port")
    return f"tcp://{host}:{port}"


# --- raw buffers ----------------------------------------------------------------------------


class _CudaBytes:
    """A device buffer given by pointer, as torch reads it (`__cuda_array_interface__`)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def byte_view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A writable uint8 view of `nbytes` at `ptr` on `device` (no copy). The memory belongs to
    SGLang's pools; the view is valid while they live."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(ptr), dtype=torch.uint8)
    if device.type == "cuda":
        return torch.as_tensor(_CudaBytes(ptr, nbytes), device=device)
    raise KVTransferConfigError(f"buffers on {device} are not supported")


@dataclass(frozen=True, slots=True)
class _Buffers:
    """A list of same-kind buffers (KV per layer, or aux) as rows of `item_lens[i]` bytes."""

    rows: tuple[torch.Tensor, ...]
    item_lens: tuple[int, ...]

    @classmethod
    def of(cls, ptrs: list[int], lens: list[int], item_lens: list[int], device: torch.device) -> _Buffers:
        if not len(ptrs) == len(lens) == len(item_lens):
            raise KVTransferConfigError("KVArgs buffer lists of different lengths")
        rows = []
        for ptr, nbytes, item in zip(ptrs, lens, item_lens, strict=True):
            if item <= 0 or nbytes % item:
                raise KVTransferConfigError(f"a buffer of {nbytes} bytes is not rows of {item} bytes")
            rows.append(byte_view(ptr, nbytes, device).view(-1, item))
        return cls(tuple(rows), tuple(int(i) for i in item_lens))

    def nbytes(self, count: int) -> int:
        return count * sum(self.item_lens)

    def gather(self, indices: np.ndarray) -> list[torch.Tensor]:
        """Rows `indices` of each buffer, flat, in host memory (one tensor per buffer)."""
        if not self.rows:
            return []
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64), device=self.rows[0].device)
        self._check(index)
        return [rows.index_select(0, index).reshape(-1).cpu() for rows in self.rows]

    def scatter(self, indices: np.ndarray, data: torch.Tensor) -> None:
        """Write `data` (as `gather` made it) into rows `indices` of every buffer."""
        if not self.rows:
            return
        device = self.rows[0].device
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64), device=device)
        self._check(index)
        offset = 0
        for rows, item in zip(self.rows, self.item_lens, strict=True):
            size = len(index) * item
            rows.index_copy_(0, index, data[offset : offset + size].to(device).view(-1, item))
            offset += size
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _check(self, index: torch.Tensor) -> None:
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= min(len(r) for r in self.rows)):
            raise KVTransferError(f"page index outside the buffers ({len(self.rows[0])} rows)")


def kv_device(server_args: Any, kv_args: KVArgs) -> torch.device:
    device = str(getattr(server_args, "device", "cuda"))
    if device == "cuda":
        return torch.device("cuda", int(kv_args.gpu_id))
    if device == "cpu":
        return torch.device("cpu")
    raise KVTransferConfigError(f"the omniflow transfer backend reads KV on cuda or cpu, not {device!r}")


# --- progress of one transfer ------------------------------------------------------------


class _Progress:
    """A transfer's `KVPoll` state with the deadline of its current phase. Terminal states stick."""

    __slots__ = ("_lock", "deadline", "reason", "state")

    def __init__(self, deadline_s: float) -> None:
        self._lock = threading.Lock()
        self.state = KVPoll.Bootstrapping
        self.deadline = time.monotonic() + deadline_s
        self.reason = ""

    @property
    def done(self) -> bool:
        return self.state in (KVPoll.Success, KVPoll.Failed)

    def advance(self, state: int, deadline_s: float) -> bool:
        with self._lock:
            if self.state in (KVPoll.Success, KVPoll.Failed):
                return False
            self.state = state
            self.deadline = time.monotonic() + deadline_s
            return True

    def fail(self, reason: str) -> bool:
        with self._lock:
            if self.state in (KVPoll.Success, KVPoll.Failed):
                return False
            self.state = KVPoll.Failed
            self.reason = reason
            return True

    def succeed(self) -> bool:
        with self._lock:
            if self.state in (KVPoll.Success, KVPoll.Failed):
                return False
            self.state = KVPoll.Success
            return True

    def current(self, now: float | None = None) -> int:
        if not self.done and (time.monotonic() if now is None else now) > self.deadline:
            self.fail(f"timed out in state {_STATE_NAMES[self.state]}")
        return self.state


_STATE_NAMES = {
    KVPoll.Failed: "Failed",
    KVPoll.Bootstrapping: "Bootstrapping",
    KVPoll.WaitingForInput: "WaitingForInput",
    KVPoll.Transferring: "Transferring",
    KVPoll.Success: "Success",
}


# --- the I/O thread ------------------------------------------------------------------------


@dataclass(slots=True)
class _Pending:
    on_reply: Callable[[TransferMessage | None], None]  # None: no reply by the deadline
    deadline: float


class _Loop:
    """One thread owns a manager's sockets; other threads hand it work with `call`.

    Replies to this side's requests are matched by request id; a request without a reply
    by its deadline gets `on_reply(None)`."""

    def __init__(self, name: str) -> None:
        self.context = zmq.Context(io_threads=1)
        self.failure: BaseException | None = None
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._poller = zmq.Poller()
        self._readers: dict[zmq.Socket, Callable[[list[bytes]], None]] = {}
        self._tickers: list[Callable[[float], None]] = []
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._codec = WireCodec(_MAX_CONTROL_BYTES, TransferMessage)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        self._calls.put(fn)

    def next_id(self) -> int:
        return next(self._ids)

    def add_reader(self, socket: zmq.Socket, on_frames: Callable[[list[bytes]], None]) -> None:
        """Loop thread only."""
        self._readers[socket] = on_frames
        self._poller.register(socket, zmq.POLLIN)

    def add_ticker(self, tick: Callable[[float], None]) -> None:
        self._tickers.append(tick)

    def encode(self, message: Any) -> bytes:
        return self._codec.encode(message)

    def decode(self, data: bytes) -> TransferMessage | None:
        try:
            return self._codec.decode(data)
        except WireError as exc:
            log.warning("dropping an unreadable KV transfer message: %s", exc)
            return None

    def request(self, socket: zmq.Socket, message: Any, timeout_s: float,
                on_reply: Callable[[TransferMessage | None], None]) -> None:
        """Send `message` (its request_id registered) on a DEALER; loop thread only."""
        self._pending[message.request_id] = _Pending(on_reply, time.monotonic() + timeout_s)
        try:
            socket.send(self.encode(message), zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full or it is gone: the deadline answers None
            log.warning("could not queue %s; it fails at its deadline", type(message).__name__)

    def on_reply(self, frames: list[bytes]) -> None:
        """Reader of DEALER sockets: hand each reply to its request's callback."""
        message = self.decode(frames[-1])
        if message is None:
            return
        pending = self._pending.pop(message.request_id, None)
        if pending is not None:
            pending.on_reply(message)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for socket, _ in self._poller.poll(_POLL_MS) if self._readers else ():
                    self._read(socket)
                if not self._readers:
                    self._stop.wait(_POLL_MS / 1000)
                while True:
                    try:
                        fn = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    fn()
                now = time.monotonic()
                for request_id in [i for i, p in self._pending.items() if p.deadline < now]:
                    self._pending.pop(request_id).on_reply(None)
                for tick in self._tickers:
                    tick(now)
        except BaseException as exc:
            self.failure = exc
            log.exception("the KV transfer I/O thread died")
            raise

    def _read(self, socket: zmq.Socket) -> None:
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._readers[socket](frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        for socket in list(self._readers):
            socket.close(linger=0)
        self.context.term()


# --- bootstrap server -------------------------------------------------------------------------


class OmniFlowKVBootstrapServer(BaseKVBootstrapServer):
    """Maps (dp rank, tp rank) to the prefill managers' control endpoints; SGLang runs one per
    prefill server at `host:disaggregation_bootstrap_port`."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._codec = WireCodec(_MAX_CONTROL_BYTES, BootstrapMessage)
        self._context = zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{host}:{port}")
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._managers: dict[tuple[int, int], str] = {}
        self._topology: PrefillTopology | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omniflow-kv-bootstrap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            identity, *_, data = self._socket.recv_multipart()
            try:
                message = self._codec.decode(data)
            except WireError as exc:
                log.warning("bootstrap server: unreadable message: %s", exc)
                continue
            reply = self._answer(message)
            if reply is not None:
                self._socket.send_multipart([identity, self._codec.encode(reply)])

    def _answer(self, message: Any) -> Any:
        if isinstance(message, BootstrapRegisterRequest):
            if message.protocol_version != TRANSFER_PROTOCOL_VERSION:
                return BootstrapRegisterReply(message.request_id, False, "protocol version mismatch")
            if self._topology is not None and self._topology != message.topology:
                return BootstrapRegisterReply(
                    message.request_id, False, f"topology {message.topology} differs from {self._topology}"
                )
            self._topology = message.topology
            self._managers[(message.dp_rank, message.engine_rank)] = message.address
            return BootstrapRegisterReply(message.request_id, True)
        if isinstance(message, BootstrapLookupRequest):
            address = self._managers.get((message.dp_rank, message.engine_rank))
            if message.engine_rank < 0 and self._topology is not None:
                address = ""
            return BootstrapLookupReply(message.request_id, address, self._topology)
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._socket.close(linger=0)
        self._context.term()


# --- per-request records (owned by the manager's loop thread) -------------------------------


@dataclass(slots=True, eq=False)
class _Waiter:
    """A decode receiver waiting on a prefill ROUTER for a room."""

    identity: bytes
    request: KVReceiveRequest


@dataclass(slots=True, eq=False)
class _Outgoing:
    room: int
    progress: _Progress
    num_pages: int | None = None
    aux_index: int | None = None
    chunks: list[list[torch.Tensor]] = field(default_factory=list)  # per send(): one part per KV buffer
    pages_sent: int = 0
    waiter: _Waiter | None = None
    payload: torch.Tensor | None = None
    ref: TensorRef | None = None
    started: float | None = None
    finished: float | None = None


@dataclass(slots=True, eq=False)
class _Incoming:
    room: int
    bootstrap_addr: str
    progress: _Progress
    dp_rank: int = 0
    prefill: str | None = None
    kv_indices: np.ndarray | None = None
    aux_index: int | None = None
    asked: bool = False
    next_probe: float = 0.0
    last_heard: float = field(default_factory=time.monotonic)
    retry_at: float | None = None
    transfer: Transfer | None = None
    num_pages: int = 0
    nbytes: int = 0
    started: float | None = None
    finished: float | None = None


# --- manager ------------------------------------------------------------------------------------


class OmniFlowKVManager(BaseKVManager):
    """Owns a side's transfer endpoints: the control socket(s), a `Peer` for the KV bytes, and
    the views of SGLang's KV and aux buffers. One per scheduler (tp rank)."""

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
        *,
        config: TransferConfig | None = None,
    ) -> None:
        self.kv_args = args
        self.mode = DisaggregationMode(disaggregation_mode)
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.config = config or TransferConfig.from_env()
        if self.mode not in (DisaggregationMode.PREFILL, DisaggregationMode.DECODE):
            raise KVTransferConfigError(f"no KV transfer in disaggregation mode {self.mode}")
        if int(getattr(args, "pp_rank", 0) or 0) != 0:
            raise KVTransferConfigError("the omniflow transfer backend supports pipeline parallel size 1 only")
        self.engine_rank = int(args.engine_rank)
        self.dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        self.kv = _Buffers.of(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, kv_device(server_args, args))
        self.aux = _Buffers.of(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, torch.device("cpu"))
        self.peer = Peer(PeerConfig(server=ServerConfig(bind=f"tcp://{self.config.host}:0"),
                                    default_timeout_s=self.config.timeout_s))
        self.loop = _Loop(f"omniflow-kv-{self.mode.value}-{self.engine_rank}")
        self.prefill_info_table: dict[str, Any] = {}
        self.address: str | None = None
        self.registered = threading.Event()
        self.registration_error: str | None = None
        self._outgoing: dict[int, _Outgoing] = {}
        self._early: dict[int, tuple[_Waiter, float]] = {}
        self._incoming: dict[int, _Incoming] = {}
        self._bootstraps: dict[str, zmq.Socket] = {}
        self._prefills: dict[str, zmq.Socket] = {}
        self._addresses: dict[tuple[str, int], str] = {}
        self._closed = False
        ready = threading.Event()
        self.loop.call(lambda: self._open(ready))
        if not ready.wait(self.config.timeout_s):
            raise KVTransferError("the KV transfer I/O thread did not start")
        if self.mode == DisaggregationMode.PREFILL:
            self.register_to_bootstrap()

    # -- loop-thread setup ---------------------------------------------------------------

    def _open(self, ready: threading.Event) -> None:
        if self.mode == DisaggregationMode.PREFILL:
            socket = self.loop.context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            socket.bind(f"tcp://{self.config.host}:0")
            self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            self._control = socket
            self.loop.add_reader(socket, self._on_control)
            self.loop.add_ticker(self._expire_early)
        else:
            self.loop.add_ticker(self._tick_incoming)
        ready.set()

    def _dealer(self, table: dict[str, zmq.Socket], endpoint: str) -> zmq.Socket:
        socket = table.get(endpoint)
        if socket is None:
            socket = self.loop.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(endpoint)
            table[endpoint] = socket
            self.loop.add_reader(socket, self.loop.on_reply)
        return socket

    def topology(self) -> PrefillTopology:
        return PrefillTopology(
            attn_tp_size=int(getattr(self.server_args, "tp_size", 1) or 1),
            dp_size=int(getattr(self.server_args, "dp_size", 1) or 1),
            page_size=int(self.kv_args.page_size),
            kv_cache_dtype=str(self.kv_args.kv_cache_dtype_str),
        )

    # -- prefill: bootstrap registration ----------------------------------------------------

    def register_to_bootstrap(self) -> None:
        """Register this prefill rank at `server_args.host:disaggregation_bootstrap_port`,
        retrying until `timeout_s`; `registered` is set on success, `registration_error` on
        failure (every sender then fails with it)."""
        host = str(getattr(self.server_args, "host", "127.0.0.1"))
        endpoint = split_bootstrap_addr(f"{host}:{int(self.server_args.disaggregation_bootstrap_port)}")
        deadline = time.monotonic() + self.config.timeout_s

        def attempt() -> None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.registration_error = f"no bootstrap server answered at {endpoint} within {self.config.timeout_s}s"
                log.error("%s", self.registration_error)
                return
            request = BootstrapRegisterRequest(
                self.loop.next_id(), TRANSFER_PROTOCOL_VERSION, self.dp_rank, self.engine_rank,
                str(self.address), self.topology(),
            )
            self.loop.request(self._dealer(self._bootstraps, endpoint), request, min(remaining, 1.0), on_reply)

        def on_reply(reply: TransferMessage | None) -> None:
            if isinstance(reply, BootstrapRegisterReply) and reply.accepted:
                self.registered.set()
            elif isinstance(reply, BootstrapRegisterReply):
                self.registration_error = f"bootstrap server refused the registration: {reply.reason}"
                log.error("%s", self.registration_error)
            else:
                attempt()

        self.loop.call(attempt)

    # -- prefill: control endpoint -----------------------------------------------------------

    def _on_control(self, frames: list[bytes]) -> None:
        identity, message = frames[0], self.loop.decode(frames[-1])
        if isinstance(message, KVReceiveRequest):
            self._on_receive(_Waiter(identity, message))
        elif isinstance(message, KVStatusRequest):
            self._reply(identity, self._status(message))
        elif isinstance(message, KVDoneRequest):
            self._on_done(message)
            self._reply(identity, KVDoneReply(message.request_id))

    def _reply(self, identity: bytes, message: Any) -> None:
        try:
            self._control.send_multipart([identity, self.loop.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the decode side is gone; its own deadline fails it
            log.warning("cannot answer a decode peer: %s", exc)

    def _on_receive(self, waiter: _Waiter) -> None:
        request = waiter.request
        if request.protocol_version != TRANSFER_PROTOCOL_VERSION:
            self._reply(waiter.identity, KVFailedEvent(request.request_id, request.room, "protocol version mismatch"))
            return
        if request.kv_item_lens != self.kv.item_lens or (request.aux and request.aux_item_lens != self.aux.item_lens):
            reason = (f"page layout mismatch: decode {request.kv_item_lens}/{request.aux_item_lens}, "
                      f"prefill {self.kv.item_lens}/{self.aux.item_lens}")
            self._reply(waiter.identity, KVFailedEvent(request.request_id, request.room, reason))
            outgoing = self._outgoing.get(request.room)
            if outgoing is not None:
                outgoing.progress.fail(reason)
            return
        outgoing = self._outgoing.get(request.room)
        if outgoing is None:
            self._early[request.room] = (waiter, time.monotonic() + self.config.waiting_timeout_s)
            return
        self._attach(outgoing, waiter)

    def _attach(self, outgoing: _Outgoing, waiter: _Waiter) -> None:
        outgoing.waiter = waiter
        if outgoing.progress.state == KVPoll.Bootstrapping:
            outgoing.progress.advance(KVPoll.WaitingForInput, self.config.waiting_timeout_s)
        if outgoing.payload is not None:
            self._publish(outgoing)

    def _status(self, request: KVStatusRequest) -> KVStatusReply:
        outgoing = self._outgoing.get(request.room)
        if outgoing is None:
            known = request.room in self._early
            return KVStatusReply(request.request_id, request.room, known, "" if known else "no such room")
        state = outgoing.progress.current()
        return KVStatusReply(request.request_id, request.room, state != KVPoll.Failed, outgoing.progress.reason)

    def _expire_early(self, now: float) -> None:
        for room in [r for r, (_, deadline) in self._early.items() if deadline < now]:
            waiter, _ = self._early.pop(room)
            self._reply(waiter.identity, KVFailedEvent(waiter.request.request_id, room, "no sender for the room"))

    def open_outgoing(self, room: int) -> _Outgoing:
        outgoing = _Outgoing(room, _Progress(self.config.waiting_timeout_s))
        if self.registration_error is not None:
            outgoing.progress.fail(self.registration_error)

        def add() -> None:
            self._outgoing[room] = outgoing
            early = self._early.pop(room, None)
            if early is not None:
                self._attach(outgoing, early[0])

        self.loop.call(add)
        return outgoing

    def complete(self, outgoing: _Outgoing, payload: torch.Tensor) -> None:
        """The last chunk was gathered (caller thread): hand the payload to the decode side."""
        outgoing.payload = payload
        outgoing.started = time.monotonic()
        outgoing.progress.advance(KVPoll.Transferring, self.config.timeout_s)
        self.loop.call(lambda: self._publish(outgoing))

    def _publish(self, outgoing: _Outgoing) -> None:
        waiter, payload = outgoing.waiter, outgoing.payload
        if waiter is None or payload is None or outgoing.ref is not None or outgoing.progress.done:
            return
        request = waiter.request
        if request.num_pages != outgoing.pages_sent:
            reason = f"decode expects {request.num_pages} pages, prefill sent {outgoing.pages_sent}"
            outgoing.progress.fail(reason)
            self._reply(waiter.identity, KVFailedEvent(request.request_id, outgoing.room, reason))
            return
        if not request.aux and outgoing.aux_index is not None:
            payload = payload[: self.kv.nbytes(outgoing.pages_sent)]
        outgoing.ref = self.peer.put(payload, lease_s=self.config.timeout_s)
        outgoing.payload = None
        self._reply(waiter.identity, KVReadyEvent(request.request_id, outgoing.room, outgoing.pages_sent, outgoing.ref))

    def _on_done(self, message: KVDoneRequest) -> None:
        outgoing = self._outgoing.get(message.room)
        if outgoing is None:
            return
        self._release(outgoing)
        outgoing.finished = time.monotonic()
        if message.ok:
            outgoing.progress.succeed()
        else:
            outgoing.progress.fail(f"decode side: {message.reason}")

    def _release(self, outgoing: _Outgoing) -> None:
        ref, outgoing.ref = outgoing.ref, None
        if ref is not None:
            self.peer.store.release(ref.id)

    def abort_outgoing(self, outgoing: _Outgoing, reason: str) -> None:
        outgoing.progress.fail(reason)

        def tell() -> None:
            self._release(outgoing)
            waiter = outgoing.waiter
            if waiter is not None:
                self._reply(waiter.identity, KVFailedEvent(waiter.request.request_id, outgoing.room, reason))

        self.loop.call(tell)

    def clear_outgoing(self, outgoing: _Outgoing) -> None:
        def drop() -> None:
            self._release(outgoing)
            if self._outgoing.get(outgoing.room) is outgoing:
                del self._outgoing[outgoing.room]

        self.loop.call(drop)

    # -- decode ----------------------------------------------------------------------------

    def open_incoming(self, room: int, bootstrap_addr: str) -> _Incoming:
        incoming = _Incoming(room, bootstrap_addr, _Progress(self.config.timeout_s))
        self.loop.call(lambda: self._incoming.__setitem__(room, incoming))
        return incoming

    def resolve(self, incoming: _Incoming, dp_rank: int) -> None:
        """Look up the prefill endpoint of `incoming` (caller thread; the answer comes on the loop)."""
        incoming.dp_rank = dp_rank
        incoming.progress.advance(KVPoll.Bootstrapping, self.config.timeout_s)
        self.loop.call(lambda: self._lookup(incoming))

    def _lookup(self, incoming: _Incoming) -> None:
        if incoming.progress.current() == KVPoll.Failed:
            return
        key = (incoming.bootstrap_addr, incoming.dp_rank)
        if key in self._addresses:
            self._found(incoming, self._addresses[key])
            return
        try:
            endpoint = split_bootstrap_addr(incoming.bootstrap_addr)
        except KVTransferConfigError as exc:
            incoming.progress.fail(str(exc))
            return

        def on_reply(reply: TransferMessage | None) -> None:
            if isinstance(reply, BootstrapLookupReply) and reply.address:
                self._addresses[key] = reply.address
                self._found(incoming, reply.address)
            else:  # not registered yet, or no answer: ask again until the phase's deadline
                incoming.retry_at = time.monotonic() + _LOOKUP_RETRY_S

        request = BootstrapLookupRequest(self.loop.next_id(), incoming.dp_rank, self.engine_rank)
        remaining = max(incoming.progress.deadline - time.monotonic(), 0.0)
        self.loop.request(self._dealer(self._bootstraps, endpoint), request, min(remaining, 1.0), on_reply)

    def _found(self, incoming: _Incoming, address: str) -> None:
        incoming.prefill = address
        if incoming.progress.state == KVPoll.Bootstrapping:
            incoming.progress.advance(KVPoll.WaitingForInput, self.config.waiting_timeout_s)
        self._ask(incoming)

    def ask(self, incoming: _Incoming, kv_indices: np.ndarray, aux_index: int | None) -> None:
        incoming.kv_indices = np.asarray(kv_indices, dtype=np.int64).copy()
        incoming.aux_index = aux_index
        self.loop.call(lambda: self._ask(incoming))

    def _ask(self, incoming: _Incoming) -> None:
        if incoming.asked or incoming.prefill is None or incoming.kv_indices is None or incoming.progress.done:
            return
        incoming.asked = True
        incoming.last_heard = time.monotonic()
        incoming.next_probe = incoming.last_heard + self.config.timeout_s / 4
        request = KVReceiveRequest(
            self.loop.next_id(), TRANSFER_PROTOCOL_VERSION, incoming.room, len(incoming.kv_indices),
            self.kv.item_lens, self.aux.item_lens, incoming.aux_index is not None,
        )
        remaining = max(incoming.progress.deadline - time.monotonic(), 0.0)
        socket = self._dealer(self._prefills, incoming.prefill)
        self.loop.request(socket, request, remaining, lambda reply: self._on_ready(incoming, reply))

    def _on_ready(self, incoming: _Incoming, reply: TransferMessage | None) -> None:
        if isinstance(reply, KVReadyEvent):
            incoming.num_pages = reply.num_pages
            incoming.nbytes = reply.ref.nbytes
            incoming.started = time.monotonic()
            incoming.progress.advance(KVPoll.Transferring, self.config.timeout_s)
            incoming.transfer = self.peer.start_pull(reply.ref, self.config.timeout_s)
        elif isinstance(reply, KVFailedEvent):
            incoming.progress.fail(f"prefill side: {reply.reason}")
        else:
            incoming.progress.fail(f"the prefill did not send room {incoming.room} in time")

    def _tick_incoming(self, now: float) -> None:
        for incoming in list(self._incoming.values()):
            if incoming.progress.current(now) == KVPoll.Failed or incoming.progress.done:
                continue
            if incoming.retry_at is not None and now >= incoming.retry_at:
                incoming.retry_at = None
                self._lookup(incoming)
            elif incoming.asked and incoming.transfer is None:
                self._probe(incoming, now)

    def _probe(self, incoming: _Incoming, now: float) -> None:
        if now - incoming.last_heard > self.config.timeout_s:
            incoming.progress.fail(f"the prefill at {incoming.prefill} stopped answering for {self.config.timeout_s}s")
            return
        if now < incoming.next_probe or incoming.prefill is None:
            return
        incoming.next_probe = now + self.config.timeout_s / 4

        def on_status(reply: TransferMessage | None) -> None:
            if isinstance(reply, KVStatusReply):
                incoming.last_heard = time.monotonic()
                if not reply.alive:
                    incoming.progress.fail(f"prefill side: {reply.reason or 'transfer failed'}")

        request = KVStatusRequest(self.loop.next_id(), incoming.room)
        self.loop.request(self._dealer(self._prefills, incoming.prefill), request, self.config.timeout_s, on_status)

    def finish_incoming(self, incoming: _Incoming) -> None:
        """Caller thread, once the pull is done: write the pages, then tell the prefill."""
        assert incoming.transfer is not None and incoming.kv_indices is not None
        ok, reason = True, ""
        try:
            data = incoming.transfer.wait(0.0).torch().reshape(-1)
            kv_bytes = self.kv.nbytes(len(incoming.kv_indices))
            aux_bytes = self.aux.nbytes(1) if incoming.aux_index is not None else 0
            if data.numel() != kv_bytes + aux_bytes:
                raise KVTransferError(f"received {data.numel()} bytes, expected {kv_bytes + aux_bytes}")
            self.kv.scatter(incoming.kv_indices, data[:kv_bytes])
            if incoming.aux_index is not None:
                self.aux.scatter(np.array([incoming.aux_index]), data[kv_bytes:])
        except (KVTransferError, RuntimeError) as exc:
            ok, reason = False, f"writing the received pages failed: {exc}"
        incoming.finished = time.monotonic()
        if ok:
            incoming.progress.succeed()
        else:
            incoming.progress.fail(reason)
        self.loop.call(lambda: self._done(incoming, ok, reason))

    def _done(self, incoming: _Incoming, ok: bool, reason: str) -> None:
        if incoming.prefill is None:
            return
        message = KVDoneRequest(self.loop.next_id(), incoming.room, ok, reason)
        # The answer only confirms; a lost one changes nothing on this side.
        self.loop.request(self._dealer(self._prefills, incoming.prefill), message, self.config.timeout_s,
                          lambda reply: None)

    def abort_incoming(self, incoming: _Incoming, reason: str) -> None:
        if incoming.progress.fail(reason) and incoming.asked:
            self.loop.call(lambda: self._done(incoming, False, reason))

    def clear_incoming(self, incoming: _Incoming) -> None:
        def drop() -> None:
            if self._incoming.get(incoming.room) is incoming:
                del self._incoming[incoming.room]

        self.loop.call(drop)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode scheduler asks this before creating receivers for `bootstrap_addr`:
        one lookup of the prefill topology, at most `timeout_s` long."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        answer: list[TransferMessage | None] = []
        done = threading.Event()

        def ask() -> None:
            request = BootstrapLookupRequest(self.loop.next_id(), 0, -1)
            socket = self._dealer(self._bootstraps, split_bootstrap_addr(bootstrap_addr))
            self.loop.request(socket, request, self.config.timeout_s, lambda r: (answer.append(r), done.set()))

        self.loop.call(ask)
        if not done.wait(self.config.timeout_s + 1.0) or not isinstance(answer[0], BootstrapLookupReply):
            return False
        topology = answer[0].topology
        if topology is None:
            return False
        if topology.page_size != int(self.kv_args.page_size):
            raise KVTransferConfigError(f"prefill page size {topology.page_size}, decode {self.kv_args.page_size}")
        from sglang.srt.disaggregation.common.conn import PrefillServerInfo

        self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
            attn_tp_size=topology.attn_tp_size, attn_cp_size=1, dp_size=topology.dp_size, pp_size=1,
            page_size=topology.page_size, kv_cache_dtype=topology.kv_cache_dtype, follow_bootstrap_room=True,
        )
        return True

    def check_alive(self) -> str | None:
        failure = self.loop.failure
        return None if failure is None else f"the KV transfer I/O thread died: {failure!r}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.loop.close()
        self.peer.close()


# --- sender and receiver ------------------------------------------------------------------


class OmniFlowKVSender(BaseKVSender):
    """The prefill side of one request (room)."""

    def __init__(self, mgr: BaseKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        if not isinstance(mgr, OmniFlowKVManager):
            raise KVTransferConfigError(f"an omniflow sender needs an omniflow manager, not {type(mgr).__name__}")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self._outgoing = mgr.open_outgoing(self.bootstrap_room)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._outgoing.num_pages = int(num_kv_indices)
        self._outgoing.aux_index = aux_index

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # A zero-page last chunk still completes the transfer.
        return num_pages > 0 or last_chunk

    def send(self, kv_indices: np.ndarray, state_indices: list | None = None, num_kv_tokens: int | None = None) -> None:
        outgoing = self._outgoing
        if outgoing.progress.done:
            return
        if state_indices:
            self.kv_mgr.abort_outgoing(outgoing, "state buffers (Mamba/SWA/DSA) are not supported by this backend")
            return
        if outgoing.num_pages is None:
            self.kv_mgr.abort_outgoing(outgoing, "send() before init()")
            return
        try:
            outgoing.chunks.append(self.kv_mgr.kv.gather(kv_indices))
        except KVTransferError as exc:
            self.kv_mgr.abort_outgoing(outgoing, str(exc))
            return
        outgoing.pages_sent += len(kv_indices)
        if outgoing.pages_sent < outgoing.num_pages:
            return
        # The payload is buffer after buffer (each buffer's pages of every chunk), then aux.
        parts = [part for buffer in zip(*outgoing.chunks, strict=True) for part in buffer]
        if outgoing.aux_index is not None:
            parts += self.kv_mgr.aux.gather(np.array([outgoing.aux_index]))
        outgoing.chunks = []
        self.kv_mgr.complete(outgoing, torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))

    def poll(self) -> int:
        failure = self.kv_mgr.check_alive()
        if failure is not None:
            self._outgoing.progress.fail(failure)
        return self._outgoing.progress.current()

    def failure_exception(self) -> None:
        raise KVTransferError(f"KV send of room {self.bootstrap_room} failed: {self._outgoing.progress.reason}")

    def get_transfer_metric(self) -> KVTransferMetric:
        outgoing = self._outgoing
        latency = None
        if outgoing.started is not None and outgoing.finished is not None:
            latency = outgoing.finished - outgoing.started
        return KVTransferMetric(transfer_latency_s=latency,
                                transfer_total_bytes=self.kv_mgr.kv.nbytes(outgoing.pages_sent))

    def abort(self) -> None:
        self.kv_mgr.abort_outgoing(self._outgoing, "aborted by the prefill scheduler")

    def clear(self) -> None:
        self.kv_mgr.clear_outgoing(self._outgoing)


class OmniFlowKVReceiver(BaseKVReceiver):
    """The decode side of one request (room)."""

    def __init__(self, mgr: BaseKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        if not isinstance(mgr, OmniFlowKVManager):
            raise KVTransferConfigError(f"an omniflow receiver needs an omniflow manager, not {type(mgr).__name__}")
        if bootstrap_room is None:
            raise KVTransferConfigError("an omniflow receiver needs a bootstrap room")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        # Read by SGLang's decode scheduler (it expects its Common* receivers' fields).
        self.require_staging = False
        self.abort_notified = False
        self.bootstrap_infos: list[Any] = []
        self._incoming = mgr.open_incoming(self.bootstrap_room, bootstrap_addr)

    @property
    def conclude_state(self) -> int | None:
        progress = self._incoming.progress
        return progress.state if progress.done else None

    def init(self, prefill_dp_rank: int) -> None:
        self.kv_mgr.resolve(self._incoming, int(prefill_dp_rank or 0))

    def send_metadata(self, kv_indices: np.ndarray, aux_index: int | None = None, state_indices: list | None = None,
                      decode_prefix_len: int | None = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE) -> None:
        if state_indices:
            self.kv_mgr.abort_incoming(self._incoming, "state buffers (Mamba/SWA/DSA) are not supported by this backend")
            return
        if destination != KVTransferDestination.DEVICE or decode_prefix_len:
            self.kv_mgr.abort_incoming(self._incoming, "only whole transfers to device pages are supported")
            return
        self.kv_mgr.ask(self._incoming, kv_indices, aux_index)

    def poll(self) -> int:
        incoming = self._incoming
        failure = self.kv_mgr.check_alive()
        if failure is not None:
            incoming.progress.fail(failure)
        state = incoming.progress.current()
        transfer = incoming.transfer
        if state == KVPoll.Transferring and transfer is not None:
            pulled = transfer.poll()
            if pulled is TransferState.DONE:
                self.kv_mgr.finish_incoming(incoming)
            elif pulled is TransferState.FAILED:
                self.kv_mgr.abort_incoming(incoming, f"pulling the pages failed: {transfer.error}")
            state = incoming.progress.current()
        return state

    def failure_exception(self) -> None:
        raise KVTransferError(f"KV receive of room {self.bootstrap_room} failed: {self._incoming.progress.reason}")

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """The prefill learns of an abort through `KVDoneRequest`; nothing waits on an ack."""

    def abort(self) -> None:
        self.kv_mgr.abort_incoming(self._incoming, "aborted by the decode scheduler")

    def clear(self) -> None:
        self.kv_mgr.clear_incoming(self._incoming)


KV_CLASSES: dict[str, type] = {
    "manager": OmniFlowKVManager,
    "sender": OmniFlowKVSender,
    "receiver": OmniFlowKVReceiver,
    "bootstrap_server": OmniFlowKVBootstrapServer,
}
