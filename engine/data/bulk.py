"""The bulk channel of the authenticated worker plane: a TCP transfer's bytes outside CURVE,
admitted by one-time grants given over CURVE.

CURVE encrypts every byte it carries, and libzmq's CURVE moved a tensor between hosts at a third
of the plaintext rate (`omniflow bench transfer`: `tcp_auth_vs_plain` 0.26-0.34). So, unless the
plane's `BulkMode` (`engine.data.curve`) is `encrypted`, a TCP pull goes in two parts:

* the `PullRequest` (with `bulk` set) and its `PullReply` travel on the CURVE connection as
  before; the reply carries a `BulkGrant`: the owner's bulk endpoint, a one-time `token` and
  (`mac` mode) a MAC `key`, fresh random bytes that only the two ends of that CURVE link know;
* the bytes are asked of the owner's bulk socket (`BulkEndpoint`, a plain ZeroMQ ROUTER beside
  the tensor server's), one `BulkChunkRequest` per chunk, each carrying the token. The owner
  serves a range only when `BulkGrants.admit` finds a live grant for that token, issued for
  that ref, never used from another connection, with the range inside the tensor and not served
  before; anything else (no token, a forged, expired, replayed or foreign one, another ref, a
  message that is not a `BulkChunkRequest`) is refused: logged, counted in the tensor server's
  `refused` (a worker's `plane.refused`, `omniflow_worker_plane_refused_total`) and answered
  REFUSED, with no byte of any tensor. A grant is short-lived: `grant_s` (10 s) after it was
  issued or last used it is gone, and once every byte was served it is gone at once.
* `mac` mode: every chunk comes with a Poly1305 tag (`chunk_tag`) under a one-time key derived
  from the grant's key, the ref and the range; the client checks it as it copies the bytes
  (`copy_intact`) and fails the transfer on a mismatch.

What it protects: only a holder of the plane's keys gets a grant, so only plane members read a
tensor or a KV page (as with CURVE), and a token seen on the wire is worth nothing to anyone
else. What it does not: confidentiality: whoever can read the network between the two hosts
reads the bytes (tensors, KV pages) as they pass, as on a plaintext plane; and in `clear` mode,
integrity: whoever can alter packets on the way can alter the bytes (`mac` catches that).
Requests, refs, tokens and keys stay inside CURVE either way. Where others can read the wire,
give the plane `encrypted` (the keys' `bulk` file; `OMNIFLOW_PLANE_BULK=encrypted` in the
studio): no grant is asked or given and the chunks travel inside CURVE. On one host nothing
changes: bytes move through shared memory and only requests cross a socket.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from engine.data.codec import Limits, WireCodec, WireError
from engine.data.ref_table import StoredTensor
from engine.data.store_memory import SendHandle, SentFrames
from engine.data.tensor_store import RefNotFound, TensorStore
from engine.data.wire import (
    BulkChunkReply,
    BulkChunkRequest,
    BulkGrant,
    BulkMessage,
    ErrorCode,
    ErrorReply,
    RefId,
)

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
KEY_BYTES = 32
GRANT_S = 10.0
"""A grant unused for this long is gone: from its issue to the first chunk, or between chunks."""


class BulkRefused(Exception):
    """A bulk request no grant admits; the message says why (for the owner's log only)."""


@dataclass(slots=True)
class _Grant:
    ref_id: RefId
    nbytes: int
    key: bytes
    expires_at: float
    connection: bytes | None = None
    """The bulk connection that used the token first; no other may."""
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    """Served ranges, sorted, disjoint: no byte is served twice."""
    served: int = 0


class BulkGrants:
    """The owner's live grants, keyed by token. Pure bookkeeping (no sockets; `clock` is
    injectable), used by one thread: the tensor server's."""

    def __init__(self, grant_s: float = GRANT_S, clock: Callable[[], float] = time.monotonic) -> None:
        if grant_s <= 0:
            raise ValueError(f"grant_s must be positive, got {grant_s}")
        self._grant_s = grant_s
        self._clock = clock
        self._grants: dict[bytes, _Grant] = {}

    def __len__(self) -> int:
        return len(self._grants)

    def issue(self, ref_id: RefId, nbytes: int, *, mac: bool) -> tuple[bytes, bytes]:
        """A new grant to read `ref_id`'s `nbytes` bytes once: its token, and its MAC key
        (empty without `mac`)."""
        token = secrets.token_bytes(TOKEN_BYTES)
        key = secrets.token_bytes(KEY_BYTES) if mac else b""
        self._grants[token] = _Grant(ref_id, nbytes, key, self._clock() + self._grant_s)
        return token, key

    def admit(self, token: bytes, connection: bytes, ref_id: RefId, offset: int, length: int) -> bytes:
        """Take bytes [offset, offset + length) of `ref_id` under `token` from `connection`:
        returns the grant's MAC key (empty: no MAC), or raises `BulkRefused`. The range counts
        as served from now on; the grant ends once all its bytes were."""
        now = self._clock()
        grant = self._grants.get(token)
        if grant is None:
            raise BulkRefused("no such grant (never issued, used up, or expired)")
        if grant.expires_at <= now:
            del self._grants[token]
            raise BulkRefused("the grant expired")
        if grant.connection is not None and grant.connection != connection:
            raise BulkRefused("the grant is in use by another connection")
        if grant.ref_id != ref_id:
            raise BulkRefused(f"the grant is for another ref than {ref_id!r}")
        end = offset + length
        if offset < 0 or length <= 0 or end > grant.nbytes:
            raise BulkRefused(f"range [{offset}, {end}) outside the granted {grant.nbytes} bytes")
        at = bisect.bisect_right(grant.starts, offset)
        if (at > 0 and grant.ends[at - 1] > offset) or (at < len(grant.starts) and grant.starts[at] < end):
            raise BulkRefused(f"range [{offset}, {end}) was served already")
        grant.connection = connection
        grant.starts.insert(at, offset)
        grant.ends.insert(at, end)
        grant.served += length
        grant.expires_at = now + self._grant_s
        if grant.served == grant.nbytes:
            del self._grants[token]
        return grant.key

    def sweep(self) -> int:
        """Forget expired grants; returns how many."""
        now = self._clock()
        expired = [t for t, g in self._grants.items() if g.expires_at <= now]
        for token in expired:
            del self._grants[token]
        return len(expired)


def _poly1305(key: bytes) -> Any:
    """A Poly1305 MAC under `key`. `cryptography` is imported here, by the `mac` mode only, so the
    transfer plane runs where it is not installed (the GPU check's bare machines)."""
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    return Poly1305(key)


def _one_time_key(key: bytes, ref_id: str, offset: int, length: int) -> bytes:
    """Poly1305 needs a key per message: the grant's key, the ref and the range make one."""
    return hashlib.blake2b(f"{ref_id}:{offset}:{length}".encode(), key=key, digest_size=32).digest()


Buffer = memoryview | bytes | np.ndarray


def chunk_tag(key: bytes, ref_id: str, offset: int, data: Buffer) -> bytes:
    """The MAC of bytes `data` at `offset` of `ref_id` under a grant's `key` (16 bytes; Poly1305,
    about 5 GB/s a core on a busy two-core machine, each side)."""
    return parts_tag(key, ref_id, offset, [data])


def parts_tag(key: bytes, ref_id: str, offset: int, parts: Sequence[Buffer]) -> bytes:
    """`chunk_tag` of a chunk that comes in several buffers, in order (one frame each)."""
    mac = _poly1305(_one_time_key(key, ref_id, offset, sum(memoryview(part).nbytes for part in parts)))
    for part in parts:
        mac.update(part)
    return mac.finalize()


MAC_BLOCK = 512 << 10
"""`copy_intact` copies and MACs this much at a time, so the MAC reads bytes still in the cache."""


def copy_intact(key: bytes, ref_id: str, offset: int, data: Buffer, tag: bytes, dest: np.ndarray) -> bool:
    """Copy `data` (the chunk at `offset` of `ref_id`) into `dest` (uint8, as long) and say
    whether `tag` is its `chunk_tag`: the bytes are what the owner sent, for this range. On
    False, `dest` holds bytes nobody vouches for."""
    return copy_parts_intact(key, ref_id, offset, [data], tag, dest)


def copy_parts_intact(key: bytes, ref_id: str, offset: int, parts: Sequence[Buffer], tag: bytes,
                      dest: np.ndarray) -> bool:
    """`copy_intact` of a chunk that comes in several buffers, in order (one frame each)."""
    sources = [np.frombuffer(part, np.uint8) for part in parts]
    if sum(len(source) for source in sources) != len(dest):
        return False
    from cryptography.exceptions import InvalidSignature

    mac = _poly1305(_one_time_key(key, ref_id, offset, len(dest)))
    at = 0
    for source in sources:
        for start in range(0, len(source), MAC_BLOCK):
            block = dest[at : at + min(MAC_BLOCK, len(source) - start)]
            np.copyto(block, source[start : start + len(block)])
            mac.update(block)
            at += len(block)
    try:
        mac.verify(tag)
    except InvalidSignature:
        return False
    return True


class BulkEndpoint:
    """The owner's bulk socket: a ZeroMQ ROUTER without CURVE (that is the point) served by the
    tensor server's thread (`drain`, `sweep`). It reads only `BulkMessage`s of at most
    `limits.max_request_bytes` (ZeroMQ drops a connection that sends a larger one)."""

    def __init__(self, context: zmq.Context, bind: str, store: TensorStore, *, mac: bool, limits: Limits,
                 grant_s: float = GRANT_S, advertise: Callable[[str], str] = lambda endpoint: endpoint,
                 peer_timeout_s: float = 10.0) -> None:
        """`mac`: each chunk carries its MAC (`BulkMode.MAC`); `peer_timeout_s`: see `drop_stalled`."""
        self._store = store
        self._mac = mac
        self.grants = BulkGrants(grant_s)
        self.refused = 0
        """Requests refused: no live grant admitted them, or they were not bulk requests."""
        self.served_bytes = 0
        self._codec = WireCodec(limits.max_request_bytes, BulkMessage)
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.SNDHWM, 0)  # replies are bounded by the grants
        socket.setsockopt(zmq.MAXMSGSIZE, limits.max_request_bytes)
        drop_stalled(socket, peer_timeout_s)
        socket.bind(bind)
        self.socket = socket
        self.address = advertise(socket.getsockopt_string(zmq.LAST_ENDPOINT))

    def grant(self, ref_id: RefId, nbytes: int) -> BulkGrant:
        token, key = self.grants.issue(ref_id, nbytes, mac=self._mac)
        return BulkGrant(self.address, token, key)

    def drain(self) -> None:
        for _ in range(1024):  # then let the server sweep, even under a flood
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._serve(frames)

    def sweep(self) -> None:
        self.grants.sweep()

    def close(self) -> None:
        self.socket.close(linger=0)

    def _serve(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        request_id: int | None = None
        try:
            if len(frames) != 2:
                raise BulkRefused(f"{len(frames) - 1} frames, not one request")
            try:
                message = self._codec.decode(frames[1].buffer)
            except WireError as exc:
                raise BulkRefused(f"unreadable: {exc}") from None
            request_id = getattr(message, "request_id", None)
            if not isinstance(message, BulkChunkRequest):
                raise BulkRefused(f"a {type(message).__name__}, not a BulkChunkRequest")
            key = self.grants.admit(message.token, identity, message.ref_id, message.offset, message.length)
        except BulkRefused as exc:
            self.refused += 1
            log.warning("bulk channel %s: refused a request from %s: %s", self.address, _peer(frames), exc)
            self._send(identity, ErrorReply(request_id, ErrorCode.REFUSED, "refused: no live grant"))
            return
        try:
            self._serve_chunk(identity, message, key)
        except RefNotFound as exc:
            self._send(identity, ErrorReply(request_id, ErrorCode.NOT_FOUND, str(exc)))
        except Exception as exc:  # a bug in serving one request must not stop the server
            log.exception("internal error serving a bulk request")
            self._send(identity, ErrorReply(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    def _serve_chunk(self, identity: bytes, request: BulkChunkRequest, key: bytes) -> None:
        """Take the range while the store holds the ref, and a hold on its segment, then MAC and
        send it outside the store's lock (which the producer's puts take too)."""
        end = request.offset + request.length
        hold = _SendHold()
        taken: list[np.ndarray] = []

        def take(entry: StoredTensor) -> _SendHold:
            if end > entry.header.nbytes:  # granted for this ref's size: never
                raise RefNotFound(f"{request.ref_id} is not the tensor it was granted for")
            taken.extend(entry.byte_range(request.offset, end))  # a lent tensor's: one per part
            return hold

        self._store.serve(request.ref_id, take)
        try:
            tag = parts_tag(key, request.ref_id, request.offset, taken) if key else b""
            reply = BulkChunkReply(request.request_id, request.offset, request.length, tag)
            self.served_bytes += request.length  # before the bytes leave: whoever receives them sees it counted
            hold.tracker = self._send(identity, reply, taken)
        finally:
            hold.taken = True

    def _send(self, identity: bytes, message: BulkMessage, data: list[Any] | None = None) -> SendHandle | None:
        try:
            return send_routed(self.socket, identity, self._codec.encode(message), data)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return None  # the peer went away


@dataclass(slots=True, eq=False)
class _SendHold:
    """A `SendHandle` for a chunk read outside the store's lock: done once the bytes were
    MAC'd and ZeroMQ no longer reads them."""

    taken: bool = False
    tracker: SendHandle | None = None

    @property
    def done(self) -> bool:
        return self.taken and (self.tracker is None or self.tracker.done)


def drop_stalled(socket: zmq.Socket, peer_timeout_s: float) -> None:
    """Close a connection of `socket` whose peer acknowledges none of the bytes sent to it for
    `peer_timeout_s` (TCP_USER_TIMEOUT, through ZeroMQ's TCP_MAXRT), dropping what is queued for
    it: a zero-copy send to a peer that stopped reading, or whose host vanished, ends then (and
    what it read is freed), not when TCP's retransmissions give up, many minutes later."""
    if peer_timeout_s <= 0:
        raise ValueError(f"peer_timeout_s must be positive, got {peer_timeout_s}")
    socket.setsockopt(zmq.TCP_MAXRT, max(1, int(peer_timeout_s * 1000)))


def send_routed(socket: zmq.Socket, identity: bytes, payload: bytes, data: list[Any] | None) -> SendHandle | None:
    """Send `payload` to peer `identity` of a ROUTER, then the buffers of `data` as raw frames
    (`send_frames`), none of it blocking; returns their handle, None without `data`. A peer
    gone away raises `zmq.ZMQError` with errno EHOSTUNREACH."""
    socket.send(identity, zmq.SNDMORE | zmq.NOBLOCK)
    if data is None:
        socket.send(payload, zmq.NOBLOCK)
        return None
    socket.send(payload, zmq.SNDMORE | zmq.NOBLOCK)
    return send_frames(socket, data)


def send_frames(socket: zmq.Socket, data: list[Any]) -> SendHandle:
    """Send the buffers of `data` as the last frames of a message (the ones before were sent
    with SNDMORE), zero-copy; the handle is done once ZeroMQ reads none of them."""
    trackers: list[SendHandle] = []
    for n, buffer in enumerate(data):
        more = zmq.SNDMORE if n + 1 < len(data) else 0
        trackers.append(socket.send(buffer, more | zmq.NOBLOCK, copy=False, track=True))
    return trackers[0] if len(trackers) == 1 else SentFrames(trackers)



def _peer(frames: list[zmq.Frame]) -> str:
    """The sender's address, for the log."""
    try:
        return str(frames[-1].get("Peer-Address"))
    except zmq.ZMQError:
        return "an unknown peer"
