"""WorkerDispatcher: runs node calls on role worker processes, the per-call protocol.

For each call a replica of the node's role is chosen (`engine.flow.replicas`), the call is sent
on that worker's connection (`engine.flow.connections`) as an `ExecuteRequest` whose inputs are
inline values or tensor refs (the worker pulls those straight from their producers), and the
worker's answers are read from the call's inbox: progress, stream frames under credit, then the
result, whose outputs stay inline values or refs: the executor never holds tensor bytes.

A worker lost before it produced anything (it stopped answering pings, closed its link, or was
unreachable) has the call retried on another replica, at most `max_node_retries` times; when
none is left the node fails with an error naming the worker and the node. A worker that
refuses the call as draining sends it elsewhere; a final error (`ExecuteFailed.retryable`
false) is never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from engine.data import framed
from engine.data.codec import MiB
from engine.data.credit import CreditWindow, Taken
from engine.data.peer import Peer
from engine.data.values import decode_value, encode_value, port_naming
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
    InputEnd,
    InputFrame,
    PortValue,
    ValueKind,
)
from engine.flow.balance import NoWorkerError
from engine.flow.connections import Connection, Connections, Inbox, Lost, WorkerLost
from engine.flow.discovery import Registry
from engine.flow.kvroute import KVRouter
from engine.flow.replicas import ReplicaChooser
from engine.flow.streams import StreamChannel
from engine.spec.calls import FinalNodeError, NodeCall, NodeContext, NodeResult, RanOn
from engine.spec.graph import RoleSpec

log = logging.getLogger(__name__)

_ANSWERS = (ExecuteStarted, ExecuteProgress, ExecuteFrame, ExecuteResult, ExecuteFailed)
"""What a worker sends about a call it runs; the first of them marks the node running."""


class NodeKillsWorkers(WorkerLost, FinalNodeError):
    """A node lost every worker it was sent to, `max_node_retries` + 1 of them: not retried
    again, not even by the node's own `retries` (it would bring down more replicas)."""


class RemoteNodeError(RuntimeError):
    """The node's own code failed on the worker."""


class FinalRemoteNodeError(RemoteNodeError, FinalNodeError):
    """The node failed on the worker in a way no retry mends (`ExecuteFailed.retryable` false):
    an op the worker refuses, inputs its unit cannot take."""


@dataclass(frozen=True, slots=True)
class _Outbound:
    """A stream input of a call: its frames go to the worker as they come (`_forward`)."""

    port: str
    source: AsyncIterator[Any]
    window: CreditWindow | None


