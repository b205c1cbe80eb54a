"""WorkerDispatcher: runs node calls on role worker processes over ZeroMQ.

For each call it picks a live worker of the node's role with the role's load-balancing
policy, sends an `ExecuteRequest` whose inputs are inline values or tensor refs (the
worker pulls those straight from their producers), and returns the worker's outputs
as inline values or refs: the executor never holds tensor bytes.

A worker that stops answering pings for two heartbeat intervals is declared lost: its
calls are retried on another replica, and when none is left the node fails with an
error naming the worker and the node.

The registry is a directory, not the source of truth on liveness: while it is unreachable
the dispatcher keeps using the workers it last read, and when it lists no worker at all
for a role (a restarted Redis before the workers' next heartbeats re-register them, or
workers still starting) a call looks again for up to `no_worker_wait_s` before failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from engine.data import framed
from engine.data.codec import MiB, WireCodec, WireError
from engine.data.credit import CreditWindow, Taken
from engine.data.curve import connect_as_client
from engine.data.peer import Peer
from engine.data.shm import local_namespace
from engine.data.values import decode_value, encode_value
from engine.data.wire import (
    PROTOCOL_VERSION,
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
    HelloReply,
    HelloRequest,
    InputCredit,
    InputEnd,
    InputFrame,
    PingReply,
    PingRequest,
    PortValue,
    ValueKind,
    WorkerMessage,
)
from engine.flow.balance import (
    BalanceRequest,
    ConsistentHash,
    KVAware,
    NoWorkerError,
    Policy,
    candidates_from,
    make_policy,
)
from engine.flow.discovery import Registry, RegistryError, WorkerSnapshot
from engine.flow.kvroute import NO_HINT, KVRouter
from engine.flow.links import ControlLink, DealerLink, LoopSocket
from engine.flow.streams import StreamChannel
from engine.spec.calls import FinalNodeError, NodeCall, NodeContext, NodeResult, RanOn
from engine.spec.graph import RoleSpec

log = logging.getLogger(__name__)

_NO_WORKER_POLL_S = 0.05
"""How often a call that found no worker of its role reads the registry again."""

_ANSWERS = (ExecuteStarted, ExecuteProgress, ExecuteFrame, ExecuteResult, ExecuteFailed)
"""What a worker sends about a call it runs; the first of them marks the node running."""

def _retrieve(sent: asyncio.Future[None]) -> None:
    """Mark a send's failure seen: the connection's loss reports it."""
    if not sent.cancelled():
        sent.exception()


class WorkerLost(RuntimeError):
    """A worker died or stopped answering while it held a node execution."""


class NodeKillsWorkers(WorkerLost, FinalNodeError):
    """A node lost every worker it was sent to, `max_node_retries` + 1 of them: not retried
    again, not even by the node's own `retries` (it would bring down more replicas)."""


class RemoteNodeError(RuntimeError):
    """The node's own code failed on the worker."""


class FinalRemoteNodeError(RemoteNodeError, FinalNodeError):
    """The node failed on the worker in a way no retry mends (`ExecuteFailed.retryable` false):
    an op the worker refuses, inputs its unit cannot take."""


class _Lost:
    """Put into a call's inbox when its worker is lost; `reached`: after the request went out
    (else the worker was lost, or unreachable, before it had the call)."""

    __slots__ = ("reason", "reached")

    def __init__(self, reason: str, reached: bool = True) -> None:
        self.reason = reason
        self.reached = reached


@dataclass(frozen=True, slots=True)
class _Outbound:
    """A stream input of a call: its frames go to the worker as they come (`_forward`)."""

    port: str
    source: AsyncIterator[Any]
    window: CreditWindow | None


