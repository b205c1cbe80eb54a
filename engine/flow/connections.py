"""A dispatcher's connections to role workers: one per worker, shared by the calls sent to it.

A connection has a control link (a stream on the worker's abstract Unix socket when it shares
this process's network namespace, else a ZeroMQ DEALER on its TCP endpoint, with the plane's
CURVE keys) and a liveness socket. It opens with a hello; each call sent on it has an inbox its
answers are sorted into by request id (`Inbox`). While calls are in flight the worker is pinged
every heartbeat, and one that misses two, closes its control link or cannot be reached is lost:
every call's inbox gets a `Lost`, and `on_lost` hears of it (the replica chooser reads the
registry again).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from engine.data import framed
from engine.data.codec import WireCodec, WireError
from engine.data.credit import CreditWindow
from engine.data.curve import connect_as_client
from engine.data.peer import Peer
from engine.data.shm import local_namespace
from engine.data.wire import (
    PROTOCOL_VERSION,
    ErrorReply,
    HelloReply,
    HelloRequest,
    InputCredit,
    PingReply,
    PingRequest,
    WorkerMessage,
)
from engine.flow.discovery import WorkerSnapshot
from engine.flow.links import ControlLink, DealerLink, LoopSocket
from engine.spec.calls import RanOn

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A worker died or stopped answering while it held a node execution."""



def _retrieve(sent: asyncio.Future[None]) -> None:
    """Mark a send's failure seen: the connection's loss reports it."""
    if not sent.cancelled():
        sent.exception()


class Lost:
    """Put into a call's inbox when its worker is lost; `reached`: after the request went out
    (else the worker was lost, or unreachable, before it had the call)."""

    __slots__ = ("reason", "reached")

    def __init__(self, reason: str, reached: bool = True) -> None:
        self.reason = reason
        self.reached = reached



class Inbox:
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
class Connection:
    worker: WorkerSnapshot
    control: ControlLink | None
    liveness: zmq.asyncio.Socket
    inboxes: dict[int, Inbox] = field(default_factory=dict)
    windows: dict[int, dict[str, CreditWindow]] = field(default_factory=dict)
    """Per call: the credit the worker granted for each stream-mode input port."""
    pinger: asyncio.Task[None] | None = None
    lost: str | None = None
    ready: asyncio.Future[None] | None = None
    where: RanOn = field(init=False)
    """Where its calls run: its worker and that worker's host."""

    def __post_init__(self) -> None:
        self.where = RanOn(worker=self.worker.info.worker_id, host=self.worker.info.host)


