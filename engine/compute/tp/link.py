"""The control link between rank 0 of a tensor-parallel replica and its follower ranks.

Rank 0 binds a ROUTER next to the group's address and publishes it in the group's store
(`LEADER_KEY`); each follower connects a DEALER, says `TPHello`, and waits for `TPSetup`
(rank 0's pid and the disk pages every rank keeps). The link is on the worker plane's CURVE (the ranks'
`--keys`): a process without them cannot join or hear the operations. Then rank 0 sends every operation to every follower,
in order (`broadcast`), and `TPStop` when it stops. Messages are msgpack (`TPMessage`);
a send to a follower that is gone raises (ROUTER_MANDATORY, a send timeout), which breaks
the group. Shared by the `llm` and `diffusion` tensor-parallel units.

Refusals: the link's ROUTER refuses a peer without the plane's key (`PlaneGuard`), and each
follower tells rank 0 what its own server sockets refused (`TPRefusals`, sent by its
`RefusalReporter`), so `FollowerLink.refused` is the whole replica's count but rank 0's other
sockets: what rank 0's worker reports as `plane.refused`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from engine.compute.tp.group import TPGroup, TPRankError
from engine.compute.tp.messages import TPHello, TPMessage, TPRefusals, TPSetup, TPStop
from engine.data.curve import PlaneGuard, PlaneKeys, connect_as_client

log = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 120.0
"""How long rank 0 waits for its followers' hellos, and a follower for rank 0's setup."""
LEADER_KEY = "tp/leader"
SEND_TIMEOUT_MS = 5000

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TPMessage)


class FollowerLink:
    """Rank 0's side: the followers of a replica of `size` ranks, met over the group `group`
    (whose store lives at `address`, `tcp://host:port`). `what` names the role in errors."""

    def __init__(self, group: TPGroup, address: str, size: int, *, what: str, keys: PlaneKeys | None) -> None:
        """`keys`: the worker plane's (`engine.data.curve`): only ranks holding them may join."""
        self._context = zmq.Context()
        self._guard = None if keys is None else PlaneGuard(self._context, keys, name=f"tp link of {what}")
        self._socket: zmq.Socket | None = self._context.socket(zmq.ROUTER)
        self._lock = threading.Lock()
        """Held while the socket is used: `refused` reads it from another thread than the rest."""
        self.followers: list[bytes] = []
        self._reported: dict[bytes, int] = {}
        """The latest `TPRefusals` total of each follower, by its identity (the lock held)."""
        self._followers_refused = 0
        """Their sum (read without the lock)."""
        self._size = size
        self._what = what
        sock = self._socket
        with contextlib.ExitStack() as undo:
            undo.callback(self.close)  # a link that cannot bind and publish leaves nothing open
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a follower that is gone raises
            sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            if self._guard is not None:
                self._guard.serve(sock)
            host = address.removeprefix("tcp://").rpartition(":")[0]
            sock.bind(f"tcp://{host}:0")
            group.publish(LEADER_KEY, sock.getsockopt_string(zmq.LAST_ENDPOINT).encode())
            undo.pop_all()

    @property
    def refused(self) -> int:
        """Connections refused so far by the link (no CURVE, or a key the plane does not
        authorise) and, as they last reported, by the followers' sockets. Never waits: from
        another thread (a worker's liveness thread) while the link is busy sending, the
        followers' reports not yet read count at the next call."""
        own = 0 if self._guard is None else self._guard.refused
        if self._lock.acquire(blocking=False):
            try:
                self._read_reports()
            finally:
                self._lock.release()
        return own + self._followers_refused

    def _read_reports(self) -> None:
        """Take the followers' `TPRefusals` waiting on the socket (the lock held)."""
        sock = self._socket
        if sock is None:
            return
        while sock.poll(0):
            identity, *frames = sock.recv_multipart()
            report = _decode_report(frames)
            if identity not in self.followers or report is None:
                log.warning("%s: a follower sent something other than TPRefusals; ignored", self._what)
                continue
            self._reported[identity] = max(self._reported.get(identity, 0), report.refused)
            self._followers_refused = sum(self._reported.values())

    def meet(self, agree: Callable[[list[TPHello]], list[str]] | None = None) -> None:
        """Wait for every follower's hello (up to SETUP_TIMEOUT_S), then send each the setup:
        with `agree`, the recovered disk pages it keeps given the hellos (every rank keeps them)."""
        with self._lock:
            hellos = self._meet()
            disk_pages = agree(hellos) if agree is not None else []
            setup = _encoder.encode(TPSetup(os.getpid(), disk_pages))
            assert self._socket is not None
            for identity in self.followers:
                self._socket.send_multipart([identity, setup])

    def _meet(self) -> list[TPHello]:
        sock = self._socket
        assert sock is not None
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        hellos: list[TPHello] = []
        while len(self.followers) < self._size - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                raise TPRankError(f"{self._what}: only {len(self.followers)} of {self._size - 1} follower"
                                  f" ranks said hello within {SETUP_TIMEOUT_S:.0f}s")
            identity, payload = sock.recv_multipart()
            hello = _decoder.decode(payload)
            if not isinstance(hello, TPHello):
                raise TPRankError(f"expected a follower's TPHello, got {type(hello).__name__}")
            self.followers.append(identity)
            hellos.append(hello)
        return hellos

    def broadcast(self, message: TPMessage) -> None:
        """Send `message` to every follower; TPRankError when one is unreachable."""
        payload = _encoder.encode(message)
        with self._lock:
            assert self._socket is not None
            for index, identity in enumerate(self.followers, start=1):
                try:
                    self._socket.send_multipart([identity, payload])
                except zmq.ZMQError as exc:
                    raise TPRankError(f"follower rank {index} is unreachable ({exc}); the group is broken") from exc

    def close(self) -> None:
        """Tell every follower still there to stop (one that is not stops when it sees rank 0
        gone), then close the socket. Idempotent."""
        with self._lock:
            if self._socket is not None:
                payload = _encoder.encode(TPStop())
                for rank, identity in enumerate(self.followers, start=1):
                    try:
                        self._socket.send_multipart([identity, payload])
                    except zmq.ZMQError as exc:
                        log.warning("telling follower rank %d to stop: %s", rank, exc)
                self._socket.close(linger=1000)
                self._socket = None
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        if not self._context.closed:
            self._context.term()


