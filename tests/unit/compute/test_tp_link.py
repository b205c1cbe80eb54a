"""The tensor-parallel control link is on the worker plane's CURVE: a peer without the plane's
key, or with a key of its own, is refused (and counted) and never becomes a follower, while a
rank holding the keys meets rank 0 and gets its setup. What a follower's own sockets refuse
reaches rank 0's count over the link."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import zmq

from engine.compute.tp.link import LEADER_KEY, FollowerLink, RefusalReporter, greet_leader
from engine.compute.tp.messages import TPHello, TPSetup, TPStop
from engine.data.curve import PlaneKeys
from engine.data.peer import Peer, PeerConfig


class StoreStandIn:
    """The two calls of `TPGroup` the link makes, over a dict (the group's TCPStore is not under test)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def publish(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def lookup(self, key: str) -> bytes:
        return self.values[key]


def foreign_peer(context: zmq.Context, address: str, server: PlaneKeys, own: PlaneKeys | None) -> zmq.Socket:
    """A DEALER saying hello as rank 1: plaintext (`own` None), or CURVE with a keypair of its own
    (it knows rank 0's public key: public keys are no secret)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if own is not None:
        sock.curve_publickey, sock.curve_secretkey = own.public.encode(), own.secret.encode()
        sock.curve_serverkey = server.public.encode()
    sock.connect(address)
    sock.send(msgspec.msgpack.encode(TPHello(1, os.getpid())))
    return sock


def test_a_foreign_peer_is_refused_on_the_link_and_a_rank_with_the_keys_joins() -> None:
    keys, other = PlaneKeys.generate(), PlaneKeys.generate()
    group = StoreStandIn()
    link = FollowerLink(group, "tcp://127.0.0.1:0", 2, what="role 'lm'", keys=keys)  # type: ignore[arg-type]
    context = zmq.Context()
    peers: list[zmq.Socket] = []
    try:
        address = group.lookup(LEADER_KEY).decode()
        peers = [foreign_peer(context, address, keys, None), foreign_peer(context, address, keys, other)]
        deadline = time.monotonic() + 10
        # The key not authorised is refused by the ZAP handler, always counted; a peer without
        # CURVE is refused too (below: it never meets rank 0), though not always counted (see curve.py).
        while link.refused < 1:
            assert time.monotonic() < deadline, "the link did not refuse the peer with a key of its own"
            peers[1].poll(20)
        met = threading.Thread(target=link.meet, args=(lambda hellos: sorted(set(hellos[0].disk_pages) & {"p1"}),))
        met.start()
        follower = context.socket(zmq.DEALER)
        follower.setsockopt(zmq.LINGER, 0)
        peers.append(follower)
        setup = greet_leader(follower, group, 1, keys, ["p1", "p2"])  # type: ignore[arg-type]
        met.join(timeout=30)
        assert not met.is_alive()
        assert setup == TPSetup(os.getpid(), ["p1"])  # the disk pages rank 0 agreed on
        assert len(link.followers) == 1  # the foreign hellos never reached rank 0
        assert not peers[0].poll(0) and not peers[1].poll(0)  # and got no setup
    finally:
        for sock in peers:
            sock.close()
        context.term()
        link.close()


def test_a_followers_refusals_reach_rank_0_and_a_foreign_message_does_not() -> None:
    """A follower's transfer seat (a real keyed `Peer`) refuses a process with a key of its own;
    the follower's `RefusalReporter` tells rank 0, whose `FollowerLink.refused` then counts it.
    A follower message other than `TPRefusals` changes nothing."""
    keys, other = PlaneKeys.generate(), PlaneKeys.generate()
    group = StoreStandIn()
    link = FollowerLink(group, "tcp://127.0.0.1:0", 2, what="role 'lm'", keys=keys)  # type: ignore[arg-type]
    context = zmq.Context()
    follower = context.socket(zmq.DEALER)
    follower.setsockopt(zmq.LINGER, 0)
    seat = Peer.start(PeerConfig(keys=keys))
    intruders: list[zmq.Socket] = []
    try:
        met = threading.Thread(target=link.meet)
        met.start()
        greet_leader(follower, group, 1, keys)  # type: ignore[arg-type]
        met.join(timeout=30)
        assert not met.is_alive()
        reporter = RefusalReporter(follower, 1, lambda: seat.server.refused, interval_s=0.0)
        reporter.tick()
        assert link.refused == 0  # nothing refused yet, nothing reported
        deadline = time.monotonic() + 10
        while seat.server.refused < 1:
            assert time.monotonic() < deadline, "the follower's seat did not refuse a key of its own"
            intruders.append(foreign_peer(context, seat.address, keys, other))
            intruders[-1].poll(50)
        refused = seat.server.refused
        follower.send(msgspec.msgpack.encode(TPStop()))  # not a report: ignored
        reporter.tick()
        deadline = time.monotonic() + 10
        while link.refused != refused:
            assert time.monotonic() < deadline, f"rank 0 counts {link.refused}, the follower refused {refused}"
            time.sleep(0.01)
        reporter.tick()  # nothing new: no report, and the count stays
        assert link.refused == refused
    finally:
        for sock in intruders:
            sock.close()
        follower.close()
        seat.close()
        context.term()
        link.close()
