"""RoleWorkerCore: executes node calls of one role on its compute unit.

The pure part of a role worker: no sockets. Messages come in through `handle()` and
answers go out through the `send(identity, message)` callback it was given, all on
one event loop. The process wrapper (`engine.worker.process`) owns the sockets.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.data.credit import CreditWindow, Taken
from engine.data.peer import Peer
from engine.data.values import carries_value, decode_value, decode_value_async, encode_value, port_naming
from engine.data.wire import (
    CancelRequest,
    ErrorCode,
    ErrorReply,
    ExecuteFailed,
    ExecuteFrame,
    ExecuteProgress,
    ExecuteRequest,
    ExecuteResult,
    ExecuteStarted,
    FrameCredit,
    InputCredit,
    InputEnd,
    InputFrame,
    PortValue,
    ValueKind,
    WorkerMessage,
)
from engine.flow.discovery import WorkerLoad
from engine.spec.calls import ComputeUnit, FinalNodeError, NodeCall, NodeContext
from engine.spec.graph import RoleSpec

Send = Callable[[bytes, WorkerMessage], None]


class _InboundStream:
    """A stream-mode input port fed by InputFrame messages; read as an async iterator
    of values (tensor frames are pulled from their producer as they are read).

    With a window, the port grants its sender credit as the node takes frames. While the node
    waits on this port, empty, any other port of the call whose sender is out of credit gets
    a window more: a node that reads its ports in turn would otherwise wait forever for a
    sender held back by the port it is not reading."""

    def __init__(self, port: str, decode: Callable[[PortValue], Awaitable[Any]], window: int,
                 grant: Callable[[str, int], None], siblings: dict[str, _InboundStream]) -> None:
        self.port = port
        self._decode = decode
        self._items: deque[PortValue] = deque()
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None
        self._taken = Taken(window) if window > 0 else None
        self._received = 0
        self._granted = window
        self._grant = grant
        self._siblings = siblings

    def feed(self, value: PortValue) -> None:
        self._items.append(value)
        self._received += 1
        self._wake()
        if self._held_back() and any(s is not self and s._waiter is not None for s in self._siblings.values()):
            self._grow()

    def end(self) -> None:
        self._ended = True
        self._wake()

    def _held_back(self) -> bool:
        return self._taken is not None and not self._ended and self._received >= self._granted

    def _grow(self) -> None:
        assert self._taken is not None
        self._credit(self._taken.window)

    def _credit(self, frames: int) -> None:
        self._granted += frames
        self._grant(self.port, frames)

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None  # woken: no longer waiting on this port
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        while not self._items:
            if self._ended:
                raise StopAsyncIteration
            for other in self._siblings.values():
                if other is not self and other._held_back():
                    other._grow()
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        value = self._items.popleft()
        if self._taken is not None:
            owed = self._taken.take()
            if owed:
                self._credit(owed)
        return await self._decode(value)


@dataclass(slots=True)
class _Reply:
    """Sends one execution's answers to its caller; the first one withdraws the pending
    ExecuteStarted (`announce`), which every other answer implies."""

    identity: bytes
    send: Send
    announce: asyncio.Handle

    def __call__(self, message: WorkerMessage) -> None:
        self.announce.cancel()
        self.send(self.identity, message)


@dataclass(slots=True)
class _Execution:
    task: asyncio.Task[None]
    streams: dict[str, _InboundStream] = field(default_factory=dict)
    frames: CreditWindow | None = None  # the output frames this stream node may send ahead


@dataclass(slots=True)
class CoreStats:
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    busy_s: float = 0.0


class RoleWorkerCore:
    """Runs `ExecuteRequest`s for `role` on `unit`, at most `capacity` at once; the rest
    wait (queue depth). Input tensors are pulled from their producers through `peer`;
    outputs stay in `peer`'s store and go back as refs."""

    def __init__(
        self,
        role: RoleSpec,
        unit: ComputeUnit,
        peer: Peer,
        worker_id: str,
        send: Send,
        *,
        capacity: int,
        pull_timeout_s: float = 30.0,
    ) -> None:
        self.role = role
        self.unit = unit
        self.peer = peer
        self.worker_id = worker_id
        self._send = send
        self._slots = asyncio.Semaphore(capacity)
        self._pull_timeout_s = pull_timeout_s
        self._executions: dict[tuple[bytes, int], _Execution] = {}
        self.waiting = 0
        self.running = 0
        self.draining = False
        self.stats = CoreStats()

    # ------------------------------------------------------------------ messages
    def handle(self, identity: bytes, message: WorkerMessage) -> None:
        if isinstance(message, ExecuteRequest):
            self._start(identity, message)
        elif isinstance(message, CancelRequest):
            execution = self._executions.get((identity, message.request_id))
            if execution is not None:
                execution.task.cancel()
        elif isinstance(message, FrameCredit):
            execution = self._executions.get((identity, message.request_id))
            if execution is not None and execution.frames is not None:
                execution.frames.grant(message.frames)
        elif isinstance(message, InputFrame | InputEnd):
            execution = self._executions.get((identity, message.request_id))
            stream = None if execution is None else execution.streams.get(message.port)
            if stream is None:
                self._send(identity, ErrorReply(message.request_id, ErrorCode.BAD_REQUEST,
                                                f"no stream input {message.port!r} for request {message.request_id}"))
            elif isinstance(message, InputEnd):
                stream.end()
            else:
                stream.feed(message.value)
        else:
            self._send(identity, ErrorReply(getattr(message, "request_id", None), ErrorCode.BAD_REQUEST,
                                            f"a worker does not serve {type(message).__name__}"))

    def disconnected(self, identity: bytes) -> None:
        """The caller behind `identity` is gone: cancel what it started (nobody is left to
        take the answers)."""
        for (caller, _), execution in list(self._executions.items()):
            if caller == identity:
                execution.task.cancel()

    def _start(self, identity: bytes, request: ExecuteRequest) -> None:
        rid = request.request_id
        if self.draining:
            self._send(identity, ErrorReply(rid, ErrorCode.DRAINING, f"worker {self.worker_id} is draining"))
            return
        problem = self.unit.health()
        if problem is not None:  # it stops at its next heartbeat; meanwhile the call goes elsewhere
            self._send(identity, ErrorReply(rid, ErrorCode.DRAINING, f"worker {self.worker_id} cannot serve: {problem}"))
            return
        if request.role != self.role.name:
            self._send(identity, ErrorReply(rid, ErrorCode.WRONG_ROLE,
                                            f"worker {self.worker_id} hosts role {self.role.name!r},"
                                            f" not {request.role!r}"))
            return
        if request.window < 0:
            self._send(identity, ErrorReply(rid, ErrorCode.BAD_REQUEST,
                                            f"request {rid}: window must be 0 (no limit) or more, not {request.window}"))
            return
        key = (identity, rid)
        if key in self._executions:
            self._send(identity, ErrorReply(rid, ErrorCode.BAD_REQUEST, f"request id {rid} is already running"))
            return
        streams: dict[str, _InboundStream] = {}
        for port, value in request.inputs.items():
            if value.kind == ValueKind.STREAM:
                streams[port] = _InboundStream(port, self._decode, request.window,
                                               functools.partial(self._grant, identity, rid), streams)
        frames = CreditWindow(request.window) if request.call.stream and request.window > 0 else None
        task = asyncio.get_running_loop().create_task(self._execute(identity, request, streams, frames))
        self._executions[key] = _Execution(task, streams, frames)

    def _grant(self, identity: bytes, rid: int, port: str, frames: int) -> None:
        self._send(identity, InputCredit(rid, port, frames))

    # ----------------------------------------------------------------- execution
    async def _decode(self, value: PortValue) -> Any:
        return await decode_value_async(value, self.peer, timeout=self._pull_timeout_s)

    async def _inputs(self, request: ExecuteRequest, streams: dict[str, _InboundStream]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for port, value in request.inputs.items():
            if value.kind == ValueKind.STREAM:
                values[port] = streams[port]
            elif carries_value(value):  # nothing to pull: no wait
                values[port] = decode_value(value, self.peer, timeout=self._pull_timeout_s)
            else:
                values[port] = await decode_value_async(value, self.peer, timeout=self._pull_timeout_s)
        return values

    def _outputs(self, outputs: dict[str, Any], node_id: str) -> dict[str, PortValue]:
        return {port: encode_value(v, self.peer, where=port_naming(node_id, "output", port))
                for port, v in outputs.items()}

    async def _execute(self, identity: bytes, request: ExecuteRequest, streams: dict[str, _InboundStream],
                       frames: CreditWindow | None) -> None:
        rid = request.request_id
        send = self._send
        try:
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
            self.running += 1
            started = time.perf_counter()
            # ExecuteStarted goes out on the loop's next turn, unless an answer went first: a node
            # that finishes without suspending (a no-op, a quick python op) costs one message, not two.
            reply = _Reply(identity, send, asyncio.get_running_loop().call_soon(
                send, identity, ExecuteStarted(rid, self.worker_id)))
            try:
                await self._run(reply, request, streams, frames)
                self.stats.completed += 1
            except asyncio.CancelledError:
                self.stats.cancelled += 1
                reply.announce.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - the node's failure, reported back to the executor
                self.stats.failed += 1
                # A final error (an op refused, inputs the unit cannot take) fails the same way anywhere.
                reply(ExecuteFailed(rid, f"{type(exc).__name__}: {exc}", retryable=not isinstance(exc, FinalNodeError)))
            finally:
                self.running -= 1
                self.stats.busy_s += time.perf_counter() - started
                self._slots.release()
        finally:
            self._executions.pop((identity, rid), None)
            for stream in streams.values():
                stream.end()  # a reader still blocked in a thread (cancelled) must not keep it

    async def _run(self, reply: _Reply, request: ExecuteRequest, streams: dict[str, _InboundStream],
                   frames: CreditWindow | None) -> None:
        rid = request.request_id
        inputs = await self._inputs(request, streams)
        call = NodeCall.of(request.call, inputs)
        ctx = NodeContext(
            run_id=call.run_id,
            node_id=call.node_id,
            iteration=call.iteration,
            attempt=call.attempt,
            report_progress=lambda f, m: reply(ExecuteProgress(rid, f, m)),
        )
        if call.stream:
            index = 0
            async for frame in self.unit.execute_stream(call, ctx):
                if frames is not None:  # out of credit: the unit waits with its frame until the executor takes more
                    await frames.wait(index)
                reply(ExecuteFrame(rid, index, self._outputs(frame, call.node_id)))
                index += 1
            reply(ExecuteResult(rid, {}))
            return
        result = await self.unit.execute(call, ctx)
        reply(ExecuteResult(rid, self._outputs(result.outputs, call.node_id), result.route))

    # ------------------------------------------------------------------ lifecycle
    def load(self) -> WorkerLoad:
        """A snapshot for heartbeats (read from another thread: plain ints only)."""
        stats = self.peer.store.stats()
        return WorkerLoad(
            outstanding=self.waiting + self.running,
            queue_depth=self.waiting,
            busy=self.running > 0,
            metrics={
                "completed": float(self.stats.completed),
                "failed": float(self.stats.failed),
                "cancelled": float(self.stats.cancelled),
                "busy_s": self.stats.busy_s,
                "live_refs": float(stats.live_refs),
                "live_bytes": float(stats.live_bytes),
            },
        )

    async def drain(self, timeout_s: float) -> int:
        """Refuse new work, wait up to `timeout_s` for running work, cancel the rest.
        Returns how many executions had to be cancelled."""
        self.draining = True
        tasks = [e.task for e in self._executions.values()]
        if not tasks:
            return 0
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)
