"""CURVE on the worker plane: who may talk to a worker's ZeroMQ sockets.

Whoever launches a deployment's (or a cluster's) workers makes one `PlaneKeys` for it: a
CURVE keypair every member holds, so each is a server to the others and a client of them,
and the set of public keys its servers admit (that one key, unless more are written). The
keys travel as files in a directory only their user can read (`write`, `load`); a worker
started by hand on another host is given a copy of that directory (`omniflow keys generate`).

Every server socket of the plane is made a CURVE server by a `PlaneGuard`, the ZAP handler
of its `zmq.Context`: a peer whose public key is not admitted, or that does not speak CURVE
at all, gets no connection, so no reply, no tensor and no KV page; each refusal is logged
(the peer's address and its key's fingerprint) and counted (`PlaneGuard.refused`, reported
in a worker's metrics as `plane.refused`). Clients are set up by `connect_as_client`.

The keys also carry how the plane moves bulk bytes between hosts (`BulkMode`, the file `bulk`):
`clear` (the default) and `mac` send a TCP transfer's bytes outside CURVE, over a channel that
admits only one-time grants issued on the CURVE link (`engine.data.bulk`; `mac` also MACs every
chunk), because CURVE's encryption cut that bandwidth to a third; `encrypted` keeps them inside
CURVE, for networks where others can read or alter what passes.

`keys=None` wherever a `PlaneKeys` is taken means the plaintext plane: no encryption and no
authentication. Only the benchmarks choose it, to measure what CURVE costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import itertools
import logging
import os
import queue
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.utils.monitor
from zmq.utils import z85

log = logging.getLogger(__name__)

ZAP_DOMAIN = "omniflow"
PUBLIC_FILE = "plane.public"
SECRET_FILE = "plane.secret"
AUTHORISED_FILE = "authorised"
"""The admitted public keys, one z85 key a line."""
BULK_FILE = "bulk"
"""The plane's `BulkMode`, one word; optional (absent: `clear`)."""
_Z85_KEY_CHARS = 40
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
_REFUSED_HANDSHAKES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
"""Monitored on server sockets: a peer that does not speak CURVE never reaches the ZAP handler
(a CURVE peer with a key not admitted is counted by the handler). libzmq reports such a peer as
a protocol error (mechanism mismatch) or, as often, as a handshake that failed without detail
(the plaintext peer hung up on seeing CURVE before the server read its greeting): both are
refusals. A plane member never ends a handshake so unless it dies in the middle of one."""


class PlaneKeyError(ValueError):
    """Keys that cannot be used: missing, malformed, or readable by others."""


def fingerprint(public_key: str | bytes) -> str:
    """A short, stable name of a public key (z85 text or its 32 raw bytes) for logs."""
    raw = z85.decode(public_key) if isinstance(public_key, str) else public_key
    return hashlib.blake2b(raw, digest_size=6).hexdigest()


def _check_key(key: str, what: str) -> str:
    if len(key) != _Z85_KEY_CHARS:
        raise PlaneKeyError(f"{what}: expected a {_Z85_KEY_CHARS}-character z85 CURVE key, got {len(key)} characters")
    try:
        z85.decode(key)
    except ValueError as exc:
        raise PlaneKeyError(f"{what}: not z85 ({exc})") from None
    return key


class BulkMode(enum.StrEnum):
    """How the plane carries a TCP transfer's bytes between hosts (`engine.data.bulk`)."""

    CLEAR = "clear"
    """Outside CURVE, only under a one-time grant given over CURVE: only plane members get a
    byte, but whoever reads or alters the network between the hosts reads or alters them."""
    MAC = "mac"
    """As `clear`, and each chunk carries a Poly1305 tag the receiver checks: an alteration on
    the way fails the transfer. Readable on the wire still."""
    ENCRYPTED = "encrypted"
    """Inside CURVE, like every other message of the plane: a third of the bandwidth."""

    @property
    def bulk_channel(self) -> bool:
        """Whether bytes go over the bulk channel rather than inside CURVE."""
        return self is not BulkMode.ENCRYPTED

    @classmethod
    def parse(cls, text: str, what: str) -> BulkMode:
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise PlaneKeyError(f"{what}: {text.strip()!r} is not a bulk mode"
                                f" (one of {', '.join(m.value for m in cls)})") from None


