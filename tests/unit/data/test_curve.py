"""The worker plane's CURVE keys and guard (`engine.data.curve`), on real sockets: key files
written private and refused at load when others could read them (or they are not this
user's, or are links), and a tensor server on the plane that gives a peer without the key
nothing — no pull, no answer — while counting the refusal, and still serves its members."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from engine.data.channel import TransferError
from engine.data.curve import (
    AUTHORISED_FILE,
    BULK_FILE,
    PUBLIC_FILE,
    SECRET_FILE,
    BulkMode,
    PlaneGuard,
    PlaneKeyError,
    PlaneKeys,
    connect_as_client,
)
from engine.data.peer import Peer, PeerConfig
from engine.data.wire import Transport

NOBODY = 65534


def test_keys_round_trip_through_private_files(tmp_path: Path) -> None:
    keys = PlaneKeys.generate()
    directory = keys.write(tmp_path / "keys")
    assert os.stat(directory).st_mode & 0o777 == 0o700
    for name in (PUBLIC_FILE, SECRET_FILE, AUTHORISED_FILE):
        assert os.stat(directory / name).st_mode & 0o777 == 0o600, name
    assert PlaneKeys.load(directory) == keys
    assert keys.authorised == {keys.public}
    assert keys.secret not in repr(keys)


def test_the_bulk_mode_travels_with_the_keys(tmp_path: Path) -> None:
    keys = PlaneKeys.generate(BulkMode.ENCRYPTED)
    directory = keys.write(tmp_path / "keys")
    assert (directory / BULK_FILE).read_text() == "encrypted\n"
    assert os.stat(directory / BULK_FILE).st_mode & 0o777 == 0o600
    assert PlaneKeys.load(directory).bulk is BulkMode.ENCRYPTED
    assert "bulk=encrypted" in repr(keys)
    (directory / BULK_FILE).unlink()  # keys written before the file existed
    assert PlaneKeys.load(directory).bulk is BulkMode.CLEAR
    (directory / BULK_FILE).write_text("plaintext\n")
    os.chmod(directory / BULK_FILE, 0o600)
    with pytest.raises(PlaneKeyError, match=r"bulk: 'plaintext' is not a bulk mode \(one of clear, mac, encrypted\)"):
        PlaneKeys.load(directory)
    os.chmod(directory / BULK_FILE, 0o644)
    with pytest.raises(PlaneKeyError, match="lets group or others in"):
        PlaneKeys.load(directory)


@pytest.mark.parametrize(("target", "mode"), [("", 0o750), ("", 0o705), (SECRET_FILE, 0o640),
                                              (SECRET_FILE, 0o604), (AUTHORISED_FILE, 0o644)])
def test_keys_readable_by_others_are_refused(tmp_path: Path, target: str, mode: int) -> None:
    directory = PlaneKeys.generate().write(tmp_path / "keys")
    os.chmod(directory / target, mode)
    with pytest.raises(PlaneKeyError, match=f"mode {mode:04o} lets group or others in"):
        PlaneKeys.load(directory)


def test_keys_of_another_user_or_behind_a_link_are_refused(tmp_path: Path) -> None:
    directory = PlaneKeys.generate().write(tmp_path / "keys")
    os.chown(directory / SECRET_FILE, NOBODY, NOBODY)  # the tests run as root
    with pytest.raises(PlaneKeyError, match=f"owned by uid {NOBODY}"):
        PlaneKeys.load(directory)
    os.chown(directory / SECRET_FILE, os.getuid(), os.getgid())
    (tmp_path / "elsewhere").write_text(PlaneKeys.generate().secret)
    os.chmod(tmp_path / "elsewhere", 0o600)
    (directory / SECRET_FILE).unlink()
    (directory / SECRET_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PlaneKeyError, match="symlinks are refused"):
        PlaneKeys.load(directory)


def test_malformed_or_mismatched_keys_are_refused(tmp_path: Path) -> None:
    keys, other = PlaneKeys.generate(), PlaneKeys.generate()
    with pytest.raises(PlaneKeyError, match="does not belong"):
        PlaneKeys(keys.public, other.secret, frozenset({keys.public}))
    with pytest.raises(PlaneKeyError, match="40-character"):
        PlaneKeys("short", keys.secret, frozenset({keys.public}))
    with pytest.raises(PlaneKeyError, match="no public key is authorised"):
        PlaneKeys(keys.public, keys.secret, frozenset())
    directory = keys.write(tmp_path / "keys")
    (directory / PUBLIC_FILE).write_text(other.public)
    with pytest.raises(PlaneKeyError, match="does not belong"):
        PlaneKeys.load(directory)
    with pytest.raises(PlaneKeyError, match="no such directory"):
        PlaneKeys.load(tmp_path / "missing")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.01)


@pytest.fixture
def owner() -> Peer:
    keys = PlaneKeys.generate()
    with Peer.start(PeerConfig(keys=keys)) as peer:
        yield peer


@pytest.mark.parametrize("intruder", [None, "another-key"], ids=["plaintext", "another-key"])
def test_a_peer_without_the_key_pulls_nothing(owner: Peer, intruder: str | None) -> None:
    """Over TCP (a process of this uid could map the owner's 0600 segments anyway: same-host
    trust is the uid's, as on the local control socket)."""
    ref = owner.put(np.arange(100_000, dtype=np.float32))
    keys = None if intruder is None else PlaneKeys.generate()
    with Peer.start(PeerConfig(keys=keys)) as foreign:
        with pytest.raises(TransferError):
            foreign.client.fetch(ref, (Transport.TCP, Transport.INLINE), 0.5)
        with pytest.raises(TransferError):
            foreign.client.pull(ref, (Transport.TCP, Transport.INLINE), 0.5).wait()  # the I/O thread's, too
        # A refusal is counted once a handshake got as far as failing; on a busy machine a
        # plaintext client may give up before its greeting is read: it tries again meanwhile.
        deadline = time.monotonic() + 10.0
        while owner.server.refused < 1:
            assert time.monotonic() < deadline, "the owner never counted a refusal"
            with pytest.raises(TransferError):
                foreign.client.fetch(ref, (Transport.TCP, Transport.INLINE), 0.5)
    assert owner.store.stats().live_refs == 1  # nothing was leased or released by the intruder
    assert owner.keys is not None
    with Peer.start(PeerConfig(keys=owner.keys)) as member:
        assert member.client.fetch(ref, (Transport.TCP, Transport.INLINE), 5.0).numpy()[-1] == 99_999.0


@pytest.mark.timeout(60)
def test_calls_of_a_client_the_owner_refused_fail_and_never_hang(owner: Peer) -> None:
    """Once the owner refused its handshake, a plaintext client's socket may have no connection to
    send on: its sends must end with the call's deadline (a plain DEALER send blocked forever)."""
    ref = owner.put(np.arange(1000, dtype=np.float32))
    with Peer.start(PeerConfig(keys=None)) as foreign:
        for _ in range(6):  # the refusal races the send: a few rounds make the dead socket likely
            with pytest.raises(TransferError):
                foreign.client.fetch(ref, (Transport.TCP, Transport.INLINE), 0.3)
            with pytest.raises(TransferError):
                foreign.client.pull(ref, (Transport.TCP, Transport.INLINE), 0.3).wait(5.0)


def test_a_curve_peer_knowing_the_server_key_but_not_authorised_gets_no_answer() -> None:
    """The ZAP handler, not the secrecy of the public key, keeps it out: the intruder uses
    the server's public key and a keypair of its own."""
    keys, other = PlaneKeys.generate(), PlaneKeys.generate()
    context = zmq.Context()
    guard = PlaneGuard(context, keys, name="test")
    server = context.socket(zmq.ROUTER)
    guard.serve(server)
    server.bind("tcp://127.0.0.1:0")
    endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
    intruder, member = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    try:
        intruder.curve_publickey, intruder.curve_secretkey = other.public.encode(), other.secret.encode()
        intruder.curve_serverkey = keys.public.encode()
        connect_as_client(member, keys)
        for sock in (intruder, member):
            sock.connect(endpoint)
            sock.send(b"hello")
        assert server.poll(5000)
        identity, payload = server.recv_multipart()
        assert payload == b"hello"
        wait_for(lambda: guard.refused >= 1, 5.0, "the guard counts the intruder")
        assert server.poll(200) == 0  # the intruder's message never arrives
    finally:
        for sock in (intruder, member, server):
            sock.close(linger=0)
        guard.close()
        context.term()
