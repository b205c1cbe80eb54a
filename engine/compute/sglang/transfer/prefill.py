"""The prefill side of a transfer manager: its control endpoint and the record of each room it sends."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll

from engine.compute.sglang.transfer.buffers import KVBuffers
from engine.compute.sglang.transfer.config import TransferConfig
from engine.compute.sglang.transfer.loop import IOLoop, Progress
from engine.compute.sglang.transfer.messages import (
    TRANSFER_PROTOCOL_VERSION,
    KVDoneReply,
    KVDoneRequest,
    KVFailedEvent,
    KVReadyEvent,
    KVReceiveRequest,
    KVStatusReply,
    KVStatusRequest,
)
from engine.compute.sglang.transfer.registration import BootstrapRegistration
from engine.data.peer import Peer
from engine.data.tensor_store import StoreError
from engine.data.wire import TensorRef

log = logging.getLogger(__name__)


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


class PrefillRooms:
    """The control ROUTER decode receivers ask on, and each room's `Outgoing`. A receiver's
    request that comes before the room's sender waits (`early`) until `waiting_timeout_s`.

    `open`, `complete`, `abort` and `clear` are the scheduler thread's: they hand their work to
    the loop thread, which alone touches the rooms and the socket. The payload of a room goes into
    `peer`'s tensor store when both it and the decode's request are there; the store keeps it
    until the decode reports the room done, or the room is aborted or cleared."""

    def __init__(self, loop: IOLoop, peer: Peer, kv: KVBuffers, aux: KVBuffers, config: TransferConfig,
                 registration: BootstrapRegistration) -> None:
        self._loop = loop
        self._peer = peer
        self._kv = kv
        self._aux = aux
        self._config = config
        self._registration = registration
        self.address: str | None = None
        self._control: zmq.Socket | None = None
        self._outgoing: dict[int, Outgoing] = {}
        self._early: dict[int, tuple[_Waiter, float]] = {}

    def serve(self) -> None:
        """Loop thread: bind the control endpoint on `config.host` and serve it; a bind ZeroMQ
        refuses raises its zmq.ZMQError with the socket closed (or the context could never end)."""
        socket = self._loop.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            socket.bind(f"tcp://{self._config.host}:0")
        except zmq.ZMQError:
            socket.close(linger=0)
            raise
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._control = socket
        self._loop.add_reader(socket, self._on_control)
        self._loop.add_ticker(self._expire_early)

    # -- the scheduler's thread ------------------------------------------------------------

    def open(self, room: int) -> Outgoing:
        outgoing = Outgoing(room, Progress(self._config.waiting_timeout_s))
        if self._registration.error is not None:
            outgoing.progress.fail(self._registration.error)

        def add() -> None:
            self._outgoing[room] = outgoing
            early = self._early.pop(room, None)
            if early is not None:
                self._attach(outgoing, early[0])

        self._loop.call(add)
        return outgoing

    def complete(self, outgoing: Outgoing, payload: torch.Tensor) -> None:
        """The last chunk was gathered: hand the payload to the decode side."""
        outgoing.payload = payload
        outgoing.started = time.monotonic()
        outgoing.progress.advance(KVPoll.Transferring, self._config.timeout_s)
        self._loop.call(lambda: self._publish(outgoing))

    def abort(self, outgoing: Outgoing, reason: str) -> None:
        outgoing.progress.fail(reason)

        def tell() -> None:
            self._release(outgoing)
            waiter = outgoing.waiter
            if waiter is not None:
                self._reply(waiter.identity, KVFailedEvent(waiter.request.request_id, outgoing.room, reason))

        self._loop.call(tell)

    def clear(self, outgoing: Outgoing) -> None:
        def drop() -> None:
            self._release(outgoing)
            if self._outgoing.get(outgoing.room) is outgoing:
                del self._outgoing[outgoing.room]

        self._loop.call(drop)

    # -- the loop thread ----------------------------------------------------------------------

    def _on_control(self, frames: list[bytes]) -> None:
        identity, message = frames[0], self._loop.decode(frames[-1])
        if isinstance(message, KVReceiveRequest):
            self._on_receive(_Waiter(identity, message))
        elif isinstance(message, KVStatusRequest):
            self._reply(identity, self._status(message))
        elif isinstance(message, KVDoneRequest):
            self._on_done(message)
            self._reply(identity, KVDoneReply(message.request_id))

    def _reply(self, identity: bytes, message: Any) -> None:
        assert self._control is not None, "a reply before the control endpoint is served"
        try:
            self._control.send_multipart([identity, self._loop.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the decode side is gone; its own deadline fails it
            log.warning("cannot answer a decode peer: %s", exc)

    def _on_receive(self, waiter: _Waiter) -> None:
        request = waiter.request
        if request.protocol_version != TRANSFER_PROTOCOL_VERSION:
            self._reply(waiter.identity, KVFailedEvent(request.request_id, request.room, "protocol version mismatch"))
            return
        aux_mismatch = request.aux and request.aux_item_lens != self._aux.item_lens
        if request.kv_item_lens != self._kv.item_lens or aux_mismatch:
            reason = (f"page layout mismatch: decode {request.kv_item_lens}/{request.aux_item_lens}, "
                      f"prefill {self._kv.item_lens}/{self._aux.item_lens}")
            self._reply(waiter.identity, KVFailedEvent(request.request_id, request.room, reason))
            outgoing = self._outgoing.get(request.room)
            if outgoing is not None:
                outgoing.progress.fail(reason)
            return
        outgoing = self._outgoing.get(request.room)
        if outgoing is None:
            self._early[request.room] = (waiter, time.monotonic() + self._config.waiting_timeout_s)
            return
        self._attach(outgoing, waiter)

    def _attach(self, outgoing: Outgoing, waiter: _Waiter) -> None:
        outgoing.waiter = waiter
        if outgoing.progress.state == KVPoll.Bootstrapping:
            outgoing.progress.advance(KVPoll.WaitingForInput, self._config.waiting_timeout_s)
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
            payload = payload[: self._kv.nbytes(outgoing.pages_sent)]
        try:
            outgoing.ref = self._peer.put(payload, lease_s=self._config.timeout_s)
        except (StoreError, OSError, MemoryError) as exc:  # e.g. no room in shared memory: this room fails
            reason = f"keeping the pages for the decode side failed: {type(exc).__name__}: {exc}"
            outgoing.progress.fail(reason)
            self._reply(waiter.identity, KVFailedEvent(request.request_id, outgoing.room, reason))
            return
        finally:
            outgoing.payload = None
        ready = KVReadyEvent(request.request_id, outgoing.room, outgoing.pages_sent, outgoing.ref)
        self._reply(waiter.identity, ready)

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
            self._peer.store.release(ref.id)
