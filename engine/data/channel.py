"""Channels: how a consumer pulls the bytes behind a `TensorRef` from the ref's owner.

One `Channel` protocol, three transports:

* `InProcessChannel` - the owner's `TensorStore` lives in this process: a read-only view
  of the stored bytes, no copy, no socket.
* `SharedMemoryChannel` - the owner is on this host: one small request over ZeroMQ tells
  which segment holds the tensor; the consumer maps it read-only and reads in place (no
  copy). Mappings are cached, so a segment the owner recycles is not mapped twice.
* `ZmqChannel` - any host: the tensor arrives as raw frames over TCP, `chunk_bytes` per
  frame with at most `window` chunks requested ahead (credit-based back-pressure: the owner
  sends only what was asked for), written straight into the consumer's buffer.

The two ZeroMQ channels share a `engine.data.peer.ZmqClient`. Every transfer has a
deadline, and a `Transfer` handle with a state (`TransferState`); a peer that does not
answer fails it with `PeerUnavailable` / `TransferTimeout` by then, never later.
A CUDA tensor in a store stays on its GPU: a consumer on the same host that has CUDA asks
for `Transport.CUDA_IPC` first and opens the producer's memory (no copy); any other gets
it staged to host memory and then by shared memory or TCP as above (see `engine.data.peer`).
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engine.data.codec import TensorData
from engine.data.tensor_store import RefNotFound, TensorStore
from engine.data.wire import ErrorCode, ErrorReply, TensorRef, Transport

if TYPE_CHECKING:
    from engine.data.peer import ZmqClient


class TransferState(enum.Enum):
    PENDING = "pending"  # accepted, waiting for a connection or a reply
    TRANSFERRING = "transferring"  # the owner answered; bytes are on their way
    DONE = "done"
    FAILED = "failed"


class TransferError(Exception):
    """Base of every transfer failure."""


class TransferTimeout(TransferError):
    """The owner answered the handshake but the transfer did not finish in time."""


class PeerUnavailable(TransferError):
    """The owner did not answer at all in time, or restarted, or the client is closed."""


class TransportUnavailable(TransferError):
    """No transport that both sides accept can carry this tensor (e.g. CUDA IPC)."""


class RemoteError(TransferError):
    """The owner answered with an `ErrorReply`."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class RefGone(RemoteError):
    """The owner holds no such tensor: released, lease expired, or never existed."""


def remote_error(reply: ErrorReply) -> TransferError:
    if reply.code == ErrorCode.NOT_FOUND:
        return RefGone(reply.code, reply.message)
    if reply.code == ErrorCode.UNSUPPORTED:
        return TransportUnavailable(reply.message)
    if reply.code in (ErrorCode.HANDSHAKE_REQUIRED, ErrorCode.VERSION_MISMATCH):
        return PeerUnavailable(f"{reply.code.name}: {reply.message}")
    return RemoteError(reply.code, reply.message)


# --- handles ---------------------------------------------------------------------------------


