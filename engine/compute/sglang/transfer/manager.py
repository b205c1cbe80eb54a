"""The transfer manager of one scheduler (tp rank): endpoints, buffers and the per-room records."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq
from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    KVArgs,
    KVPoll,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from engine.compute.sglang.transfer.buffers import KVBuffers, kv_device
from engine.compute.sglang.transfer.config import (
    KVTransferConfigError,
    KVTransferError,
    TransferConfig,
    split_bootstrap_addr,
)
from engine.compute.sglang.transfer.loop import IOLoop, Progress
from engine.compute.sglang.transfer.messages import (
    TRANSFER_PROTOCOL_VERSION,
    BootstrapLookupReply,
    BootstrapLookupRequest,
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
from engine.data.channel import Transfer, TransferError
from engine.data.peer import Peer, PeerConfig, ServerConfig
from engine.data.tensor_store import StoreError
from engine.data.wire import TensorRef

log = logging.getLogger(__name__)

_LOOKUP_RETRY_S = 0.2


@dataclass(slots=True, eq=False)
class _Waiter:
    """A decode receiver waiting on a prefill ROUTER for a room."""

    identity: bytes
    request: KVReceiveRequest


@dataclass(slots=True, eq=False)
class Outgoing:
    room: int
    progress: Progress
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
class Incoming:
    room: int
    bootstrap_addr: str
    progress: Progress
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
        self.kv = KVBuffers.of(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, kv_device(server_args, args))
        self.aux = KVBuffers.of(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, torch.device("cpu"))
        self.peer = Peer(PeerConfig(server=ServerConfig(bind=f"tcp://{self.config.host}:0"),
                                    default_timeout_s=self.config.timeout_s))
        with contextlib.ExitStack() as undo:
            undo.callback(self.peer.close)
            self.loop = IOLoop(f"omniflow-kv-{self.mode.value}-{self.engine_rank}")
            undo.pop_all()
        self.prefill_info_table: dict[str, Any] = {}
        self.address: str | None = None
        self.registered = threading.Event()
        self.registration_error: str | None = None
        self._outgoing: dict[int, Outgoing] = {}
        self._early: dict[int, tuple[_Waiter, float]] = {}
        self._incoming: dict[int, Incoming] = {}
        self._bootstraps: dict[str, zmq.Socket] = {}
        self._prefills: dict[str, zmq.Socket] = {}
        self._addresses: dict[tuple[str, int], str] = {}
        self._closed = False
        ready = threading.Event()
        failed: list[zmq.ZMQError] = []
        self.loop.call(lambda: self._open(ready, failed))
        with contextlib.ExitStack() as undo:
            undo.callback(self.close)  # SGLang drops a manager that failed to build: its thread and sockets end here
            if not ready.wait(self.config.timeout_s):
                raise KVTransferError("the KV transfer I/O thread did not start"
                                      + (f": {self.loop.failure!r}" if self.loop.failure is not None else ""))
            if failed:
                raise KVTransferConfigError(f"cannot open the control endpoint on {self.config.host}: {failed[0]}")
            if self.mode == DisaggregationMode.PREFILL:
                self.register_to_bootstrap()
            undo.pop_all()

    # -- loop-thread setup ---------------------------------------------------------------

    def _open(self, ready: threading.Event, failed: list[zmq.ZMQError]) -> None:
        """Loop thread: the prefill's control endpoint; a bind ZeroMQ refuses is put in `failed`
        (with its socket closed, or the context could never end) and `ready` set either way."""
        if self.mode == DisaggregationMode.PREFILL:
            socket = self.loop.context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            try:
                socket.bind(f"tcp://{self.config.host}:0")
            except zmq.ZMQError as exc:
                socket.close(linger=0)
                failed.append(exc)
                ready.set()
                return
            self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            self._control = socket
            self.loop.add_reader(socket, self._on_control)
            self.loop.add_ticker(self._expire_early)
        else:
            self.loop.add_ticker(self._tick_incoming)
        ready.set()

    def _dealer(self, table: dict[str, zmq.Socket], endpoint: str) -> zmq.Socket:
        """The DEALER connected to `endpoint`; KVTransferConfigError if ZeroMQ refuses the endpoint
        (a host it cannot parse: raised out of a loop callback, it would end the I/O thread)."""
        socket = table.get(endpoint)
        if socket is None:
            socket = self.loop.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            try:
                socket.connect(endpoint)
            except zmq.ZMQError as exc:
                socket.close(linger=0)
                raise KVTransferConfigError(f"cannot connect to {endpoint}: {exc}") from exc
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
            try:
                socket = self._dealer(self._bootstraps, endpoint)
            except KVTransferConfigError as exc:
                self.registration_error = f"registering at the bootstrap server: {exc}"
                log.error("%s", self.registration_error)
                return
            self.loop.request(socket, request, min(remaining, 1.0), on_reply)

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

    def _attach(self, outgoing: Outgoing, waiter: _Waiter) -> None:
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

    def open_outgoing(self, room: int) -> Outgoing:
        outgoing = Outgoing(room, Progress(self.config.waiting_timeout_s))
        if self.registration_error is not None:
            outgoing.progress.fail(self.registration_error)

        def add() -> None:
            self._outgoing[room] = outgoing
            early = self._early.pop(room, None)
            if early is not None:
                self._attach(outgoing, early[0])

        self.loop.call(add)
        return outgoing

    def complete(self, outgoing: Outgoing, payload: torch.Tensor) -> None:
        """The last chunk was gathered (caller thread): hand the payload to the decode side."""
        outgoing.payload = payload
        outgoing.started = time.monotonic()
        outgoing.progress.advance(KVPoll.Transferring, self.config.timeout_s)
        self.loop.call(lambda: self._publish(outgoing))

    def _publish(self, outgoing: Outgoing) -> None:
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
        try:
            outgoing.ref = self.peer.put(payload, lease_s=self.config.timeout_s)
        except (StoreError, OSError, MemoryError) as exc:  # e.g. no room in shared memory: this room fails
            reason = f"keeping the pages for the decode side failed: {type(exc).__name__}: {exc}"
            outgoing.progress.fail(reason)
            self._reply(waiter.identity, KVFailedEvent(request.request_id, outgoing.room, reason))
            return
        finally:
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

    def _release(self, outgoing: Outgoing) -> None:
        ref, outgoing.ref = outgoing.ref, None
        if ref is not None:
            self.peer.store.release(ref.id)

    def abort_outgoing(self, outgoing: Outgoing, reason: str) -> None:
        outgoing.progress.fail(reason)

        def tell() -> None:
            self._release(outgoing)
            waiter = outgoing.waiter
            if waiter is not None:
                self._reply(waiter.identity, KVFailedEvent(waiter.request.request_id, outgoing.room, reason))

        self.loop.call(tell)

    def clear_outgoing(self, outgoing: Outgoing) -> None:
        def drop() -> None:
            self._release(outgoing)
            if self._outgoing.get(outgoing.room) is outgoing:
                del self._outgoing[outgoing.room]

        self.loop.call(drop)

    # -- decode ----------------------------------------------------------------------------

    def open_incoming(self, room: int, bootstrap_addr: str) -> Incoming:
        incoming = Incoming(room, bootstrap_addr, Progress(self.config.timeout_s))
        self.loop.call(lambda: self._incoming.__setitem__(room, incoming))
        return incoming

    def resolve(self, incoming: Incoming, dp_rank: int) -> None:
        """Look up the prefill endpoint of `incoming` (caller thread; the answer comes on the loop)."""
        incoming.dp_rank = dp_rank
        incoming.progress.advance(KVPoll.Bootstrapping, self.config.timeout_s)
        self.loop.call(lambda: self._lookup(incoming))

    def _lookup(self, incoming: Incoming) -> None:
        if incoming.progress.current() == KVPoll.Failed:
            return
        key = (incoming.bootstrap_addr, incoming.dp_rank)
        if key in self._addresses:
            self._found(incoming, self._addresses[key])
            return
        try:
            socket = self._dealer(self._bootstraps, split_bootstrap_addr(incoming.bootstrap_addr))
        except KVTransferConfigError as exc:  # this request's address: it fails, the manager serves on
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
        self.loop.request(socket, request, min(remaining, 1.0), on_reply)

    def _found(self, incoming: Incoming, address: str) -> None:
        incoming.prefill = address
        if incoming.progress.state == KVPoll.Bootstrapping:
            incoming.progress.advance(KVPoll.WaitingForInput, self.config.waiting_timeout_s)
        self._ask(incoming)

    def ask(self, incoming: Incoming, kv_indices: np.ndarray, aux_index: int | None) -> None:
        incoming.kv_indices = np.asarray(kv_indices, dtype=np.int64).copy()
        incoming.aux_index = aux_index
        self.loop.call(lambda: self._ask(incoming))

    def _ask(self, incoming: Incoming) -> None:
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

    def _on_ready(self, incoming: Incoming, reply: TransferMessage | None) -> None:
        if isinstance(reply, KVReadyEvent):
            incoming.num_pages = reply.num_pages
            incoming.nbytes = reply.ref.nbytes
            incoming.started = time.monotonic()
            incoming.progress.advance(KVPoll.Transferring, self.config.timeout_s)
            try:
                incoming.transfer = self.peer.start_pull(reply.ref, self.config.timeout_s)
            except TransferError as exc:  # this room fails; the I/O thread serves on
                incoming.progress.fail(f"pulling the pages failed: {exc}")
                self._done(incoming, False, f"pulling the pages failed: {exc}")
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

    def _probe(self, incoming: Incoming, now: float) -> None:
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

    def finish_incoming(self, incoming: Incoming) -> None:
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

    def _done(self, incoming: Incoming, ok: bool, reason: str) -> None:
        if incoming.prefill is None:
            return
        message = KVDoneRequest(self.loop.next_id(), incoming.room, ok, reason)
        # The answer only confirms; a lost one changes nothing on this side.
        self.loop.request(self._dealer(self._prefills, incoming.prefill), message, self.config.timeout_s,
                          lambda reply: None)

    def abort_incoming(self, incoming: Incoming, reason: str) -> None:
        if incoming.progress.fail(reason) and incoming.asked:
            self.loop.call(lambda: self._done(incoming, False, reason))

    def clear_incoming(self, incoming: Incoming) -> None:
        def drop() -> None:
            if self._incoming.get(incoming.room) is incoming:
                del self._incoming[incoming.room]

        self.loop.call(drop)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's decode scheduler asks this before creating receivers for `bootstrap_addr`:
        one lookup of the prefill topology, at most `timeout_s` long."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        # As SGLang's own managers do, a failed attempt is logged and answers False: the decode
        # scheduler retries, then aborts the address's requests.
        answer: list[TransferMessage | KVTransferConfigError | None] = []
        done = threading.Event()

        def ask() -> None:
            request = BootstrapLookupRequest(self.loop.next_id(), 0, -1)
            try:
                socket = self._dealer(self._bootstraps, split_bootstrap_addr(bootstrap_addr))
            except KVTransferConfigError as exc:  # reported by the caller, never out of the I/O thread
                answer.append(exc)
                done.set()
                return
            self.loop.request(socket, request, self.config.timeout_s, lambda r: (answer.append(r), done.set()))

        self.loop.call(ask)
        if not done.wait(self.config.timeout_s + 1.0):
            return False
        if isinstance(answer[0], KVTransferConfigError):
            log.error("prefill topology of %s: %s", bootstrap_addr, answer[0])
            return False
        if not isinstance(answer[0], BootstrapLookupReply):
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