def greet_leader(sock: zmq.Socket, group: TPGroup, rank: int, keys: PlaneKeys | None,
                 disk_pages: list[str] | None = None) -> TPSetup:
    """A follower's handshake on its DEALER `sock`: connect to rank 0 (its address from the
    group's store) with the plane's `keys`, say hello (with the pages its disk tier recovered),
    and return rank 0's setup (TPRankError after SETUP_TIMEOUT_S)."""
    connect_as_client(sock, keys)
    sock.connect(group.lookup(LEADER_KEY).decode())
    sock.send(_encoder.encode(TPHello(rank, os.getpid(), disk_pages or [])))
    if not sock.poll(int(SETUP_TIMEOUT_S * 1000)):
        raise TPRankError(f"rank {rank}: rank 0 sent no setup within {SETUP_TIMEOUT_S:.0f}s")
    setup = _decoder.decode(sock.recv())
    if not isinstance(setup, TPSetup):
        raise TPRankError(f"rank {rank}: expected TPSetup, got {type(setup).__name__}")
    return setup


def _decode_report(frames: list[bytes]) -> TPRefusals | None:
    if len(frames) != 1:
        return None
    try:
        message = _decoder.decode(frames[0])
    except msgspec.DecodeError:
        return None
    return message if isinstance(message, TPRefusals) else None


class RefusalReporter:
    """A follower's side of the refusal count: `tick()` (from the follower's loop, on its link's
    thread) sends rank 0 `count()`, the connections this rank's server sockets refused so far,
    when it grew, at most once per `interval_s`. It never waits: a report the link cannot take
    now (its queue to rank 0 full) goes with a later tick, the total being a running one."""

    def __init__(self, sock: zmq.Socket, rank: int, count: Callable[[], int], *, interval_s: float) -> None:
        self._sock = sock
        self._rank = rank
        self._count = count
        self._interval_s = interval_s
        self._sent = 0
        self._next = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self._interval_s
        refused = self._count()
        if refused <= self._sent:
            return
        try:
            self._sock.send(_encoder.encode(TPRefusals(self._rank, refused)), zmq.NOBLOCK)
        except zmq.Again:
            return
        self._sent = refused
