"""Cross-worker KV pulls between real processes, found through the real Redis index at
REDIS_URL (fails loudly if it is down).

A holder process (this file run as a script) fills a KV store over three tiers, serves its
pages on its Peer and publishes them to Redis; the test process looks the pages up in the
index and pulls them over shared memory and over TCP, bit-exact against pages it computes
itself, with pickle forbidden in the holder. A SIGKILLed holder (before the pull, or while it
sends the pages) is a `KVTransferError` within the timeout. The holder talks to
the test over stdin/stdout in JSON lines; closing its stdin stops it. The holder's Peer is on a
CURVE plane (`engine.data.curve`): a process without its key gets no page.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.data.curve import PlaneKeys
from engine.data.kv.errors import KVTransferError
from engine.data.kv.index import RedisKVIndex
from engine.data.kv.keys import page_hashes
from engine.data.kv.layout import KVLayout
from engine.data.kv.store import KVStore, KVStoreConfig
from engine.data.kv.tier import Capacity
from engine.data.peer import ClientConfig, Peer, PeerConfig
from engine.data.wire import StatsReply, StatsRequest, Transport

pytestmark = pytest.mark.redis

THIS_FILE = Path(__file__).resolve()
REPO_ROOT = THIS_FILE.parents[2]
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
READY_TIMEOUT_S = 30.0
# 16 KiB pages: a pull of more than four is above the 64 KiB inline limit of tensor refs.
LAYOUT = KVLayout(page_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16")
TOKENS = list(range(5000, 5000 + 8 * LAYOUT.page_size))
KEYS = page_hashes(TOKENS, LAYOUT.page_size)  # 8 pages; holders hold a leading run of them
PLANE = PlaneKeys.generate()
"""The CURVE keys of the holders and of the test's peer."""


def make_page(seed: int) -> torch.Tensor:
    """The bytes of page `seed`, computed independently in each process."""
    generator = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(LAYOUT.page_shape, generator=generator).to(LAYOUT.torch_dtype)


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# --- the holder process --------------------------------------------------------------------------


def _no_pickle(*args: object, **kwargs: object) -> None:
    raise AssertionError("pickle used on the KV pull path")


def _holder_main(namespace: str, worker_id: str, pages: int, disk_dir: str, keys_dir: str, device_pages: int) -> None:
    from engine.data.kv.index import KVIndexPublisher
    from engine.data.kv.pull import KVPageServer
    from engine.data.kv.store import DiskTierConfig

    config = KVStoreConfig(
        layout=LAYOUT,
        device_capacity=Capacity(pages=device_pages),
        host_capacity=Capacity(pages=2),
        disk=DiskTierConfig(disk_dir, Capacity(pages=16)),
        device="cpu",
    )
    index = RedisKVIndex.from_url(REDIS_URL, namespace=namespace)
    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        setattr(pickle, name, _no_pickle)  # nothing on the serving path may pickle
    with KVStore(config) as store, Peer.start(PeerConfig(keys=PlaneKeys.load(keys_dir))) as peer:
        server = KVPageServer(store, peer.server)
        publisher = KVIndexPublisher(index, worker_id)
        publisher.attach(store)
        for seed in range(pages):
            store.put(KEYS[seed], make_page(seed))  # two per tier: the oldest end up on disk
        index.register_worker(worker_id, peer.address, ttl_s=30.0)
        publisher.flush()
        print(json.dumps({"address": peer.address, "pid": os.getpid()}), flush=True)
        for _line in sys.stdin:  # serve until the test closes our stdin
            pass
        publisher.close()
        server.close()
        index.drop_worker(worker_id)


# --- the test side ----------------------------------------------------------------------------------


