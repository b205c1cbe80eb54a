"""Cross-worker KV page pulls in one process: two Peers (real sockets, real shared memory), two
stores. Pages arrive bit-exact on every channel, only the holder's leading run comes, the
holder's tiers stay as they were, failures are typed and bounded by the timeout, and the
pull metrics count it all."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from kv_factories import StoreFactory, make_keys, make_page, raw, small_layout

from engine.data.codec import KiB, WireCodec
from engine.data.curve import BulkMode, PlaneKeys
from engine.data.kv.errors import KVTransferError
from engine.data.kv.index import WorkerPrefix
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.pull import HolderChoice, KVPageServer, choose_holder, fetch_pages, pull_missing
from engine.data.kv.store import KVStore
from engine.data.kv.tier import Tier
from engine.data.peer import ClientConfig, Peer, PeerConfig, ServerConfig
from engine.data.server import TensorServer
from engine.data.wire import (
    PROTOCOL_VERSION,
    ChunkRequest,
    HelloReply,
    HelloRequest,
    KVFetchReply,
    KVFetchRequest,
    PingRequest,
    StatsReply,
    StatsRequest,
    TensorRef,
    Transport,
)

# 16 KiB pages: six of them (96 KiB) are above the tensor store's 64 KiB inline limit, so a
# reply travels through shared memory or TCP; `small_layout` pages (1 KiB) travel inline.
BIG = KVLayout(page_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16")
KEYS = make_keys(6, page_size=16)
TIMEOUT_S = 5.0

PeerFactory = Callable[..., Peer]


@pytest.fixture
def make_peer() -> Iterator[PeerFactory]:
    peers: list[Peer] = []

    def factory(client: ClientConfig | None = None) -> Peer:
        peer = Peer.start(PeerConfig(client=client or ClientConfig()))
        peers.append(peer)
        return peer

    yield factory
    for peer in peers:
        peer.close()


def holder_store(
    make_store: StoreFactory, tmp_path: Path, layout: KVLayout, keys: Sequence[PageHash]
) -> KVStore:
    """Two pages per tier, the oldest on disk: serving must read every tier."""
    store = make_store(device=2, host=2, disk=10, layout=layout, disk_dir=tmp_path / "holder")
    for seed, key in enumerate(keys):
        store.put(key, make_page(layout, seed))
    return store


def assert_holds_written_pages(store: KVStore, keys: Sequence[PageHash], layout: KVLayout) -> None:
    for seed, key in enumerate(keys):
        page = store.get(key, promote=False)
        assert page is not None, f"page {seed} missing"
        assert torch.equal(raw(page), raw(make_page(layout, seed))), f"page {seed} differs"


def released_at_holder(puller: Peer, holder: Peer) -> int:
    """Live refs at the holder once every earlier request of the puller's I/O thread is served
    (one connection answers in order: the pull's release comes before this request)."""
    reply = puller.client.call(holder.address, StatsRequest, TIMEOUT_S).wait()
    assert isinstance(reply, StatsReply)
    return reply.live_refs


@pytest.mark.parametrize(
    ("layout", "transport", "expected"),
    [
        (BIG, None, Transport.SHM),
        (BIG, Transport.TCP, Transport.TCP),
        (small_layout(), None, Transport.INLINE),
    ],
    ids=["shm", "tcp", "inline"],
)
def test_pull_is_bit_exact_on_every_channel_and_leaves_the_holder_as_it_was(
    make_store: StoreFactory,
    make_peer: PeerFactory,
    tmp_path: Path,
    layout: KVLayout,
    transport: Transport | None,
    expected: Transport,
) -> None:
    keys = make_keys(6, page_size=layout.page_size)
    holder = make_peer()
    served = holder_store(make_store, tmp_path, layout, keys)
    tiers_before = {key: served.tiers_of(key) for key in keys}
    assert {t for tiers in tiers_before.values() for t in tiers} == {Tier.DEVICE, Tier.HOST, Tier.DISK}
    pages_server = KVPageServer(served, holder.server)
    puller = make_peer(ClientConfig(chunk_bytes=32 * KiB, window=2))  # TCP: several chunks per reply
    local = make_store(device=8, host=None, disk=None, layout=layout)

    result = fetch_pages(local, puller, holder.address, keys, TIMEOUT_S, transport=transport)

    assert result.pages == tuple(keys)
    assert result.holder == holder.address
    assert result.transports == (expected,)
    assert result.nbytes == 6 * layout.page_nbytes
    assert 0 < result.seconds < TIMEOUT_S
    assert_holds_written_pages(local, keys, layout)
    assert {key: served.tiers_of(key) for key in keys} == tiers_before  # read in place, not promoted
    assert released_at_holder(puller, holder) == 0
    metrics = local.metrics()
    assert (metrics["pull.pages"], metrics["pull.bytes"], metrics["pull.failures"]) == (6, result.nbytes, 0)
    assert metrics["pull.seconds"] == pytest.approx(result.seconds)
    assert {k: v for k, v in metrics.items() if k.startswith("pull.") and k.endswith(".pages")
            and k != "pull.pages"} == {f"pull.{expected.value}.pages": 6}  # the path the pages took
    if transport is None:  # the peer's own choice of path is counted there too
        assert puller.transfers.metrics() == {f"transfer.{expected.value}.pulls": 1.0,
                                              f"transfer.{expected.value}.bytes": float(result.nbytes)}
    pages_server.close()


def test_peers_of_different_hosts_pull_pages_over_tcp_even_where_shared_memory_would_work(
    make_store: StoreFactory, make_peer: PeerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nodes made of network namespaces of one machine share /dev/shm; their host identities
    (OMNIFLOW_HOST_ID, which a node agent gives its workers) keep them on TCP."""
    keys = make_keys(6, page_size=BIG.page_size)
    monkeypatch.setenv("OMNIFLOW_HOST_ID", "node:a")
    holder = make_peer()
    monkeypatch.setenv("OMNIFLOW_HOST_ID", "node:b")
    puller = make_peer()
    assert (holder.host, puller.host) == ("node:a", "node:b")
    pages_server = KVPageServer(holder_store(make_store, tmp_path, BIG, keys), holder.server)
    local = make_store(device=8, host=None, disk=None, layout=BIG)
    result = fetch_pages(local, puller, holder.address, keys, TIMEOUT_S)
    assert result.transports == (Transport.TCP,) and local.metrics()["pull.tcp.pages"] == 6
    assert_holds_written_pages(local, keys, BIG)
    pages_server.close()


def test_long_pulls_go_in_several_requests(
    make_store: StoreFactory, make_peer: PeerFactory, tmp_path: Path
) -> None:
    holder = make_peer()
    KVPageServer(holder_store(make_store, tmp_path, BIG, KEYS), holder.server)
    puller = make_peer()
    local = make_store(device=8, host=None, disk=None, layout=BIG)

    result = fetch_pages(local, puller, holder.address, KEYS, TIMEOUT_S, max_pages=4)

    assert result.pages == tuple(KEYS)
    assert result.transports == (Transport.INLINE, Transport.INLINE)  # 4 + 2 pages of 16 KiB: inline both
    assert_holds_written_pages(local, KEYS, BIG)
    assert local.metrics()["pull.pages"] == 6


@pytest.mark.parametrize(("held", "expected"), [
    (6, (Transport.TCP,) * 3), (4, (Transport.TCP,) * 2), (3, (Transport.TCP, Transport.INLINE))],
    ids=["all", "two-requests", "mid-request"])
def test_tcp_pulls_ask_ahead_and_store_pages_split_over_chunks(
    make_store: StoreFactory, make_peer: PeerFactory, tmp_path: Path, held: int, expected: tuple[Transport, ...]
) -> None:
    """Requests of two 48 KiB pages (past the inline limit), each asked for while the one before
    travels; 20 KiB chunks split every page in three, and each page is stored once whole. A run
    that ends (at a request's end, or inside one: one page, inline) asks no further, and every
    reply's buffer is released at the holder."""
    layout = KVLayout(page_size=16, num_layers=6, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    keys = make_keys(6, page_size=16)
    holder = make_peer()
    served = make_store(device=8, host=None, disk=None, layout=layout)
    for seed in range(held):
        served.put(keys[seed], make_page(layout, seed))
    KVPageServer(served, holder.server)
    puller = make_peer(ClientConfig(chunk_bytes=20 * KiB, window=2))
    local = make_store(device=8, host=None, disk=None, layout=layout)

    result = fetch_pages(local, puller, holder.address, keys, TIMEOUT_S, transport=Transport.TCP, max_pages=2)

    assert result.pages == tuple(keys[:held])
    assert result.transports == expected
    assert set(local.resident_pages()) == set(keys[:held])
    assert_holds_written_pages(local, keys[:held], layout)
    assert local.metrics()["pull.pages"] == held
    assert puller.transfers.metrics()["transfer.tcp.bytes"] == 2 * expected.count(Transport.TCP) * layout.page_nbytes
    assert released_at_holder(puller, holder) == 0


@pytest.mark.parametrize("mode", [BulkMode.CLEAR, BulkMode.MAC])
def test_on_an_authenticated_plane_the_pages_come_with_their_bulk_grant(
    make_store: StoreFactory, tmp_path: Path, mode: BulkMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TCP pull on a plane with bulk channels takes the one-time grant in the holder's reply
    (no `PullRequest` round trip): every byte comes over the bulk channel, each grant used up."""
    keys = PlaneKeys.generate().with_bulk(mode)
    layout = KVLayout(page_size=16, num_layers=6, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    pages = make_keys(6, page_size=16)
    with Peer.start(PeerConfig(keys=keys)) as holder, \
            Peer.start(PeerConfig(keys=keys, client=ClientConfig(chunk_bytes=64 * KiB))) as puller:
        served = make_store(device=8, host=None, disk=None, layout=layout)
        for seed, key in enumerate(pages):
            served.put(key, make_page(layout, seed))
        KVPageServer(served, holder.server)
        local = make_store(device=8, host=None, disk=None, layout=layout)
        granted: list[str] = []
        pull_granted = puller.pull_granted

        def spy(ref: TensorRef, *args: Any, **kwargs: Any) -> Any:
            granted.append(ref.id)
            return pull_granted(ref, *args, **kwargs)

        monkeypatch.setattr(puller, "pull_granted", spy)

        result = fetch_pages(local, puller, holder.address, pages, TIMEOUT_S, transport=Transport.TCP, max_pages=2)

        assert result.pages == tuple(pages) and result.transports == (Transport.TCP,) * 3
        assert len(set(granted)) == 3  # each request's pages pulled under the grant of its reply
        assert_holds_written_pages(local, pages, layout)
        assert holder.server.bulk_bytes == 6 * layout.page_nbytes
        assert holder.server.refused == 0
        assert released_at_holder(puller, holder) == 0


def test_only_the_holders_leading_run_comes(
    make_store: StoreFactory, make_peer: PeerFactory, tmp_path: Path
) -> None:
    holder = make_peer()
    served = make_store(device=8, host=None, disk=None, layout=BIG)
    for seed in (0, 1, 2, 4):  # a gap at page 3: page 4 is useless without it
        served.put(KEYS[seed], make_page(BIG, seed))
    KVPageServer(served, holder.server)
    puller = make_peer()
    local = make_store(device=8, host=None, disk=None, layout=BIG)

    result = fetch_pages(local, puller, holder.address, KEYS, TIMEOUT_S)

    assert result.pages == tuple(KEYS[:3])
    assert result.nbytes == 3 * BIG.page_nbytes
    assert set(local.resident_pages()) == set(KEYS[:3])
    assert_holds_written_pages(local, KEYS[:3], BIG)
    assert local.metrics()["pull.pages"] == 3

    nothing = fetch_pages(local, puller, holder.address, KEYS[3:], TIMEOUT_S)  # holder lacks page 3
    assert (nothing.pages, nothing.nbytes, nothing.transports) == ((), 0, ())
    assert set(local.resident_pages()) == set(KEYS[:3])
    assert (local.metrics()["pull.pages"], local.metrics()["pull.failures"]) == (3, 0)
    assert released_at_holder(puller, holder) == 0


def test_layout_mismatch_is_refused(make_store: StoreFactory, make_peer: PeerFactory, tmp_path: Path) -> None:
    holder = make_peer()
    KVPageServer(holder_store(make_store, tmp_path, BIG, KEYS), holder.server)
    puller = make_peer()
    other = KVLayout(page_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")
    local = make_store(device=8, host=None, disk=None, layout=other)

    with pytest.raises(KVTransferError, match="layout mismatch"):
        fetch_pages(local, puller, holder.address, KEYS, TIMEOUT_S)

    assert local.resident_pages() == {}
    assert (local.metrics()["pull.pages"], local.metrics()["pull.failures"]) == (0, 1)


def test_a_dead_holder_fails_within_the_timeout(
    make_store: StoreFactory, make_peer: PeerFactory, tmp_path: Path
) -> None:
    holder = make_peer()
    KVPageServer(holder_store(make_store, tmp_path, BIG, KEYS), holder.server)
    puller = make_peer()
    local = make_store(device=8, host=None, disk=None, layout=BIG)
    assert fetch_pages(local, puller, holder.address, KEYS[:1], TIMEOUT_S).pages == (KEYS[0],)
    holder.close()

    timeout = 0.5
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="failed"):
        fetch_pages(local, puller, holder.address, KEYS, timeout)
    assert time.monotonic() - start < timeout + 0.5
    assert set(local.resident_pages()) == {KEYS[0]}
    assert (local.metrics()["pull.pages"], local.metrics()["pull.failures"]) == (1, 1)


def test_a_worker_that_serves_no_pages_refuses(
    make_store: StoreFactory, make_peer: PeerFactory, tmp_path: Path
) -> None:
    holder = make_peer()
    pages_server = KVPageServer(holder_store(make_store, tmp_path, BIG, KEYS), holder.server)
    puller = make_peer()
    local = make_store(device=8, host=None, disk=None, layout=BIG)
    pages_server.close()

    with pytest.raises(KVTransferError, match="does not answer KVFetchRequest"):
        fetch_pages(local, puller, holder.address, KEYS, TIMEOUT_S)
    assert local.metrics()["pull.failures"] == 1


def test_serve_answers_the_run_it_holds(
    make_store: StoreFactory, make_peer: PeerFactory, tmp_path: Path
) -> None:
    holder = make_peer()
    served = holder_store(make_store, tmp_path, BIG, KEYS[:2])
    pages_server = KVPageServer(served, holder.server, lease_s=1.0)

    reply = pages_server.serve(KVFetchRequest(7, tuple(KEYS), BIG.fingerprint()))

    assert isinstance(reply, KVFetchReply)
    assert (reply.request_id, reply.found) == (7, tuple(KEYS[:2]))
    assert reply.ref is not None and reply.ref.shape == (2, *BIG.page_shape) and reply.ref.dtype == "bfloat16"
    assert reply.ref.lease_expires_at <= time.time() + 1.0
    data = holder.pull(reply.ref, TIMEOUT_S).torch()
    for seed in range(2):
        assert torch.equal(raw(data[seed]), raw(make_page(BIG, seed)))
    assert holder.release(reply.ref)
    assert pages_server.serve(KVFetchRequest(8, tuple(KEYS[2:]), BIG.fingerprint())) == KVFetchReply(
        8, (), None
    )


def test_register_handler_takes_only_requests_the_server_does_not_answer(make_peer: PeerFactory) -> None:
    server: TensorServer = make_peer().server
    for taken in (PingRequest, StatsRequest, KVFetchReply, int):
        with pytest.raises(ValueError):
            server.register_handler(taken, lambda request: request)


# --- choosing a holder --------------------------------------------------------------------------


def prefix(worker: str, *tiers: Tier) -> WorkerPrefix:
    return WorkerPrefix(worker, len(tiers), tiers)


def test_choose_holder_prefers_the_longest_run_then_the_fastest_tiers() -> None:
    prefixes = {
        "a": prefix("a", Tier.DEVICE, Tier.DEVICE),
        "b": prefix("b", Tier.DISK, Tier.DISK, Tier.DISK),
        "c": prefix("c", Tier.HOST, Tier.DEVICE, Tier.HOST),
        "d": prefix("d", Tier.DEVICE, Tier.HOST, Tier.HOST),
    }
    addresses = {"a": "tcp://a:1", "b": "tcp://b:1", "c": "tcp://c:1", "d": "tcp://d:1"}
    assert choose_holder(prefixes, addresses) == HolderChoice("c", "tcp://c:1", 3)  # c and d tie: lower id
    assert choose_holder(prefixes, addresses, exclude="tcp://c:1") == HolderChoice("d", "tcp://d:1", 3)
    assert choose_holder(prefixes, {**addresses, "c": "", "d": ""}) == HolderChoice("b", "tcp://b:1", 3)
    assert choose_holder(prefixes, {"a": "tcp://a:1"}) == HolderChoice("a", "tcp://a:1", 2)
    assert choose_holder({}, addresses) is None
    assert choose_holder(prefixes, {}) is None


class StoresIndex:
    """The index's two queries answered from live stores, as Redis would after publishing."""

    def __init__(self, workers: Mapping[str, tuple[str, KVStore]]) -> None:
        self.workers = workers

    def lookup_detailed(self, pages: Sequence[PageHash]) -> dict[str, WorkerPrefix]:
        found = {w: store.lookup(pages) for w, (_address, store) in self.workers.items()}
        return {w: WorkerPrefix(w, r.prefix_pages, r.tiers) for w, r in found.items() if r.prefix_pages}

    def alive_workers(self) -> dict[str, str]:
        return {w: address for w, (address, _store) in self.workers.items()}


def test_pull_missing_completes_the_local_run_from_the_best_holder(
    make_store: StoreFactory, make_peer: PeerFactory, tmp_path: Path
) -> None:
    short, long = make_peer(), make_peer()
    short_store = make_store(device=8, host=None, disk=None, layout=BIG)
    for seed in range(3):
        short_store.put(KEYS[seed], make_page(BIG, seed))
    KVPageServer(short_store, short.server)
    long_store = holder_store(make_store, tmp_path, BIG, KEYS[:5])
    KVPageServer(long_store, long.server)
    puller = make_peer()
    local = make_store(device=8, host=None, disk=None, layout=BIG)
    for seed in range(2):
        local.put(KEYS[seed], make_page(BIG, seed))
    index = StoresIndex({"short": (short.address, short_store), "long": (long.address, long_store)})

    result = pull_missing(local, puller, index, KEYS, TIMEOUT_S)

    assert (result.worker_id, result.holder, result.local_pages) == ("long", long.address, 2)
    assert result.pages == tuple(KEYS[2:5])
    assert_holds_written_pages(local, KEYS[:5], BIG)
    assert local.metrics()["pull.pages"] == 3

    again = pull_missing(local, puller, index, KEYS, TIMEOUT_S)  # nobody holds page 5
    assert (again.pages, again.holder, again.worker_id, again.local_pages) == ((), None, None, 5)
    done = pull_missing(local, puller, index, KEYS[:5], TIMEOUT_S)
    assert (done.pages, done.holder, done.local_pages) == ((), None, 5)


def wait_for(ready: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("plane", [None, BulkMode.CLEAR, BulkMode.MAC], ids=["plaintext", "bulk", "bulk-mac"])
def test_pages_freed_and_evicted_mid_send_reach_the_puller_as_written(
    make_store: StoreFactory, tmp_path: Path, plane: BulkMode | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TCP puller gets the pages straight from the holder's slots (lent, no copy there). Asked
    one page a chunk, one chunk at a time, the rest are still to be sent when the first arrives;
    then the holder's compute frees every one of them and writes twice its capacity of other
    pages. What the puller stores is still, byte for byte, what was written: no write lands in
    a lent slot until the holder has sent it and the puller released the ref."""
    layout = KVLayout(page_size=16, num_layers=6, num_kv_heads=2, head_dim=64, dtype="bfloat16")  # 48 KiB pages
    keys = make_keys(6, page_size=16)
    others = make_keys(16, page_size=16, start=90_000)
    plane_keys = None if plane is None else PlaneKeys.generate().with_bulk(plane)
    one_by_one = ClientConfig(chunk_bytes=layout.page_nbytes, window=1)
    with Peer.start(PeerConfig(keys=plane_keys)) as holder, \
            Peer.start(PeerConfig(keys=plane_keys, client=one_by_one)) as puller:
        served = make_store(device=8, host=None, disk=None, layout=layout)
        for seed, key in enumerate(keys):
            served.put(key, make_page(layout, seed))
        KVPageServer(served, holder.server)
        local = make_store(device=8, host=None, disk=None, layout=layout)
        put = local.put
        meddled: list[dict[PageHash, Tier]] = []

        def meddle_then_put(page: PageHash, data: torch.Tensor) -> None:
            if not meddled:
                assert served.metrics()["device.lent_pages"] == 6  # served in place
                for key in keys:
                    served.remove(key)
                for seed, key in enumerate(others):
                    served.put(key, make_page(layout, 100 + seed))
                meddled.append(served.resident_pages())
            put(page, data)

        monkeypatch.setattr(local, "put", meddle_then_put)

        result = fetch_pages(local, puller, holder.address, keys, TIMEOUT_S, transport=Transport.TCP)

        assert result.pages == tuple(keys) and result.transports == (Transport.TCP,)
        assert_holds_written_pages(local, keys, layout)
        # the six lent slots stayed out of use: the other pages turned over in the two left
        assert meddled == [{others[-2]: Tier.DEVICE, others[-1]: Tier.DEVICE}]
        assert released_at_holder(puller, holder) == 0
        wait_for(lambda: served.metrics()["device.lent_pages"] == 0, "the holder to get its pages back")
        for seed, key in enumerate(others[:8]):  # every slot is free for use again
            served.put(key, make_page(layout, 200 + seed))
        assert set(served.resident_pages()) == set(others[:8])


@pytest.mark.parametrize(("device", "requests"), [(8, 2), (1, 3)], ids=["lent", "copied"])
def test_a_holder_that_lends_its_pages_is_asked_for_the_rest_of_the_run_at_once(
    make_store: StoreFactory, make_peer: PeerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    device: int, requests: int
) -> None:
    """Requests of two 48 KiB pages while the holder copies what it serves (pages on its disk);
    once it has lent one request's pages from its slots, the next asks for all the rest."""
    layout = KVLayout(page_size=16, num_layers=6, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    monkeypatch.setattr("engine.data.kv.pull.FIRST_BATCH_BYTES", 2 * layout.page_nbytes)
    monkeypatch.setattr("engine.data.kv.pull.BATCH_BYTES", 2 * layout.page_nbytes)
    keys = make_keys(6, page_size=16)
    holder = make_peer()
    served = make_store(device=device, host=None, disk=8 if device == 1 else None, layout=layout,
                        disk_dir=tmp_path / "holder")
    for seed, key in enumerate(keys[::-1]):  # the last page put is the first asked: all on the disk but it
        served.put(key, make_page(layout, 5 - seed))
    KVPageServer(served, holder.server)
    puller = make_peer(ClientConfig(chunk_bytes=layout.page_nbytes, window=2))
    local = make_store(device=8, host=None, disk=None, layout=layout)

    result = fetch_pages(local, puller, holder.address, keys, TIMEOUT_S, transport=Transport.TCP)

    assert result.pages == tuple(keys) and result.transports == (Transport.TCP,) * requests
    assert_holds_written_pages(local, keys, layout)
    assert released_at_holder(puller, holder) == 0


def test_pages_lent_to_a_puller_that_stops_reading_come_back_once_its_connection_is_dropped(
    make_store: StoreFactory
) -> None:
    """A puller that stops reading mid-send (or whose host vanished) acknowledges nothing more:
    the holder drops its connection after `peer_timeout_s`, with the chunks still queued for it,
    so the lent pages come back (their lease alone could not free them while a send reads them)."""
    layout = KVLayout(page_size=64, num_layers=16, num_kv_heads=8, head_dim=128, dtype="float16")  # 4 MiB pages
    keys = make_keys(12, page_size=64)
    config = PeerConfig(server=ServerConfig(peer_timeout_s=0.5))
    with Peer.start(config) as holder, zmq.Context() as context:
        served = make_store(device=12, host=None, disk=None, layout=layout)
        for seed, key in enumerate(keys):
            served.put(key, make_page(layout, seed))
        KVPageServer(served, holder.server, lease_s=0.5)
        vanished = context.socket(zmq.DEALER)  # a puller that reads one reply and then nothing
        vanished.setsockopt(zmq.LINGER, 0)
        vanished.setsockopt(zmq.RCVHWM, 1)
        vanished.setsockopt(zmq.RCVBUF, 64 * KiB)
        vanished.connect(holder.address)
        codec = WireCodec(1 << 20)
        vanished.send(codec.encode(HelloRequest(PROTOCOL_VERSION, "vanished", "elsewhere")))
        assert isinstance(codec.decode(vanished.recv()), HelloReply)
        vanished.send(codec.encode(KVFetchRequest(1, tuple(keys), layout.fingerprint(), tcp=True)))
        reply = codec.decode(vanished.recv())
        assert isinstance(reply, KVFetchReply) and reply.lent and reply.ref is not None
        chunk = 8 << 20
        for n, offset in enumerate(range(0, reply.ref.nbytes, chunk)):
            vanished.send(codec.encode(ChunkRequest(2 + n, reply.ref.id, offset, chunk)))
        assert served.metrics()["device.lent_pages"] == 12

        wait_for(lambda: served.metrics()["device.lent_pages"] == 0, "the lent pages to come back")
        vanished.close(linger=0)