class WorkerDispatcher:
    """Dispatches to the workers `registry` lists. `peer` is this process's seat on the
    transfer plane (tensors given as run inputs are served from it). `kv_router` gives roles
    balanced `kv_aware` the prompt's page keys and the pages each worker holds (default:
    `KVRouter.for_registry(registry)`, see `engine.flow.kvroute`). A node whose worker is lost
    before it answered goes to another replica, at most `max_node_retries` times: a node that
    brings its worker down (a poison input) would otherwise bring down every replica in turn.
    Stream frames flow under credit: a worker sends at most `stream_window` output frames the
    executor has not taken, and is sent at most that many of each stream input it has not
    read (0: no limit; see `engine.data.credit`). The workers' sockets are reached with
    `peer.keys`, the worker plane's CURVE keys (`engine.data.curve`): the dispatcher is a
    client only, so it refuses nobody itself. `local_streams=False`: reach every worker over
    ZeroMQ TCP, as across hosts, even one with a local socket in this network namespace (the
    benchmarks measure both paths)."""

    def __init__(
        self,
        registry: Registry,
        peer: Peer,
        *,
        heartbeat_s: float = 0.5,
        connect_timeout_s: float = 10.0,
        registry_refresh_s: float = 0.5,
        no_worker_wait_s: float = 2.0,
        max_message_bytes: int = 64 * MiB,
        kv_router: KVRouter | None = None,
        poll_after_send_s: float = 200e-6,
        max_node_retries: int = 2,
        stream_window: int = 64,
        local_streams: bool = True,
    ) -> None:
        if stream_window < 0:
            raise ValueError(f"stream_window must be 0 (no limit) or more, not {stream_window}")
        if max_node_retries < 0:
            raise ValueError(f"max_node_retries must be >= 0, got {max_node_retries}")
        self._stream_window = stream_window
        self._peer = peer
        self._replicas = ReplicaChooser(registry, kv_router if kv_router is not None else KVRouter.for_registry(registry),
                                        registry_refresh_s=registry_refresh_s, no_worker_wait_s=no_worker_wait_s)
        self._connections = Connections(peer, heartbeat_s=heartbeat_s, connect_timeout_s=connect_timeout_s,
                                        max_message_bytes=max_message_bytes, local_streams=local_streams,
                                        on_lost=lambda conn: self._replicas.forget(conn.worker.info.role))
        self._codec = self._connections.codec
        self._ids = itertools.count(1)
        self._poll_after_send_s = poll_after_send_s
        self._max_node_retries = max_node_retries
        self._polling_until = 0.0
        self._polling = False
        self._awaiting = 0
        """Calls sent whose worker has not answered yet."""

    @property
    def _closed(self) -> bool:
        return self._connections.closed

    # ----------------------------------------------------------------- execution
    async def _open_call(
        self, role: RoleSpec, call: NodeCall, excluded: set[str]
    ) -> tuple[Connection, int, Inbox, list[_Outbound]]:
        """Send `call` to a worker of `role`; its connection, request id and inbox, and its
        stream inputs, for `_forward` once the worker took the call."""
        if self._closed:
            raise WorkerLost(f"node {call.node_id!r}: the dispatcher is closed")
        try:
            worker = await self._replicas.choose(role, call, excluded, self._connections.usable)
        except NoWorkerError:
            raise WorkerLost(f"no live worker of role {role.name!r} for node {call.node_id!r}"
                             + (f" (lost: {', '.join(sorted(excluded))})" if excluded else "")) from None
        conn = self._connections.open_connection(worker) or await self._connections.connect(worker)
        if self._closed:
            raise WorkerLost(f"node {call.node_id!r}: the dispatcher is closed")
        rid = next(self._ids)
        inbox: Inbox = Inbox()
        conn.inboxes[rid] = inbox
        wid = worker.info.worker_id
        self._replicas.sent(wid)
        outbound: list[_Outbound] = []
        opened = False
        try:
            if conn.lost is not None:
                inbox.put_nowait(Lost(conn.lost, reached=False))
                opened = True
                return conn, rid, inbox, outbound
            inputs: dict[str, PortValue] = {}
            streams: list[tuple[str, AsyncIterator[Any]]] = []
            for port, value in call.inputs.items():
                if isinstance(value, AsyncIterator):
                    inputs[port] = PortValue(ValueKind.STREAM)
                    streams.append((port, value))
                else:
                    inputs[port] = encode_value(value, self._peer, where=port_naming(call.node_id, "input", port))
            request = ExecuteRequest(rid, role.name, call.header(), inputs, self._stream_window)
            windows = {port: CreditWindow(self._stream_window) for port, _ in streams} if self._stream_window else {}
            if windows:
                conn.windows[rid] = windows
            assert conn.control is not None
            try:
                await conn.control.send(self._codec.encode(request))
            except (framed.StreamClosedError, zmq.ZMQError) as exc:
                # The link was cut (the worker lost, the dispatcher closed) while the request waited
                # for room, or ended before its end was seen: the call's inbox says so.
                self._connections.lose(conn, f"worker {wid} (pid {worker.info.pid}): control connection ended ({exc})")
            else:
                outbound = [_Outbound(p, s, windows.get(p)) for p, s in streams]
            opened = True
        finally:
            if not opened:  # an error (or a cancellation) before the request was out
                self._forget_call(conn, rid)
        return conn, rid, inbox, outbound

    def _await_answer(self) -> bool:
        """Count a call that waits for its worker's first answer, and keep the event loop polling
        rather than sleeping for `poll_after_send_s` after it went out (True: counted).

        A quick node answers within tens of microseconds, but a process asleep in epoll pays
        for its wake-up: on a virtual machine whose idle CPUs halt, 20-40 us per wake-up, as
        much as the rest of the hop. A callback that reschedules itself keeps the loop's epoll
        at a zero timeout, so the answer is read as it lands. The cost is this process's CPU
        for at most the window per call, and none once every call in flight was answered."""
        if self._poll_after_send_s <= 0:
            return False
        self._awaiting += 1
        self._polling_until = time.perf_counter() + self._poll_after_send_s
        if not self._polling:
            self._polling = True
            loop = asyncio.get_running_loop()
            loop.call_soon(self._poll, loop)
        return True

    def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._awaiting and not self._closed and time.perf_counter() < self._polling_until:
            loop.call_soon(self._poll, loop)
        else:
            self._polling = False

    async def _forward(self, conn: Connection, rid: int, call: NodeCall, outbound: _Outbound) -> None:
        """Send the frames of a stream input as they come, each once the worker has credit for
        it: until then the frame stays with its source, which holds its producer."""
        control = conn.control
        assert control is not None
        port, source, window = outbound.port, outbound.source, outbound.window
        if isinstance(source, StreamChannel):
            source.relay()  # the worker tells when its node starves, by its credit
        sent = 0
        # A connection that ends is the call's loss, reported through its inbox (`_lose`).
        with contextlib.suppress(framed.StreamClosedError, zmq.ZMQError):
            while True:
                if window is not None:
                    await window.wait(sent)
                    if window.closed:
                        return
                try:
                    value = await anext(source)
                except StopAsyncIteration:
                    break
                frame = InputFrame(rid, port, encode_value(value, self._peer,
                                                           where=port_naming(call.node_id, "input", port)))
                await control.send(self._codec.encode(frame))
                sent += 1
            await control.send(self._codec.encode(InputEnd(rid, port)))

    def _close_call(self, conn: Connection, rid: int, forwarders: list[asyncio.Task[None]], finished: bool) -> None:
        self._forget_call(conn, rid)
        for task in forwarders:
            task.cancel()
        if not finished:
            self._connections.post(conn, CancelRequest(rid))

    def _forget_call(self, conn: Connection, rid: int) -> None:
        conn.inboxes.pop(rid, None)
        conn.windows.pop(rid, None)
        self._replicas.ended(conn.worker.info.worker_id)

    def _outputs(self, outputs: dict[str, PortValue]) -> dict[str, Any]:
        return {port: decode_value(v, self._peer, timeout=0.0, materialize=False) for port, v in outputs.items()}

    async def _messages(
        self, role: RoleSpec, call: NodeCall, ctx: NodeContext, started: Callable[[RanOn], None]
    ) -> AsyncIterator[ExecuteFrame | ExecuteResult]:
        """Frames and the final result of `call`, moving to another replica when a worker is lost
        before it produced anything."""
        excluded: set[str] = set()
        lost: list[str] = []
        produced = False
        announced = False
        while True:
            conn, rid, inbox, outbound = await self._open_call(role, call, excluded)
            forwarders: list[asyncio.Task[None]] = []
            taken = Taken(self._stream_window) if call.stream and self._stream_window > 0 else None
            finished = False
            awaiting = self._await_answer()
            try:
                while True:
                    message = await inbox.get()
                    if awaiting:
                        awaiting = False
                        self._awaiting -= 1
                    # A worker may skip ExecuteStarted when an answer is ready at once: any
                    # answer from the node says it started.
                    if isinstance(message, _ANSWERS):
                        if not announced:
                            announced = True
                            started(conn.where)
                        if outbound and not forwarders:
                            # The worker took the call: a refusal (draining, say) would have
                            # moved it elsewhere with none of its stream's frames gone.
                            loop = asyncio.get_running_loop()
                            forwarders = [loop.create_task(self._forward(conn, rid, call, o)) for o in outbound]
                    if isinstance(message, ExecuteProgress):
                        ctx.progress(message.progress, message.message)
                    elif isinstance(message, ExecuteFrame):
                        produced = True
                        yield message  # back when the executor took the frame
                        owed = 0 if taken is None else taken.take()
                        if owed:
                            self._connections.post(conn, FrameCredit(rid, owed))
                    elif isinstance(message, ExecuteResult):
                        finished = True
                        yield message
                        return
                    elif isinstance(message, ExecuteFailed):
                        finished = True
                        raise (RemoteNodeError if message.retryable else FinalRemoteNodeError)(message.error)
                    elif isinstance(message, ErrorReply):
                        finished = True
                        if message.code in (ErrorCode.DRAINING,):
                            excluded.add(conn.worker.info.worker_id)
                            break
                        raise RemoteNodeError(f"worker {conn.worker.info.worker_id} refused node"
                                              f" {call.node_id!r}: {message.message}")
                    elif isinstance(message, Lost):
                        finished = True
                        if self._closed:
                            raise WorkerLost(f"node {call.node_id!r}: {message.reason}")
                        wid = conn.worker.info.worker_id
                        excluded.add(wid)
                        if message.reached:
                            lost.append(wid)
                        if produced or forwarders:
                            raise WorkerLost(f"{message.reason} while streaming node {call.node_id!r};"
                                             " a stream cannot be resumed elsewhere")
                        if len(lost) > self._max_node_retries:
                            # A node that brings its worker down would bring down every replica it is sent to.
                            raise NodeKillsWorkers(f"{message.reason}; node {call.node_id!r} lost every worker it"
                                                   f" was sent to ({len(lost)}: {', '.join(lost)}) and is not"
                                                   " retried again")
                        log.warning("retrying node %r of run %s elsewhere: %s", call.node_id, call.run_id,
                                    message.reason)
                        break
            finally:
                if awaiting:
                    self._awaiting -= 1
                self._close_call(conn, rid, forwarders, finished)

    async def execute(
        self, role: RoleSpec, call: NodeCall, ctx: NodeContext, started: Callable[[RanOn], None]
    ) -> NodeResult:
        result: ExecuteResult | None = None
        async with contextlib.aclosing(self._messages(role, call, ctx, started)) as messages:
            async for message in messages:  # to its end: the result is its last message
                if isinstance(message, ExecuteResult):
                    result = message
        if result is None:
            raise WorkerLost(f"node {call.node_id!r} ended without a result")
        return NodeResult(outputs=self._outputs(result.outputs), route=result.route)

    async def execute_stream(
        self, role: RoleSpec, call: NodeCall, ctx: NodeContext, started: Callable[[RanOn], None]
    ) -> AsyncIterator[dict[str, Any]]:
        async with contextlib.aclosing(self._messages(role, call, ctx, started)) as messages:
            async for message in messages:
                if isinstance(message, ExecuteFrame):
                    yield self._outputs(message.outputs)

    async def close(self) -> None:
        if self._closed:
            return
        await self._connections.close()
        self._replicas.close()