class Holder:
    def __init__(self, namespace: str, worker_id: str, pages: int, disk_dir: Path, device_pages: int = 2) -> None:
        self.worker_id = worker_id
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        keys_dir = PLANE.write(disk_dir / "keys")
        self.proc = subprocess.Popen(
            [sys.executable, str(THIS_FILE), namespace, worker_id, str(pages), str(disk_dir), str(keys_dir),
             str(device_pages)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=env,
        )
        try:
            hello = self._recv(READY_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        self.address: str = hello["address"]

    def _recv(self, timeout: float) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"holder {self.proc.pid} not ready within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError(f"holder {self.proc.pid} exited with {self.proc.wait()}")
        return json.loads(line)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()


@pytest.fixture(scope="module")
def index() -> Iterator[RedisKVIndex]:
    idx = RedisKVIndex.from_url(REDIS_URL, namespace=f"test-kv-pull-{uuid.uuid4().hex[:12]}", timeout_s=2.0)
    idx.client.ping()  # no skip: a missing Redis is a failure here
    yield idx
    idx.clear()
    idx.client.close()


@pytest.fixture(scope="module")
def holder(index: RedisKVIndex) -> Iterator[Holder]:
    """Holds the first six of the eight pages (in every tier), for the whole module."""
    with tempfile.TemporaryDirectory(prefix="omniflow-kv-pull-") as disk_dir:
        started = Holder(index.namespace, "holder-6", 6, Path(disk_dir))
        yield started
        started.stop()
        assert started.proc.returncode == 0


@pytest.fixture
def peer() -> Iterator[Peer]:
    with Peer.start(PeerConfig(keys=PLANE)) as started:
        yield started


@pytest.fixture
def local() -> Iterator[KVStore]:
    config = KVStoreConfig(layout=LAYOUT, device_capacity=Capacity(pages=16), device="cpu")
    with KVStore(config) as store:
        yield store


def assert_holds_written_pages(store: KVStore, seeds: range) -> None:
    for seed in seeds:
        page = store.get(KEYS[seed], promote=False)
        assert page is not None, f"page {seed} missing"
        assert raw(page) == raw(make_page(seed)), f"page {seed} differs from what the holder wrote"


@pytest.mark.parametrize(
    ("transport", "expected"), [(None, Transport.SHM), (Transport.TCP, Transport.TCP)], ids=["shm", "tcp"]
)
def test_pull_missing_finds_the_holder_in_redis_and_is_bit_exact(
    index: RedisKVIndex,
    holder: Holder,
    peer: Peer,
    local: KVStore,
    transport: Transport | None,
    expected: Transport,
) -> None:
    from engine.data.kv.pull import pull_missing

    local.put(KEYS[0], make_page(0))  # the asker starts with the first page

    result = pull_missing(local, peer, index, KEYS, 5.0, transport=transport)

    # The holder has a run of six; the asker lacks five of them, and page 6 is nowhere.
    assert (result.worker_id, result.holder, result.local_pages) == ("holder-6", holder.address, 1)
    assert result.pages == tuple(KEYS[1:6])
    assert result.transports == (expected,)
    assert result.nbytes == 5 * LAYOUT.page_nbytes
    assert_holds_written_pages(local, range(6))
    assert local.lookup(KEYS).prefix_pages == 6
    metrics = local.metrics()
    assert (metrics["pull.pages"], metrics["pull.bytes"], metrics["pull.failures"]) == (5, result.nbytes, 0)
    assert 0 < metrics["pull.seconds"] <= result.seconds
    # The reply's buffer was released: the release went ahead of this on the I/O thread's connection.
    stats = peer.client.call(holder.address, StatsRequest, 5.0).wait()
    assert isinstance(stats, StatsReply) and stats.live_refs == 0

    again = pull_missing(local, peer, index, KEYS, 5.0, transport=transport)
    assert (again.pages, again.holder, again.local_pages) == ((), None, 6)


def test_layout_mismatch_across_processes_is_refused(index: RedisKVIndex, holder: Holder, peer: Peer) -> None:
    from engine.data.kv.pull import pull_missing

    other = KVLayout(page_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")
    with KVStore(KVStoreConfig(layout=other, device_capacity=Capacity(pages=16), device="cpu")) as store:
        with pytest.raises(KVTransferError, match="layout mismatch"):
            pull_missing(store, peer, index, KEYS, 5.0)
        assert store.resident_pages() == {}
        assert store.metrics()["pull.failures"] == 1


def test_a_killed_holder_is_an_error_within_the_timeout(
    index: RedisKVIndex, holder: Holder, peer: Peer, local: KVStore, tmp_path: Path
) -> None:
    from engine.data.kv.pull import pull_missing

    longer = Holder(index.namespace, "holder-8", 8, tmp_path)
    try:
        assert index.lookup(KEYS) == {"holder-6": 6, "holder-8": 8}
        longer.kill()  # its index entries outlive it until its liveness key lapses
        timeout = 1.0
        start = time.monotonic()
        with pytest.raises(KVTransferError):
            pull_missing(local, peer, index, KEYS, timeout)
        assert time.monotonic() - start < timeout + 0.5
        assert local.resident_pages() == {}
        assert (local.metrics()["pull.pages"], local.metrics()["pull.failures"]) == (0, 1)
    finally:
        longer.stop()
        index.drop_worker("holder-8")

    result = pull_missing(local, peer, index, KEYS, 5.0)  # the live holder still serves
    assert (result.worker_id, result.pages) == ("holder-6", tuple(KEYS[:6]))
    assert_holds_written_pages(local, range(6))


def test_a_holder_killed_mid_send_fails_the_pull_within_the_timeout(
    index: RedisKVIndex, local: KVStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder serves the pages from its slots (all eight in its CPU device tier), one page a
    chunk, one chunk at a time; it is SIGKILLed as the first page arrives. The pull fails within
    its timeout (no hang on the chunks that never come), keeping the page that came."""
    from engine.data.kv.pull import fetch_pages

    killed = Holder(index.namespace, "holder-killed", 8, tmp_path, device_pages=8)
    put = local.put

    def kill_then_put(page: str, data: torch.Tensor) -> None:
        if killed.proc.poll() is None:
            killed.kill()
        put(page, data)  # type: ignore[arg-type]

    monkeypatch.setattr(local, "put", kill_then_put)
    one_by_one = ClientConfig(chunk_bytes=LAYOUT.page_nbytes, window=1)
    try:
        with Peer.start(PeerConfig(keys=PLANE, client=one_by_one)) as puller:
            timeout = 2.0
            start = time.monotonic()
            with pytest.raises(KVTransferError, match="timed out|failed"):
                fetch_pages(local, puller, killed.address, KEYS, timeout, transport=Transport.TCP)
            assert time.monotonic() - start < timeout + 0.5
        assert killed.proc.returncode == -signal.SIGKILL
        assert set(local.resident_pages()) == {KEYS[0]}
        assert_holds_written_pages(local, range(1))
        # pull.pages counts the requests that completed: none did
        assert (local.metrics()["pull.pages"], local.metrics()["pull.failures"]) == (0, 1)
    finally:
        killed.stop()
        index.drop_worker("holder-killed")


@pytest.mark.parametrize("keys", [None, PlaneKeys.generate()], ids=["plaintext", "another-key"])
def test_a_peer_without_the_plane_key_gets_no_page(
    index: RedisKVIndex, holder: Holder, peer: Peer, local: KVStore, keys: PlaneKeys | None
) -> None:
    """A process that finds the holder in the index but lacks the plane's key gets no page,
    over either transport (the shared-memory path too asks the owner first); the keyed peer
    still pulls."""
    from engine.data.kv.pull import pull_missing

    with Peer.start(PeerConfig(keys=keys)) as foreign:
        for transport in (None, Transport.TCP):
            with pytest.raises(KVTransferError):
                pull_missing(local, foreign, index, KEYS, 1.0, transport=transport)
    assert local.resident_pages() == {}
    result = pull_missing(local, peer, index, KEYS, 5.0)
    assert result.pages == tuple(KEYS[:6])
    assert_holds_written_pages(local, range(6))


if __name__ == "__main__":
    _holder_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]))