class Transfer:
    """Handle on one pull: `poll()` its state, `wait()` / `await wait_async()` its data.

    Thread-safe. A transfer always ends, by its deadline at the latest; `wait(timeout)` with a
    shorter timeout raises `TransferTimeout` but leaves the transfer running."""

    __slots__ = ("_callbacks", "_done", "_error", "_lock", "_result", "_state", "deadline", "ref")

    def __init__(self, ref: TensorRef | None, deadline: float) -> None:
        self.ref = ref
        self.deadline = deadline
        self._state = TransferState.PENDING
        self._result: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Callable[[], None]] = []

    def poll(self) -> TransferState:
        return self._state

    @property
    def error(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | None = None) -> TensorData:
        """The data, once done; raises the transfer's error, or `TransferTimeout` when
        `timeout` (default: until the deadline) passes first."""
        remaining = self.deadline - time.monotonic()
        # The I/O thread fails the transfer at its deadline; the grace only guards against a
        # dead I/O thread, so that this can never hang.
        limit = remaining + 1.0 if timeout is None else min(timeout, remaining + 1.0)
        if not self._done.wait(max(limit, 0.0)):
            raise TransferTimeout(f"transfer not done after {max(limit, 0.0):.3f}s")
        return self._outcome()

    async def wait_async(self) -> TensorData:
        """Like `wait()`, without blocking the event loop."""
        if not self._done.is_set():
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()

            def settle() -> None:
                if not future.done():
                    future.set_result(None)

            self._add_callback(lambda: loop.call_soon_threadsafe(settle))
            remaining = self.deadline - time.monotonic() + 1.0
            try:
                async with asyncio.timeout(max(remaining, 0.0)):
                    await future
            except TimeoutError as exc:
                raise TransferTimeout("transfer not done by its deadline") from exc
        return self._outcome()

    def _outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def _add_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def _set_transferring(self) -> None:
        if self._state is TransferState.PENDING:
            self._state = TransferState.TRANSFERRING

    def _finish(self, result: Any = None, error: BaseException | None = None) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._result = result
            self._error = error
            self._state = TransferState.FAILED if error is not None else TransferState.DONE
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
        return True

    @classmethod
    def completed(cls, ref: TensorRef | None, result: Any = None, error: BaseException | None = None) -> Transfer:
        transfer = cls(ref, time.monotonic())
        transfer._finish(result, error)
        return transfer


class Channel(Protocol):
    """Pulls a ref's bytes from its owner. `pull` never blocks on the network: it returns a
    `Transfer` that ends by `timeout` seconds from now at the latest."""

    @property
    def transport(self) -> Transport: ...

    def pull(self, ref: TensorRef, timeout: float) -> Transfer: ...

    def fetch(self, ref: TensorRef, timeout: float) -> TensorData:
        """Pull and wait in the calling thread (the lowest latency); raises `TransferError`."""
        ...

    def close(self) -> None: ...


class InProcessChannel:
    """Reads refs owned by a store in this very process: a read-only view, no copy (but of a
    lent tensor, whose bytes are not the store's)."""

    transport = Transport.LOCAL

    def __init__(self, store: TensorStore) -> None:
        self.store = store

    def pull(self, ref: TensorRef, timeout: float) -> Transfer:
        try:
            entry = self.store.get(ref.id)
            # A CUDA entry is handed over as the store's GPU tensor itself.
            buffer = entry.cuda if entry.cuda is not None else entry.data
            if entry.parts is not None:  # lent bytes, given back once released: a private copy
                copies: list[np.ndarray] = []
                self.store.serve(ref.id, lambda e: copies.append(np.concatenate(e.parts or ())))
                buffer = copies[0]
        except RefNotFound as exc:
            return Transfer.completed(ref, error=RefGone(ErrorCode.NOT_FOUND, str(exc)))
        return Transfer.completed(ref, TensorData(entry.header, buffer, Transport.LOCAL))

    def fetch(self, ref: TensorRef, timeout: float) -> TensorData:
        return self.pull(ref, timeout).wait()

    def close(self) -> None:
        """Nothing to close: the store belongs to its owner."""


class _ClientChannel:
    """A channel that asks the owner through a shared `ZmqClient` for `transport`, or for the
    bytes inline when the tensor is small enough."""

    transport: Transport

    def __init__(self, client: ZmqClient) -> None:
        self.client = client
        self._transports = (self.transport, Transport.INLINE)

    def pull(self, ref: TensorRef, timeout: float) -> Transfer:
        return self.client.pull(ref, self._transports, timeout)

    def fetch(self, ref: TensorRef, timeout: float) -> TensorData:
        return self.client.fetch(ref, self._transports, timeout)

    def close(self) -> None:
        """The client is shared; its owner closes it."""


class SharedMemoryChannel(_ClientChannel):
    """Same host: maps the owner's segment; tensors small enough to travel inline do so."""

    transport = Transport.SHM


class ZmqChannel(_ClientChannel):
    """Any host: chunked raw frames over TCP."""

    transport = Transport.TCP


async def pull_async(channel: Channel, ref: TensorRef, timeout: float) -> TensorData:
    return await channel.pull(ref, timeout).wait_async()