class Connections:
    """The connections of one dispatcher, by worker id (`by_worker`). `peer` gives the plane's keys
    and this host's name; `local_streams=False` reaches every worker over ZeroMQ TCP."""

    def __init__(self, peer: Peer, *, heartbeat_s: float, connect_timeout_s: float, max_message_bytes: int,
                 local_streams: bool, on_lost: Callable[[Connection], None]) -> None:
        self._peer = peer
        self._heartbeat_s = heartbeat_s
        self._connect_timeout_s = connect_timeout_s
        self._max_message_bytes = max_message_bytes
        self._local_ns = local_namespace() if local_streams else None
        self._on_lost = on_lost
        self._context = zmq.asyncio.Context()
        self._control_context = zmq.Context()
        self.codec = WireCodec(max_message_bytes, WorkerMessage)
        self.by_worker: dict[str, Connection] = {}
        self.closed = False

    def usable(self, worker_id: str) -> bool:
        """Whether a call may go to `worker_id`: no connection yet, or one not lost."""
        conn = self.by_worker.get(worker_id)
        return conn is None or conn.lost is None

    def control_address(self, worker: WorkerSnapshot) -> str:
        """The worker's abstract Unix socket when it shares this process's network namespace
        (`engine.data.shm.local_namespace`), else its TCP address."""
        meta = worker.info.meta
        local = str(meta.get("local") or "")
        if self._local_ns is not None and meta.get("local_ns") == self._local_ns and local.startswith(framed.SCHEME):
            return local
        return worker.info.address

    def open_connection(self, worker: WorkerSnapshot) -> Connection | None:
        """`worker`'s connection when it is open and usable as is (what `connect` would return
        at once), else None."""
        conn = self.by_worker.get(worker.info.worker_id)
        if (conn is None or self.closed or conn.lost is not None or conn.worker.info.address != worker.info.address
                or (conn.ready is not None and not conn.ready.done())):
            return None
        return conn

    async def connect(self, worker: WorkerSnapshot) -> Connection:
        """The connection to `worker`, opened (hello answered) if it has none; a connection that could
        not be opened comes back lost, its reason in `lost`."""
        wid = worker.info.worker_id
        if self.closed:
            raise WorkerLost(f"worker {wid}: the dispatcher is closed")
        while True:
            conn = self.by_worker.get(wid)
            if conn is None or conn.lost is not None or conn.worker.info.address != worker.info.address:
                break
            if conn.ready is None or conn.ready.done():
                return conn
            await asyncio.shield(conn.ready)  # another call is connecting: share its outcome
            if self.by_worker.get(wid) is conn:
                return conn
            # That attempt was withdrawn (its caller was cancelled): look again.
        if conn is not None:  # lost, or the worker id now listens elsewhere: its calls go elsewhere too
            self.lose(conn, f"worker {wid} moved from {conn.worker.info.address} to {worker.info.address}")
            self.close_connection(conn)
        liveness = self._context.socket(zmq.DEALER)
        liveness.setsockopt(zmq.LINGER, 0)
        connect_as_client(liveness, self._peer.keys)
        liveness.connect(str(worker.info.meta["liveness"]))
        conn = Connection(worker, None, liveness)
        ready = conn.ready = asyncio.get_running_loop().create_future()
        self.by_worker[wid] = conn
        inbox: Inbox = Inbox()
        conn.inboxes[0] = inbox
        reply: Any = None
        settled = False
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                conn.control = await self._open_control(conn)
                if conn.lost is not None:  # lost, or the dispatcher closed, while it connected
                    conn.control.abort()
                    raise framed.StreamClosedError(conn.lost)
                await conn.control.send(self.codec.encode(HelloRequest(PROTOCOL_VERSION, "executor", self._peer.host)))
                reply = await inbox.get()
            settled = True
        except TimeoutError:
            self.lose(conn, f"no hello from worker {wid} at {worker.info.address} within {self._connect_timeout_s} s")
            settled = True
        except (OSError, ValueError) as exc:
            self.lose(conn, f"cannot reach worker {wid} at {self.control_address(worker)}: {exc}")
            settled = True
        finally:
            conn.inboxes.pop(0, None)
            if not settled:
                # Cancelled mid-way: withdraw the attempt (the next call connects afresh), and let
                # the calls waiting for it look again rather than wait forever.
                if self.by_worker.get(wid) is conn:
                    del self.by_worker[wid]
                self.close_connection(conn)
            ready.set_result(None)
        if conn.lost is not None or isinstance(reply, Lost):
            return conn
        if not isinstance(reply, HelloReply):
            self.lose(conn, f"worker {wid} refused the hello: {reply}")
            return conn
        conn.pinger = asyncio.get_running_loop().create_task(self._ping(conn))
        return conn

    async def _open_control(self, conn: Connection) -> ControlLink:
        """A stream on the worker's local socket when it has one this process can reach, else a
        ZeroMQ DEALER on its TCP endpoint."""
        address = self.control_address(conn.worker)
        if address.startswith(framed.SCHEME):
            stream = framed.FramedStream(
                lambda payload: self._on_control(conn, payload),
                max_message_bytes=self._max_message_bytes,
                on_oversized=lambda size: self.lose(
                    conn, f"worker {conn.worker.info.worker_id} sent a message of {size} bytes, over this"
                          f" dispatcher's limit of {self._max_message_bytes}"),
                on_closed=lambda reason: self.lose(
                    conn, f"worker {conn.worker.info.worker_id} (pid {conn.worker.info.pid}) closed its control"
                          f" connection ({reason})"),
            )
            return await framed.connect(address, stream, timeout_s=self._connect_timeout_s)
        sock = self._control_context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        connect_as_client(sock, self._peer.keys)
        sock.connect(address)
        return DealerLink(LoopSocket(sock, lambda frames: self._on_control_frames(conn, frames)))

    def _on_control_frames(self, conn: Connection, frames: list[bytes]) -> None:
        if len(frames) != 1:
            log.warning("message of %d frames from worker %s", len(frames), conn.worker.info.worker_id)
            return
        self._on_control(conn, frames[0])

    def _on_control(self, conn: Connection, payload: bytes) -> None:
        """A message from a worker's control endpoint: to the inbox of the call it answers."""
        try:
            message = self.codec.decode(payload)
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

    def close_connection(self, conn: Connection) -> None:
        if conn.pinger is not None:
            conn.pinger.cancel()
        if conn.control is not None:
            conn.control.abort()
        conn.liveness.close()

    async def _ping(self, conn: Connection) -> None:
        """While calls are in flight, a worker that misses two heartbeats is lost. Ends (and
        closes the liveness socket, which would keep reconnecting) once the worker is lost."""
        ids = itertools.count(1)
        try:
            while conn.lost is None:
                await asyncio.sleep(self._heartbeat_s)
                if not conn.inboxes:
                    continue
                await conn.liveness.send(self.codec.encode(PingRequest(next(ids))))
                try:
                    while True:
                        async with asyncio.timeout(2 * self._heartbeat_s):
                            answer = await conn.liveness.recv()
                        with contextlib.suppress(WireError):
                            if isinstance(self.codec.decode(answer), PingReply):
                                break
                except TimeoutError:
                    self.lose(conn, f"worker {conn.worker.info.worker_id} (pid {conn.worker.info.pid}) stopped"
                                     f" answering for {2 * self._heartbeat_s:.1f} s")
        finally:
            conn.liveness.close()

    def lose(self, conn: Connection, reason: str, *, warn: bool = True) -> None:
        """Mark `conn` lost: its calls end (or move to other replicas), its control link is cut
        (a send blocked on it fails; the worker sees its caller go and cancels their work)."""
        if conn.lost is not None:
            return
        conn.lost = reason
        if warn:
            log.warning("%s", reason)
        for inbox in conn.inboxes.values():
            inbox.put_nowait(Lost(reason))
        for windows in conn.windows.values():
            for window in windows.values():
                window.close()  # a forwarder waiting for credit sends, and fails
        if conn.control is not None:
            conn.control.abort()
        if conn.pinger is None:  # else the pinger closes it as it ends
            conn.liveness.close()
        self._on_lost(conn)

    def post(self, conn: Connection, message: WorkerMessage) -> None:
        """Send `message` to `conn`'s worker without waiting, in order with what went before.
        A connection that failed is the loss of its calls, reported through their inboxes."""
        if conn.lost is not None or conn.control is None:
            return
        with contextlib.suppress(zmq.ZMQError, framed.StreamClosedError):
            pending = conn.control.send_nowait(self.codec.encode(message))
            if pending is not None:
                pending.add_done_callback(_retrieve)


    async def close(self) -> None:
        """Lose every connection (calls in flight end now) and close the sockets."""
        if self.closed:
            return
        self.closed = True
        pingers = [conn.pinger for conn in self.by_worker.values() if conn.pinger is not None]
        for conn in self.by_worker.values():
            self.lose(conn, "the dispatcher was closed", warn=False)
            self.close_connection(conn)
        await asyncio.gather(*pingers, return_exceptions=True)
        self.by_worker.clear()
        self._context.term()
        self._control_context.term()
