"""The decode side of a transfer manager: the record of each room it receives, and its prefill lookups."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll

from engine.compute.sglang.transfer.buffers import KVBuffers
from engine.compute.sglang.transfer.config import (
    KVTransferConfigError,
    KVTransferError,
    TransferConfig,
    split_bootstrap_addr,
)
from engine.compute.sglang.transfer.dealers import Dealers
from engine.compute.sglang.transfer.loop import IOLoop, Progress
from engine.compute.sglang.transfer.messages import (
    TRANSFER_PROTOCOL_VERSION,
    BootstrapLookupReply,
    BootstrapLookupRequest,
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
from engine.data.peer import Peer

log = logging.getLogger(__name__)

_LOOKUP_RETRY_S = 0.2


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


class DecodeRooms:
    """Each room's `Incoming`: the prefill endpoint looked up at the room's bootstrap server, the
    request for the pages, the pull of their ref with `peer`, and the report of the result.

    While a room waits for the prefill to compute, the prefill is probed every `timeout_s / 4`;
    one silent for `timeout_s` fails the room. `open`, `resolve`, `ask`, `finish`, `abort` and
    `clear` are the scheduler thread's (`finish` writes the pulled pages there); the rest runs on
    the loop thread, which alone touches the rooms and the sockets."""

    def __init__(self, loop: IOLoop, peer: Peer, kv: KVBuffers, aux: KVBuffers, config: TransferConfig,
                 engine_rank: int, bootstraps: Dealers) -> None:
        self._loop = loop
        self._peer = peer
        self._kv = kv
        self._aux = aux
        self._config = config
        self._engine_rank = engine_rank
        self._bootstraps = bootstraps
        self._prefills = Dealers(loop)
        self._addresses: dict[tuple[str, int], str] = {}  # (bootstrap address, dp rank) -> prefill endpoint
        self._incoming: dict[int, Incoming] = {}

    def serve(self) -> None:
        """Loop thread: start the deadlines, retries and probes of the rooms."""
        self._loop.add_ticker(self._tick)

    def lookup_topology(self, bootstrap_addr: str) -> PrefillTopology | None:
        """The topology the prefill ranks registered at `bootstrap_addr`, or None when it has none
        yet or does not answer within `timeout_s` (an address ZeroMQ refuses is logged). Blocks the
        calling thread; never the loop thread's."""
        answer: list[TransferMessage | KVTransferConfigError | None] = []
        done = threading.Event()

        def ask() -> None:
            request = BootstrapLookupRequest(self._loop.next_id(), 0, -1)
            try:
                self._bootstraps.request(split_bootstrap_addr(bootstrap_addr), request, self._config.timeout_s,
                                         lambda r: (answer.append(r), done.set()))
            except KVTransferConfigError as exc:  # reported by the caller, never out of the I/O thread
                answer.append(exc)
                done.set()

        self._loop.call(ask)
        if not done.wait(self._config.timeout_s + 1.0):
            return None
        if isinstance(answer[0], KVTransferConfigError):
            log.error("prefill topology of %s: %s", bootstrap_addr, answer[0])
            return None
        if not isinstance(answer[0], BootstrapLookupReply):
            return None
        return answer[0].topology

    # -- the scheduler's thread ------------------------------------------------------------

    def open(self, room: int, bootstrap_addr: str) -> Incoming:
        incoming = Incoming(room, bootstrap_addr, Progress(self._config.timeout_s))
        self._loop.call(lambda: self._incoming.__setitem__(room, incoming))
        return incoming

    def resolve(self, incoming: Incoming, dp_rank: int) -> None:
        """Look up the prefill endpoint of `incoming` (the answer comes on the loop)."""
        incoming.dp_rank = dp_rank
        incoming.progress.advance(KVPoll.Bootstrapping, self._config.timeout_s)
        self._loop.call(lambda: self._lookup(incoming))

    def ask(self, incoming: Incoming, kv_indices: np.ndarray, aux_index: int | None) -> None:
        incoming.kv_indices = np.asarray(kv_indices, dtype=np.int64).copy()
        incoming.aux_index = aux_index
        self._loop.call(lambda: self._ask(incoming))

    def finish(self, incoming: Incoming) -> None:
        """Once the pull is done: write the pages, then tell the prefill."""
        assert incoming.transfer is not None and incoming.kv_indices is not None
        ok, reason = True, ""
        try:
            data = incoming.transfer.wait(0.0).torch().reshape(-1)
            kv_bytes = self._kv.nbytes(len(incoming.kv_indices))
            aux_bytes = self._aux.nbytes(1) if incoming.aux_index is not None else 0
            if data.numel() != kv_bytes + aux_bytes:
                raise KVTransferError(f"received {data.numel()} bytes, expected {kv_bytes + aux_bytes}")
            self._kv.scatter(incoming.kv_indices, data[:kv_bytes])
            if incoming.aux_index is not None:
                self._aux.scatter(np.array([incoming.aux_index]), data[kv_bytes:])
        except (KVTransferError, RuntimeError) as exc:
            ok, reason = False, f"writing the received pages failed: {exc}"
        incoming.finished = time.monotonic()
        if ok:
            incoming.progress.succeed()
        else:
            incoming.progress.fail(reason)
        self._loop.call(lambda: self._done(incoming, ok, reason))

    def abort(self, incoming: Incoming, reason: str) -> None:
        if incoming.progress.fail(reason) and incoming.asked:
            self._loop.call(lambda: self._done(incoming, False, reason))

    def clear(self, incoming: Incoming) -> None:
        def drop() -> None:
            if self._incoming.get(incoming.room) is incoming:
                del self._incoming[incoming.room]

        self._loop.call(drop)

    # -- the loop thread ----------------------------------------------------------------------

    def _lookup(self, incoming: Incoming) -> None:
        if incoming.progress.current() == KVPoll.Failed:
            return
        key = (incoming.bootstrap_addr, incoming.dp_rank)
        if key in self._addresses:
            self._found(incoming, self._addresses[key])
            return

        def on_reply(reply: TransferMessage | None) -> None:
            if isinstance(reply, BootstrapLookupReply) and reply.address:
                self._addresses[key] = reply.address
                self._found(incoming, reply.address)
            else:  # not registered yet, or no answer: ask again until the phase's deadline
                incoming.retry_at = time.monotonic() + _LOOKUP_RETRY_S

        request = BootstrapLookupRequest(self._loop.next_id(), incoming.dp_rank, self._engine_rank)
        remaining = max(incoming.progress.deadline - time.monotonic(), 0.0)
        try:
            self._bootstraps.request(split_bootstrap_addr(incoming.bootstrap_addr), request, min(remaining, 1.0),
                                     on_reply)
        except KVTransferConfigError as exc:  # this request's address: it fails, the manager serves on
            incoming.progress.fail(str(exc))

    def _found(self, incoming: Incoming, address: str) -> None:
        incoming.prefill = address
        if incoming.progress.state == KVPoll.Bootstrapping:
            incoming.progress.advance(KVPoll.WaitingForInput, self._config.waiting_timeout_s)
        self._ask(incoming)

    def _ask(self, incoming: Incoming) -> None:
        if incoming.asked or incoming.prefill is None or incoming.kv_indices is None or incoming.progress.done:
            return
        incoming.asked = True
        incoming.last_heard = time.monotonic()
        incoming.next_probe = incoming.last_heard + self._config.timeout_s / 4
        request = KVReceiveRequest(
            self._loop.next_id(), TRANSFER_PROTOCOL_VERSION, incoming.room, len(incoming.kv_indices),
            self._kv.item_lens, self._aux.item_lens, incoming.aux_index is not None,
        )
        remaining = max(incoming.progress.deadline - time.monotonic(), 0.0)
        self._prefills.request(incoming.prefill, request, remaining, lambda reply: self._on_ready(incoming, reply))

    def _on_ready(self, incoming: Incoming, reply: TransferMessage | None) -> None:
        if isinstance(reply, KVReadyEvent):
            incoming.num_pages = reply.num_pages
            incoming.nbytes = reply.ref.nbytes
            incoming.started = time.monotonic()
            incoming.progress.advance(KVPoll.Transferring, self._config.timeout_s)
            try:
                incoming.transfer = self._peer.start_pull(reply.ref, self._config.timeout_s)
            except TransferError as exc:  # this room fails; the I/O thread serves on
                incoming.progress.fail(f"pulling the pages failed: {exc}")
                self._done(incoming, False, f"pulling the pages failed: {exc}")
        elif isinstance(reply, KVFailedEvent):
            incoming.progress.fail(f"prefill side: {reply.reason}")
        else:
            incoming.progress.fail(f"the prefill did not send room {incoming.room} in time")

    def _tick(self, now: float) -> None:
        for incoming in list(self._incoming.values()):
            if incoming.progress.current(now) == KVPoll.Failed or incoming.progress.done:
                continue
            if incoming.retry_at is not None and now >= incoming.retry_at:
                incoming.retry_at = None
                self._lookup(incoming)
            elif incoming.asked and incoming.transfer is None:
                self._probe(incoming, now)

    def _probe(self, incoming: Incoming, now: float) -> None:
        if now - incoming.last_heard > self._config.timeout_s:
            silent = self._config.timeout_s
            incoming.progress.fail(f"the prefill at {incoming.prefill} stopped answering for {silent}s")
            return
        if now < incoming.next_probe or incoming.prefill is None:
            return
        incoming.next_probe = now + self._config.timeout_s / 4

        def on_status(reply: TransferMessage | None) -> None:
            if isinstance(reply, KVStatusReply):
                incoming.last_heard = time.monotonic()
                if not reply.alive:
                    incoming.progress.fail(f"prefill side: {reply.reason or 'transfer failed'}")

        request = KVStatusRequest(self._loop.next_id(), incoming.room)
        self._prefills.request(incoming.prefill, request, self._config.timeout_s, on_status)

    def _done(self, incoming: Incoming, ok: bool, reason: str) -> None:
        if incoming.prefill is None:
            return
        message = KVDoneRequest(self._loop.next_id(), incoming.room, ok, reason)
        # The answer only confirms; a lost one changes nothing on this side.
        self._prefills.request(incoming.prefill, message, self._config.timeout_s, lambda reply: None)

