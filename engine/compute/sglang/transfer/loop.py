"""The I/O thread of a transfer manager, and the `KVPoll` progress of one transfer."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from sglang.srt.disaggregation.base.conn import KVPoll

from engine.compute.sglang.transfer.messages import TransferMessage
from engine.data.codec import WireCodec, WireError

log = logging.getLogger(__name__)

MAX_CONTROL_BYTES = 1 << 20
POLL_MS = 20  # the I/O threads' poll interval: how late a deadline or queued call may be seen


class Progress:
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


class IOLoop:
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
        self._codec = WireCodec(MAX_CONTROL_BYTES, TransferMessage)
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
                for socket, _ in self._poller.poll(POLL_MS) if self._readers else ():
                    self._read(socket)
                if not self._readers:
                    self._stop.wait(POLL_MS / 1000)
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
        except BaseException as exc:  # recorded for the manager, which reports it to its callers
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