@dataclass(frozen=True, slots=True)
class PlaneKeys:
    """This member's CURVE keypair (z85), the public keys the plane's servers admit, and how
    the plane carries bulk bytes (`bulk`): every member of a plane holds the same."""

    public: str
    secret: str
    authorised: frozenset[str]
    bulk: BulkMode = BulkMode.CLEAR

    def __post_init__(self) -> None:
        _check_key(self.public, "public key")
        _check_key(self.secret, "secret key")
        if zmq.curve_public(self.secret.encode()).decode() != self.public:
            raise PlaneKeyError("the secret key does not belong to the public key")
        if not self.authorised:
            raise PlaneKeyError("no public key is authorised: every peer would be refused")
        for key in self.authorised:
            _check_key(key, "authorised key")

    def __repr__(self) -> str:  # never print the secret
        return (f"PlaneKeys(public={fingerprint(self.public)}, authorised={len(self.authorised)},"
                f" bulk={self.bulk.value})")

    @classmethod
    def generate(cls, bulk: BulkMode = BulkMode.CLEAR) -> PlaneKeys:
        """A fresh keypair, admitting itself: one per deployment or cluster, held by every member."""
        public, secret = zmq.curve_keypair()
        return cls(public.decode(), secret.decode(), frozenset({public.decode()}), bulk)

    def with_bulk(self, bulk: BulkMode) -> PlaneKeys:
        return dataclasses.replace(self, bulk=bulk)

    def write(self, directory: str | os.PathLike[str]) -> Path:
        """Write the keys into `directory` (created 0700 if missing; it must be this user's
        and private), each file 0600; returns the directory."""
        path = Path(directory)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(path, directory=True)
        for name, text in ((PUBLIC_FILE, self.public + "\n"), (SECRET_FILE, self.secret + "\n"),
                           (AUTHORISED_FILE, "".join(k + "\n" for k in sorted(self.authorised))),
                           (BULK_FILE, self.bulk.value + "\n")):
            target = path / name
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(text)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> PlaneKeys:
        """The keys `write` put in `directory`. Raises PlaneKeyError when a file is missing or
        malformed, or when the directory or a file is not this user's or is readable by others.
        A directory without the `bulk` file (written before it existed) is `clear`."""
        path = Path(directory)
        _check_private(path, directory=True)
        texts = {}
        for name in (PUBLIC_FILE, SECRET_FILE, AUTHORISED_FILE):
            target = path / name
            _check_private(target, directory=False)
            texts[name] = target.read_text()
        authorised = frozenset(line.strip() for line in texts[AUTHORISED_FILE].splitlines() if line.strip())
        bulk = BulkMode.CLEAR
        if os.path.lexists(path / BULK_FILE):
            _check_private(path / BULK_FILE, directory=False)
            bulk = BulkMode.parse((path / BULK_FILE).read_text(), str(path / BULK_FILE))
        try:
            return cls(texts[PUBLIC_FILE].strip(), texts[SECRET_FILE].strip(), authorised, bulk)
        except PlaneKeyError as exc:
            raise PlaneKeyError(f"{path}: {exc}") from None


def _check_private(path: Path, *, directory: bool) -> None:
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise PlaneKeyError(f"{path}: no such {'directory' if directory else 'file'}") from None
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    if not kind(info.st_mode):
        raise PlaneKeyError(f"{path}: not a {'directory' if directory else 'regular file'} (symlinks are refused)")
    if info.st_uid != os.getuid():
        raise PlaneKeyError(f"{path}: owned by uid {info.st_uid}, not by this user (uid {os.getuid()})")
    if info.st_mode & 0o077:
        raise PlaneKeyError(f"{path}: mode {stat.S_IMODE(info.st_mode):04o} lets group or others in;"
                            f" keys must be {'0700' if directory else '0600'} (chmod go-rwx)")