class _Inbox:
    """What a worker sent for one call, in order; read by that call only (a lighter
    `asyncio.Queue`: one reader, never full)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


@dataclass(slots=True)
class _Connection:
    worker: WorkerSnapshot
    control: ControlLink | None
    liveness: zmq.asyncio.Socket
    inboxes: dict[int, _Inbox] = field(default_factory=dict)
    windows: dict[int, dict[str, CreditWindow]] = field(default_factory=dict)
    """Per call: the credit the worker granted for each stream-mode input port."""
    pinger: asyncio.Task[None] | None = None
    lost: str | None = None
    ready: asyncio.Future[None] | None = None


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
        self._stream_window = stream_window
        self._registry = registry
        self._peer = peer
        self._kv_router = kv_router if kv_router is not None else KVRouter.for_registry(registry)
        self._heartbeat_s = heartbeat_s
        self._connect_timeout_s = connect_timeout_s
        self._refresh_s = registry_refresh_s
        self._no_worker_wait_s = no_worker_wait_s
        self._context = zmq.asyncio.Context()
        self._control_context = zmq.Context()
        self._codec = WireCodec(max_message_bytes, WorkerMessage)
        self._max_message_bytes = max_message_bytes
        self._connections: dict[str, _Connection] = {}
        self._policies: dict[str, Policy] = {}
        self._sessions: dict[str, Policy] = {}
        self._outstanding: dict[str, int] = {}
        self._workers: dict[str, tuple[float, list[WorkerSnapshot]]] = {}
        self._ids = itertools.count(1)
        self._local_ns = local_namespace() if local_streams else None
        self._closed = False
        self._poll_after_send_s = poll_after_send_s
        if max_node_retries < 0:
            raise ValueError(f"max_node_retries must be >= 0, got {max_node_retries}")
        self._max_node_retries = max_node_retries
        self._polling_until = 0.0
        self._polling = False
        self._awaiting = 0
        """Calls sent whose worker has not answered yet."""

    # ------------------------------------------------------------------ choosing
    async def _snapshots(self, role: str, *, fresh: bool = False) -> list[WorkerSnapshot]:
        """The workers the registry lists for `role`, read at most every `registry_refresh_s`
        (or now, with `fresh`). While the registry fails, the last list read stands in for it."""
        cached = self._workers.get(role)
        now = time.monotonic()
        if cached is not None and not fresh and now - cached[0] <= self._refresh_s:
            return cached[1]
        try:
            listed = await self._registry.workers(role)
        except RegistryError as exc:
            if cached is None:
                raise
            log.warning("registry unavailable (%s); dispatching role %r to the %d worker(s) it last listed",
                        exc, role, len(cached[1]))
            self._workers[role] = (now, cached[1])
            return cached[1]
        self._workers[role] = (now, listed)
        return listed

    def _policy(self, role: RoleSpec) -> Policy:
        policy = self._policies.get(role.name)
        if policy is None:
            policy = self._policies[role.name] = make_policy(role.balance, role=role.name, **role.balance_params)
        return policy

    def _session_policy(self, role: RoleSpec) -> Policy:
        """For the calls with a `session` param (a string), whatever the role's policy: a
        session's history lives on one worker, so they go to one replica, the one the session
        (its key within the call's tenant, `NodeCall.session_key`) hashes to among the live ones."""
        if role.balance == ConsistentHash.name:
            return self._policy(role)
        policy = self._sessions.get(role.name)
        if policy is None:
            policy = self._sessions[role.name] = ConsistentHash(role=role.name)
        return policy

    async def _listed(self, role: str) -> list[WorkerSnapshot]:
        """`_snapshots(role)`, looking again for up to `no_worker_wait_s` while it lists nobody.
        Raises WorkerLost when the registry cannot be read and nothing was read before."""
        deadline = time.monotonic() + self._no_worker_wait_s
        fresh = False
        while True:
            try:
                listed = await self._snapshots(role, fresh=fresh)
            except RegistryError as exc:
                if time.monotonic() >= deadline:
                    raise WorkerLost(f"cannot find workers of role {role!r}: {exc}") from exc
                listed = []
            if listed or time.monotonic() >= deadline:
                return listed
            await asyncio.sleep(_NO_WORKER_POLL_S)
            fresh = True

    async def _choose(self, role: RoleSpec, call: NodeCall, excluded: set[str]) -> WorkerSnapshot:
        snapshots = [
            s for s in await self._listed(role.name)
            if s.info.worker_id not in excluded
            and (s.info.worker_id not in self._connections or self._connections[s.info.worker_id].lost is None)
        ]
        by_id = {s.info.worker_id: s for s in snapshots}
        session = call.session_key()
        hint = (await self._kv_router.hint(role, call, snapshots)
                if role.balance == KVAware.name and session is None else NO_HINT)
        candidates = candidates_from(snapshots, outstanding=self._outstanding, cached=hint.cached)
        request = BalanceRequest(request_id=f"{call.run_id}/{call.node_id}/{call.iteration}",
                                 session_key=session, prefix_pages=hint.pages)
        policy = self._policy(role) if session is None else self._session_policy(role)
        return by_id[policy.choose(request, candidates)]

    # --------------------------------------------------------------- connections
    def _control_address(self, worker: WorkerSnapshot) -> str:
        """The worker's abstract Unix socket when it shares this process's network namespace
        (`engine.data.shm.local_namespace`), else its TCP address."""
        meta = worker.info.meta
        local = str(meta.get("local") or "")
        if self._local_ns is not None and meta.get("local_ns") == self._local_ns and local.startswith(framed.SCHEME):
            return local
        return worker.info.address

    async def _connection(self, worker: WorkerSnapshot) -> _Connection:
        wid = worker.info.worker_id
        if self._closed:
            raise WorkerLost(f"worker {wid}: the dispatcher is closed")
        while True:
            conn = self._connections.get(wid)
            if conn is None or conn.lost is not None or conn.worker.info.address != worker.info.address:
                break
            if conn.ready is None or conn.ready.done():
                return conn
            await asyncio.shield(conn.ready)  # another call is connecting: share its outcome
            if self._connections.get(wid) is conn:
                return conn
            # That attempt was withdrawn (its caller was cancelled): look again.
        if conn is not None:  # lost, or the worker id now listens elsewhere: its calls go elsewhere too
            self._lose(conn, f"worker {wid} moved from {conn.worker.info.address} to {worker.info.address}")
            self._close_connection(conn)
        liveness = self._context.socket(zmq.DEALER)
        liveness.setsockopt(zmq.LINGER, 0)
        connect_as_client(liveness, self._peer.keys)
        liveness.connect(str(worker.info.meta["liveness"]))
        conn = _Connection(worker, None, liveness)
        ready = conn.ready = asyncio.get_running_loop().create_future()
        self._connections[wid] = conn
        inbox: _Inbox = _Inbox()
        conn.inboxes[0] = inbox
        reply: Any = None
        settled = False
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                conn.control = await self._open_control(conn)
                if conn.lost is not None:  # lost, or the dispatcher closed, while it connected
                    conn.control.abort()
                    raise framed.StreamClosedError(conn.lost)
                await conn.control.send(self._codec.encode(HelloRequest(PROTOCOL_VERSION, "executor", self._peer.host)))
                reply = await inbox.get()
            settled = True
        except TimeoutError:
            self._lose(conn, f"no hello from worker {wid} at {worker.info.address} within {self._connect_timeout_s} s")
            settled = True
        except (OSError, ValueError) as exc:
            self._lose(conn, f"cannot reach worker {wid} at {self._control_address(worker)}: {exc}")
            settled = True
        finally:
            conn.inboxes.pop(0, None)
            if not settled:
                # Cancelled mid-way: withdraw the attempt (the next call connects afresh), and let
                # the calls waiting for it look again rather than wait forever.
                if self._connections.get(wid) is conn:
                    del self._connections[wid]
                self._close_connection(conn)
            ready.set_result(None)
        if conn.lost is not None or isinstance(reply, _Lost):
            return conn
        if not isinstance(reply, HelloReply):
            self._lose(conn, f"worker {wid} refused the hello: {reply}")
            return conn
        conn.pinger = asyncio.get_running_loop().create_task(self._ping(conn))
        return conn

    async def _open_control(self, conn: _Connection) -> ControlLink:
        """A stream on the worker's local socket when it has one this process can reach, else a
        ZeroMQ DEALER on its TCP endpoint."""
        address = self._control_address(conn.worker)
        if address.startswith(framed.SCHEME):
            stream = framed.FramedStream(
                lambda payload: self._on_control(conn, payload),
                max_message_bytes=self._max_message_bytes,
                on_oversized=lambda size: self._lose(
                    conn, f"worker {conn.worker.info.worker_id} sent a message of {size} bytes, over this"
                          f" dispatcher's limit of {self._max_message_bytes}"),
                on_closed=lambda reason: self._lose(
                    conn, f"worker {conn.worker.info.worker_id} (pid {conn.worker.info.pid}) closed its control"
                          f" connection ({reason})"),
            )
            return await framed.connect(address, stream, timeout_s=self._connect_timeout_s)
        sock = self._control_context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        connect_as_client(sock, self._peer.keys)
        sock.connect(address)
        return DealerLink(LoopSocket(sock, lambda frames: self._on_control_frames(conn, frames)))

    def _on_control_frames(self, conn: _Connection, frames: list[bytes]) -> None:
        if len(frames) != 1:
            log.warning("message of %d frames from worker %s", len(frames), conn.worker.info.worker_id)
            return
        self._on_control(conn, frames[0])

    def _on_control(self, conn: _Connection, payload: bytes) -> None:
        """A message from a worker's control endpoint: to the inbox of the call it answers."""
        try:
            message = self._codec.decode(payload)
        except WireError as exc:
            log.warning("unreadable message from worker %s: %s", conn.worker.info.worker_id, exc)
            return
        if isinstance(message, HelloReply):
            rid = 0
        elif isinstance(message, ErrorReply) and message.request_id is None:
            rid = 0 if 0 in conn.inboxes else -1
        elif isinstance(message, InputCredit):
            window = conn.windows.get(message.request_id, {}).get(message.port)
            if window is not None:
                window.grant(message.frames)
            return
        else:
            rid = getattr(message, "request_id", -1)
        inbox = conn.inboxes.get(rid)
        if inbox is not None:
            inbox.put_nowait(message)

    def _close_connection(self, conn: _Connection) -> None:
        if conn.pinger is not None:
            conn.pinger.cancel()
        if conn.control is not None:
            conn.control.abort()
        conn.liveness.close()

    async def _ping(self, conn: _Connection) -> None:
        """While calls are in flight, a worker that misses two heartbeats is lost. Ends (and
        closes the liveness socket, which would keep reconnecting) once the worker is lost."""
        ids = itertools.count(1)
        try:
            while conn.lost is None:
                await asyncio.sleep(self._heartbeat_s)
                if not conn.inboxes:
                    continue
                await conn.liveness.send(self._codec.encode(PingRequest(next(ids))))
                try:
                    while True:
                        async with asyncio.timeout(2 * self._heartbeat_s):
                            answer = await conn.liveness.recv()
                        with contextlib.suppress(WireError):
                            if isinstance(self._codec.decode(answer), PingReply):
                                break
                except TimeoutError:
                    self._lose(conn, f"worker {conn.worker.info.worker_id} (pid {conn.worker.info.pid}) stopped"
                                     f" answering for {2 * self._heartbeat_s:.1f} s")
        finally:
            conn.liveness.close()

    def _lose(self, conn: _Connection, reason: str, *, warn: bool = True) -> None:
        """Mark `conn` lost: its calls end (or move to other replicas), its control link is cut
        (a send blocked on it fails; the worker sees its caller go and cancels their work)."""
        if conn.lost is not None:
            return
        conn.lost = reason
        if warn:
            log.warning("%s", reason)
        for inbox in conn.inboxes.values():
            inbox.put_nowait(_Lost(reason))
        for windows in conn.windows.values():
            for window in windows.values():
                window.close()  # a forwarder waiting for credit sends, and fails
        if conn.control is not None:
            conn.control.abort()
        if conn.pinger is None:  # else the pinger closes it as it ends
            conn.liveness.close()
        cached = self._workers.get(conn.worker.info.role)
        if cached is not None:  # read the registry again on the next call, but keep the list as a fallback
            self._workers[conn.worker.info.role] = (float("-inf"), cached[1])

    # ----------------------------------------------------------------- execution
    async def _open_call(
        self, role: RoleSpec, call: NodeCall, excluded: set[str]
    ) -> tuple[_Connection, int, _Inbox, list[_Outbound]]:
        """Send `call` to a worker of `role`; its connection, request id and inbox, and its
        stream inputs, for `_forward` once the worker took the call."""
        if self._closed:
            raise WorkerLost(f"node {call.node_id!r}: the dispatcher is closed")
        try:
            worker = await self._choose(role, call, excluded)
        except NoWorkerError:
            raise WorkerLost(f"no live worker of role {role.name!r} for node {call.node_id!r}"
                             + (f" (lost: {', '.join(sorted(excluded))})" if excluded else "")) from None
        conn = await self._connection(worker)
        if self._closed:
            raise WorkerLost(f"node {call.node_id!r}: the dispatcher is closed")
        rid = next(self._ids)
        inbox: _Inbox = _Inbox()
        conn.inboxes[rid] = inbox
        wid = worker.info.worker_id
        self._outstanding[wid] = self._outstanding.get(wid, 0) + 1
        outbound: list[_Outbound] = []
        opened = False
        try:
            if conn.lost is not None:
                inbox.put_nowait(_Lost(conn.lost, reached=False))
                opened = True
                return conn, rid, inbox, outbound
            inputs: dict[str, PortValue] = {}
            streams: list[tuple[str, AsyncIterator[Any]]] = []
            for port, value in call.inputs.items():
                if isinstance(value, AsyncIterator):
                    inputs[port] = PortValue(ValueKind.STREAM)
                    streams.append((port, value))
                else:
                    inputs[port] = encode_value(value, self._peer, where=f"node {call.node_id!r} input {port!r}")
            request = ExecuteRequest(rid, role.name, call.run_id, call.node_id, call.op, call.params, inputs,
                                     call.output_ports, call.stream, call.router, call.iteration, call.attempt,
                                     self._stream_window, call.tenant)
            windows = {port: CreditWindow(self._stream_window) for port, _ in streams} if self._stream_window else {}
            if windows:
                conn.windows[rid] = windows
            assert conn.control is not None
            try:
                await conn.control.send(self._codec.encode(request))
            except (framed.StreamClosedError, zmq.ZMQError) as exc:
                # The link was cut (the worker lost, the dispatcher closed) while the request waited
                # for room, or ended before its end was seen: the call's inbox says so.
                self._lose(conn, f"worker {wid} (pid {worker.info.pid}): control connection ended ({exc})")
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

    async def _forward(self, conn: _Connection, rid: int, call: NodeCall, outbound: _Outbound) -> None:
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
                                                           where=f"node {call.node_id!r} input {port!r}"))
                await control.send(self._codec.encode(frame))
                sent += 1
            await control.send(self._codec.encode(InputEnd(rid, port)))

    async def _close_call(self, conn: _Connection, rid: int, forwarders: list[asyncio.Task[None]],
                          finished: bool) -> None:
        self._forget_call(conn, rid)
        for task in forwarders:
            task.cancel()
        if not finished:
            self._post(conn, CancelRequest(rid))

    def _post(self, conn: _Connection, message: WorkerMessage) -> None:
        """Send `message` to `conn`'s worker without waiting, in order with what went before.
        A connection that failed is the loss of its calls, reported through their inboxes."""
        if conn.lost is not None or conn.control is None:
            return
        with contextlib.suppress(zmq.ZMQError, framed.StreamClosedError):
            pending = conn.control.send_nowait(self._codec.encode(message))
            if pending is not None:
                pending.add_done_callback(_retrieve)

    def _forget_call(self, conn: _Connection, rid: int) -> None:
        conn.inboxes.pop(rid, None)
        conn.windows.pop(rid, None)
        wid = conn.worker.info.worker_id
        self._outstanding[wid] = max(0, self._outstanding.get(wid, 1) - 1)

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
                            started(RanOn(worker=conn.worker.info.worker_id, host=conn.worker.info.host))
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
                            self._post(conn, FrameCredit(rid, owed))
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
                    elif isinstance(message, _Lost):
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
                await self._close_call(conn, rid, forwarders, finished)

    async def execute(
        self, role: RoleSpec, call: NodeCall, ctx: NodeContext, started: Callable[[RanOn], None]
    ) -> NodeResult:
        async with contextlib.aclosing(self._messages(role, call, ctx, started)) as messages:
            async for message in messages:
                if isinstance(message, ExecuteResult):
                    return NodeResult(outputs=self._outputs(message.outputs), route=message.route)
        raise WorkerLost(f"node {call.node_id!r} ended without a result")

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
        self._closed = True
        pingers = [conn.pinger for conn in self._connections.values() if conn.pinger is not None]
        for conn in self._connections.values():
            self._lose(conn, "the dispatcher was closed", warn=False)  # calls in flight end now
            self._close_connection(conn)
        await asyncio.gather(*pingers, return_exceptions=True)
        self._connections.clear()
        self._context.term()
        self._control_context.term()
        self._kv_router.close()
