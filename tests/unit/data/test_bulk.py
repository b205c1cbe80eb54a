"""The bulk channel of the authenticated plane (`engine.data.bulk`): a TCP pull's bytes outside
CURVE, admitted by one-time grants given over CURVE.

Attacked on real sockets: a process without the plane's key, a token replayed (after its
transfer, or from another connection while it runs), expired, issued for another ref or by
another deployment's owner — each gets no byte, is answered REFUSED, and is counted and logged.
Members still pull (in each `BulkMode`), a MAC'd chunk altered on the way fails its transfer,
and a grant nobody honours fails a pull at once rather than at its deadline."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from engine.data.bulk import BulkGrants, BulkRefused, chunk_tag, copy_intact
from engine.data.channel import RemoteError, TransferError
from engine.data.codec import Limits, WireCodec
from engine.data.curve import BulkMode, PlaneKeys, connect_as_client
from engine.data.peer import Peer, PeerConfig
from engine.data.pulls import ChunkSink, OwnerInfo, PullState
from engine.data.server import ServerConfig
from engine.data.shm import SegmentMapper
from engine.data.wire import (
    PROTOCOL_VERSION,
    BulkChunkReply,
    BulkChunkRequest,
    BulkGrant,
    BulkMessage,
    ChunkReply,
    ErrorCode,
    ErrorReply,
    HelloReply,
    HelloRequest,
    PullReply,
    PullRequest,
    RefId,
    TensorHeader,
    TensorRef,
    Transport,
)

TCP = (Transport.TCP,)
N = 100_000  # float32: 400 kB, above the inline limit
BULK = WireCodec(Limits().max_request_bytes, BulkMessage)
MAIN = WireCodec(Limits().hard_max_message_bytes)


# ------------------------------------------------------------------------ the grants, by themselves
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_grant_serves_each_byte_once_to_one_connection_then_is_gone() -> None:
    grants = BulkGrants(10.0, Clock())
    token, key = grants.issue(RefId("a.1"), 100, mac=True)
    assert len(token) == 16 and len(key) == 32
    assert grants.admit(token, b"c1", RefId("a.1"), 0, 60) == key
    with pytest.raises(BulkRefused, match="another connection"):
        grants.admit(token, b"c2", RefId("a.1"), 60, 40)
    with pytest.raises(BulkRefused, match="served already"):
        grants.admit(token, b"c1", RefId("a.1"), 50, 20)
    with pytest.raises(BulkRefused, match="outside"):
        grants.admit(token, b"c1", RefId("a.1"), 60, 41)
    with pytest.raises(BulkRefused, match="another ref"):
        grants.admit(token, b"c1", RefId("a.2"), 60, 40)
    assert grants.admit(token, b"c1", RefId("a.1"), 60, 40) == key
    assert len(grants) == 0
    with pytest.raises(BulkRefused, match="no such grant"):  # replayed once used up
        grants.admit(token, b"c1", RefId("a.1"), 0, 10)
    assert grants.issue(RefId("a.1"), 100, mac=False)[1] == b""


def test_a_grant_expires_unless_used_and_is_swept() -> None:
    clock = Clock()
    grants = BulkGrants(10.0, clock)
    used, _ = grants.issue(RefId("a.1"), 100, mac=False)
    idle, _ = grants.issue(RefId("a.1"), 100, mac=False)
    clock.now += 9.0
    grants.admit(used, b"c", RefId("a.1"), 0, 10)  # each use renews it
    clock.now += 9.0
    grants.admit(used, b"c", RefId("a.1"), 10, 10)
    with pytest.raises(BulkRefused, match="expired"):
        grants.admit(idle, b"c", RefId("a.1"), 0, 10)
    clock.now += 10.0
    assert grants.sweep() == 1 and len(grants) == 0
    with pytest.raises(BulkRefused, match="no such grant"):
        grants.admit(used, b"c", RefId("a.1"), 20, 10)
    with pytest.raises(ValueError):
        BulkGrants(0.0)


def test_the_mac_binds_the_bytes_the_ref_and_the_range() -> None:
    key = bytes(range(32))
    data = np.arange(3 << 20, dtype=np.uint8)  # several MAC blocks
    tag = chunk_tag(key, "a.1", 4096, memoryview(data))
    dest = np.empty_like(data)
    assert copy_intact(key, "a.1", 4096, memoryview(data), tag, dest)
    assert np.array_equal(dest, data)
    altered = data.copy()
    altered[1 << 20] ^= 1
    assert not copy_intact(key, "a.1", 4096, memoryview(altered), tag, dest)
    assert not copy_intact(key, "a.2", 4096, memoryview(data), tag, dest)
    assert not copy_intact(key, "a.1", 0, memoryview(data), tag, dest)
    assert not copy_intact(bytes(32), "a.1", 4096, memoryview(data), tag, dest)


# ------------------------------------------------------------------------------- on real sockets
def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def keys() -> PlaneKeys:
    return PlaneKeys.generate()


@pytest.fixture(scope="module")
def owner(keys: PlaneKeys) -> Iterator[Peer]:
    with Peer.start(PeerConfig(keys=keys)) as peer:
        yield peer


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def fresh(owner: Peer, value: float = 1.0) -> tuple[TensorRef, np.ndarray]:
    array = np.full(N, value, dtype=np.float32)
    array[0] = time.monotonic()
    return owner.put(array), array


def grant_for(context: zmq.Context, owner: Peer, keys: PlaneKeys, ref: TensorRef) -> BulkGrant:
    """What a member's PullRequest gets over CURVE: the grant."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    connect_as_client(sock, keys)
    sock.connect(owner.address)
    try:
        sock.send(MAIN.encode(HelloRequest(PROTOCOL_VERSION, "member", "elsewhere")))
        assert sock.poll(5000), "no hello reply"
        assert isinstance(MAIN.decode(sock.recv()), HelloReply)
        sock.send(MAIN.encode(PullRequest(1, ref.id, TCP, bulk=True)))
        assert sock.poll(5000), "no pull reply"
        reply = MAIN.decode(sock.recv_multipart()[0])
    finally:
        sock.close()
    assert isinstance(reply, PullReply) and reply.transport is Transport.TCP and reply.bulk is not None, reply
    return reply.bulk