def connect_as_client(sock: zmq.Socket, keys: PlaneKeys | None) -> None:
    """Make `sock` (not yet connected) a CURVE client of the plane's servers; None: plaintext."""
    if keys is None:
        return
    sock.curve_publickey = keys.public.encode()
    sock.curve_secretkey = keys.secret.encode()
    sock.curve_serverkey = keys.public.encode()


class PlaneGuard:
    """The ZAP handler of one `zmq.Context`: admits CURVE peers whose public key is in
    `keys.authorised`, refuses (logs, counts) every other one. Start it before the context's
    first server socket binds (`serve`); close it after they are closed, before the context
    is terminated. Server sockets enforce the ZAP domain, so while no guard answers they
    admit nobody: a guard that is gone fails closed.

    One thread per guard answers ZAP requests and reads the server sockets' monitors."""

    def __init__(self, context: zmq.Context, keys: PlaneKeys, *, name: str = "plane") -> None:
        self.keys = keys
        self._name = name
        # The thread's own sockets are plain ones even where the context is an asyncio one.
        self._context = zmq.Context.shadow(context.underlying)
        self._zap = self._context.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP_ENDPOINT)
        self._admitted = frozenset(z85.decode(k) for k in keys.authorised)
        self._refused = 0
        self._monitors: queue.SimpleQueue[zmq.Socket] = queue.SimpleQueue()
        self._monitor_ids = itertools.count(1)
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"omniflow-zap-{name}", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        """Connections refused so far: a key not admitted, or no CURVE."""
        return self._refused

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` (of this guard's context, not yet bound) a CURVE server of the plane."""
        sock.curve_server = True
        sock.curve_publickey = self.keys.public.encode()
        sock.curve_secretkey = self.keys.secret.encode()
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        address = f"inproc://omniflow-monitor-{self._name}-{next(self._monitor_ids)}-{id(self)}"
        sock.monitor(address, _REFUSED_HANDSHAKES)
        monitor = self._context.socket(zmq.PAIR)
        monitor.connect(address)
        self._monitors.put(monitor)  # the guard's thread owns it from now on
        os.write(self._wake_w, b"\0")

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        os.write(self._wake_w, b"\0")
        self._thread.join(5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # --- the guard's thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        monitors: list[zmq.Socket] = []
        try:
            while not self._stopping:
                events = dict(poller.poll())
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                while not self._monitors.empty():
                    monitor = self._monitors.get()
                    monitors.append(monitor)
                    poller.register(monitor, zmq.POLLIN)
                if self._zap in events:
                    self._answer(self._zap.recv_multipart())
                for monitor in [m for m in monitors if m in events]:
                    self._monitored(monitor)
        finally:
            for monitor in monitors:
                monitor.close(linger=0)
            self._zap.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        """One ZAP request (RFC 27): version, request id, domain, address, identity, mechanism,
        credentials."""
        if len(frames) < 6:
            log.warning("%s: malformed ZAP request of %d frames", self._name, len(frames))
            return
        version, request_id, domain, address, _identity, mechanism, *credentials = frames
        key = credentials[0] if mechanism == b"CURVE" and credentials else b""
        if domain == ZAP_DOMAIN.encode() and key in self._admitted:
            status, text = b"200", b"OK"
        else:
            status, text = b"400", b"key not authorised"
            self._refused += 1
            who = fingerprint(key) if len(key) == 32 else f"no key ({mechanism.decode('ascii', 'replace')})"
            log.warning("%s: refused a connection from %s: key %s is not authorised",
                        self._name, address.decode("ascii", "replace"), who)
        self._zap.send_multipart([version, request_id, status, text, b"", b""])

    def _monitored(self, monitor: zmq.Socket) -> None:
        with contextlib.suppress(zmq.Again):
            while True:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 2:
                    continue
                event = zmq.utils.monitor.parse_monitor_message(frames)
                if event["event"] & _REFUSED_HANDSHAKES:
                    self._refused += 1
                    log.warning("%s: refused a connection on %s that does not speak CURVE (handshake error %#x)",
                                self._name, event["endpoint"].decode("ascii", "replace"), event["value"])
