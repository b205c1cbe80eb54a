"""Which path a pull took: the tally of a process's pulls per transport, and the host identity
that decides it (`OMNIFLOW_HOST_ID`)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.data.codec import KiB
from engine.data.peer import Peer, PeerConfig
from engine.data.shm import host_id, local_namespace
from engine.data.transfers import TransferTally
from engine.data.wire import Transport


def test_the_tally_counts_pulls_and_bytes_per_transport() -> None:
    tally = TransferTally()
    assert tally.metrics() == {}
    tally.add(Transport.TCP, 100)
    tally.add(Transport.TCP, 50)
    tally.add(Transport.SHM, 4096)
    assert tally.metrics() == {"transfer.tcp.pulls": 2.0, "transfer.tcp.bytes": 150.0,
                               "transfer.shm.pulls": 1.0, "transfer.shm.bytes": 4096.0}
    assert tally.pulls(Transport.INLINE) == 0


@pytest.mark.parametrize(("producer_host", "consumer_host", "expected"), [
    (None, None, Transport.SHM), ("node:a", "node:a", Transport.SHM), ("node:a", "node:b", Transport.TCP)])
def test_peers_take_shared_memory_only_within_one_host_identity(
        monkeypatch: pytest.MonkeyPatch, producer_host: str | None, consumer_host: str | None,
        expected: Transport) -> None:
    tensor = np.arange(64 * KiB, dtype=np.float32)  # 256 KiB: past the inline limit
    peers = []
    try:
        for host in (producer_host, consumer_host):
            if host is None:
                monkeypatch.delenv("OMNIFLOW_HOST_ID", raising=False)
            else:
                monkeypatch.setenv("OMNIFLOW_HOST_ID", host)
            peers.append(Peer.start(PeerConfig()))
        producer, consumer = peers
        ref = producer.put(tensor)
        data = consumer.pull(ref, 10.0)
        assert data.transport is expected and np.array_equal(data.numpy(), tensor)
        assert consumer.transfers.metrics() == {f"transfer.{expected.value}.pulls": 1.0,
                                                f"transfer.{expected.value}.bytes": float(tensor.nbytes)}
        assert producer.transfers.metrics() == {}
    finally:
        for peer in peers:
            peer.close()


def test_the_host_identity_and_the_local_namespace_follow_omniflow_host_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNIFLOW_HOST_ID", raising=False)
    machine = host_id()
    monkeypatch.setenv("OMNIFLOW_HOST_ID", "node:gpu-1")
    assert host_id() == "node:gpu-1" != machine
    namespace = local_namespace()
    assert namespace is not None and namespace.startswith("node:gpu-1/net:")
    for bad in ("two words", "x" * 201, "tab\there"):
        monkeypatch.setenv("OMNIFLOW_HOST_ID", bad)
        with pytest.raises(ValueError, match="OMNIFLOW_HOST_ID"):
            host_id()