def bulk_socket(context: zmq.Context, address: str) -> zmq.Socket:
    """A plain connection to a bulk channel, as anyone on the network can make."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def ask(sock: zmq.Socket, payload: bytes) -> tuple[object, list[bytes]]:
    sock.send(payload)
    assert sock.poll(5000), "the bulk channel did not answer"
    frames = sock.recv_multipart()
    return BULK.decode(frames[0]), frames[1:]


def chunk(grant: BulkGrant, ref: TensorRef, offset: int = 0, length: int | None = None) -> bytes:
    length = ref.nbytes - offset if length is None else length
    return BULK.encode(BulkChunkRequest(9, grant.token, ref.id, offset, length))


def assert_refused(answer: tuple[object, list[bytes]]) -> None:
    message, data = answer
    assert isinstance(message, ErrorReply) and message.code == ErrorCode.REFUSED, message
    assert data == [], "a refused request got bytes"


def test_a_member_pulls_over_the_bulk_channel(owner: Peer, keys: PlaneKeys) -> None:
    assert owner.server.bulk_address is not None and owner.server.bulk_address != owner.address
    with Peer.start(PeerConfig(keys=keys)) as member:
        for drive in ("fetch", "pull"):
            ref, array = fresh(owner)
            before = owner.server.bulk_bytes
            if drive == "fetch":
                data = member.client.fetch(ref, TCP, 10.0)
            else:
                data = member.client.pull(ref, TCP, 10.0).wait()
            assert np.array_equal(data.numpy(), array), drive
            assert owner.server.bulk_bytes - before == ref.nbytes, drive


def test_a_peer_without_the_key_gets_nothing_from_the_bulk_channel(
        owner: Peer, context: zmq.Context, caplog: pytest.LogCaptureFixture) -> None:
    ref, _ = fresh(owner)
    before, served = owner.server.refused, owner.server.bulk_bytes
    sock = bulk_socket(context, owner.server.bulk_address)
    with caplog.at_level(logging.WARNING, logger="engine.data.bulk"):
        assert_refused(ask(sock, BULK.encode(BulkChunkRequest(1, bytes(16), ref.id, 0, ref.nbytes))))
        assert_refused(ask(sock, BULK.encode(BulkChunkRequest(2, b"", ref.id, 0, ref.nbytes))))
        assert_refused(ask(sock, MAIN.encode(PullRequest(3, ref.id, TCP, bulk=True))))  # not a bulk request
        assert_refused(ask(sock, b"\xc1 not msgpack"))
    assert owner.server.refused - before == 4
    assert sum("refused a request" in r.getMessage() for r in caplog.records) == 4
    assert owner.server.bulk_bytes == served


def test_a_replayed_token_gets_nothing(owner: Peer, keys: PlaneKeys, context: zmq.Context) -> None:
    ref, array = fresh(owner)
    grant = grant_for(context, owner, keys, ref)
    first, second = bulk_socket(context, grant.address), bulk_socket(context, grant.address)
    reply, data = ask(first, chunk(grant, ref, 0, 4096))
    assert isinstance(reply, BulkChunkReply) and data[0] == array.view(np.uint8)[:4096].tobytes()
    before = owner.server.refused
    assert_refused(ask(second, chunk(grant, ref, 4096)))  # in use by another connection
    assert_refused(ask(first, chunk(grant, ref, 0, 4096)))  # a range served already
    reply, data = ask(first, chunk(grant, ref, 4096))
    assert isinstance(reply, BulkChunkReply) and data[0] == array.view(np.uint8)[4096:].tobytes()
    assert_refused(ask(first, chunk(grant, ref)))  # used up: the grant is gone
    assert_refused(ask(second, chunk(grant, ref)))
    assert owner.server.refused - before == 4


def test_an_expired_token_gets_nothing(keys: PlaneKeys, context: zmq.Context) -> None:
    with Peer.start(PeerConfig(keys=keys, server=ServerConfig(bulk_grant_s=0.05))) as owner:
        ref, _ = fresh(owner)
        grant = grant_for(context, owner, keys, ref)
        time.sleep(0.1)  # past the grant's life: what is tested is that it ended
        assert_refused(ask(bulk_socket(context, grant.address), chunk(grant, ref)))
        assert owner.server.refused == 1


def test_a_token_for_another_ref_gets_nothing(owner: Peer, keys: PlaneKeys, context: zmq.Context) -> None:
    ref, _ = fresh(owner)
    other, _ = fresh(owner, 2.0)
    grant = grant_for(context, owner, keys, ref)
    sock = bulk_socket(context, grant.address)
    assert_refused(ask(sock, BULK.encode(BulkChunkRequest(1, grant.token, other.id, 0, other.nbytes))))
    message, data = ask(sock, chunk(grant, ref))
    assert isinstance(message, BulkChunkReply) and len(data[0]) == ref.nbytes


def test_another_deployments_keys_and_tokens_get_nothing(owner: Peer, context: zmq.Context) -> None:
    ref, _ = fresh(owner)
    other_keys = PlaneKeys.generate()
    with Peer.start(PeerConfig(keys=other_keys)) as other_owner, Peer.start(PeerConfig(keys=other_keys)) as foreign:
        with pytest.raises(TransferError):  # no grant without the plane's key: CURVE refuses
            foreign.client.fetch(ref, TCP, 0.5)
        theirs, _ = fresh(other_owner)
        foreign_grant = grant_for(context, other_owner, other_keys, theirs)
        before = owner.server.refused
        sock = bulk_socket(context, owner.server.bulk_address)
        assert_refused(ask(sock, BULK.encode(BulkChunkRequest(1, foreign_grant.token, ref.id, 0, ref.nbytes))))
        assert_refused(ask(sock, BULK.encode(BulkChunkRequest(2, foreign_grant.token, theirs.id, 0, theirs.nbytes))))
        assert owner.server.refused - before == 2


def test_a_grant_the_owner_no_longer_honours_fails_the_pull_at_once(keys: PlaneKeys) -> None:
    """Expired before the first chunk asks for it: the pull fails REFUSED, not at its deadline."""
    with Peer.start(PeerConfig(keys=keys, server=ServerConfig(bulk_grant_s=1e-9))) as owner, \
            Peer.start(PeerConfig(keys=keys)) as member:
        ref, _ = fresh(owner)
        start = time.monotonic()
        with pytest.raises(RemoteError) as info:
            member.client.fetch(ref, TCP, 30.0)
        assert info.value.code == ErrorCode.REFUSED
        with pytest.raises(RemoteError):
            member.client.pull(ref, TCP, 30.0).wait()
        assert time.monotonic() - start < 10.0


@pytest.mark.parametrize("mode", list(BulkMode))
def test_members_pull_in_every_bulk_mode(keys: PlaneKeys, mode: BulkMode) -> None:
    plane = keys.with_bulk(mode)
    with Peer.start(PeerConfig(keys=plane)) as owner, Peer.start(PeerConfig(keys=plane)) as member:
        assert (owner.server.bulk_address is None) == (mode is BulkMode.ENCRYPTED)
        ref, array = fresh(owner)
        assert np.array_equal(member.client.fetch(ref, TCP, 10.0).numpy(), array)
        assert owner.server.bulk_bytes == (0 if mode is BulkMode.ENCRYPTED else ref.nbytes)


def test_an_encrypted_member_never_asks_for_the_bulk_channel(owner: Peer, keys: PlaneKeys) -> None:
    """The operator's setting holds on either side: an `encrypted` client pulls inside CURVE
    from an owner that would grant."""
    with Peer.start(PeerConfig(keys=keys.with_bulk(BulkMode.ENCRYPTED))) as member:
        ref, array = fresh(owner)
        before = owner.server.bulk_bytes
        assert np.array_equal(member.client.fetch(ref, TCP, 10.0).numpy(), array)
        assert owner.server.bulk_bytes == before


# ------------------------------------------------------------------------- the client's checks
def granted_pull(mode: BulkMode, grant: BulkGrant,
                 sink: ChunkSink | None = None) -> tuple[PullState, TensorRef, list[object]]:
    ref = TensorRef("tcp://owner:1", RefId("a.1"), "uint8", (64,), 64, time.time() + 60, "elsewhere")
    pull = PullState(ref, TCP, 1, SegmentMapper(), 4, bulk=mode, sink=sink)
    [request] = pull.start(OwnerInfo("elsewhere", 1 << 20), "here", 1 << 20)
    assert isinstance(request, PullRequest) and request.bulk
    header = TensorHeader("uint8", (64,), (1,), 64)
    return pull, ref, pull.on_reply(PullReply(1, ref.id, Transport.TCP, header, ref.lease_expires_at, bulk=grant), [])


class FakeFrame:
    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


def test_a_macd_chunk_altered_on_the_way_fails_the_pull() -> None:
    key = bytes(range(32))
    pull, ref, [request] = granted_pull(BulkMode.MAC, BulkGrant("tcp://owner:2", bytes(16), key))
    assert isinstance(request, BulkChunkRequest) and request.token == bytes(16)
    data = bytes(range(64))
    tag = chunk_tag(key, ref.id, 0, data)
    with pytest.raises(RemoteError, match="fails its MAC"):
        pull.on_reply(BulkChunkReply(1, 0, 64, tag), [FakeFrame(bytes([1]) + data[1:])])
    pull, ref, _ = granted_pull(BulkMode.MAC, BulkGrant("tcp://owner:2", bytes(16), key))
    assert pull.on_reply(BulkChunkReply(1, 0, 64, tag), [FakeFrame(data)]) == []
    assert pull.result is not None and pull.result.numpy().tobytes() == data


def test_a_sink_gets_only_chunks_that_pass_their_mac() -> None:
    """A pull that hands its chunks to a sink (a KV pull storing pages as they come) checks
    each one's MAC before the sink sees a byte."""
    key = bytes(range(32))
    data = bytes(range(64))
    tag = chunk_tag(key, RefId("a.1"), 0, data)
    got: list[tuple[int, bytes]] = []
    pull, _, _ = granted_pull(BulkMode.MAC, BulkGrant("tcp://owner:2", bytes(16), key),
                              sink=lambda offset, view: got.append((offset, bytes(view))))
    with pytest.raises(RemoteError, match="fails its MAC"):
        pull.on_reply(BulkChunkReply(1, 0, 64, tag), [FakeFrame(bytes([1]) + data[1:])])
    assert got == []
    pull, _, _ = granted_pull(BulkMode.MAC, BulkGrant("tcp://owner:2", bytes(16), key),
                              sink=lambda offset, view: got.append((offset, bytes(view))))
    assert pull.on_reply(BulkChunkReply(1, 0, 64, tag), [FakeFrame(data)]) == []
    assert got == [(0, data)] and pull.finished and pull.result is None


def test_a_mac_client_refuses_a_grant_without_a_key_and_chunks_on_the_wrong_channel() -> None:
    with pytest.raises(RemoteError, match="without a MAC key"):
        granted_pull(BulkMode.MAC, BulkGrant("tcp://owner:2", bytes(16), b""))
    pull, _, _ = granted_pull(BulkMode.CLEAR, BulkGrant("tcp://owner:2", bytes(16), b""))
    with pytest.raises(RemoteError, match="wrong channel"):
        pull.on_reply(ChunkReply(1, 0, 64), [FakeFrame(bytes(64))])
    unasked = PullState(TensorRef("tcp://owner:1", RefId("a.1"), "uint8", (64,), 64, time.time() + 60, "x"),
                        TCP, 1, SegmentMapper(), 4)
    unasked.start(OwnerInfo("x", 1 << 20), "here", 1 << 20)
    with pytest.raises(RemoteError, match="not asked for"):
        unasked.on_reply(PullReply(1, RefId("a.1"), Transport.TCP, TensorHeader("uint8", (64,), (1,), 64), 0.0,
                                   bulk=BulkGrant("tcp://owner:2", bytes(16), b"")), [])
