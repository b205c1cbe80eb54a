"""Channels in one process (real sockets, real shared memory): every transport bit-exact,
transfer states, timeouts against silent peers, and a server that survives bad frames."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest
import torch
import zmq

from engine.data.channel import (
    InProcessChannel,
    PeerUnavailable,
    RefGone,
    SharedMemoryChannel,
    TransferState,
    TransferTimeout,
    TransportUnavailable,
    ZmqChannel,
    pull_async,
)
from engine.data.codec import KiB, Limits, WireCodec
from engine.data.peer import ClientConfig, Peer, PeerConfig, ServerConfig, ZmqClient
from engine.data.shm import SegmentGone
from engine.data.tensor_store import StoreConfig
from engine.data.wire import (
    PROTOCOL_VERSION,
    ChunkRequest,
    ErrorCode,
    ErrorReply,
    HelloReply,
    HelloRequest,
    PingReply,
    PingRequest,
    PullRequest,
    RefId,
    StatsReply,
    TensorRef,
    Transport,
)

SMALL_CHUNKS = ClientConfig(chunk_bytes=64 * KiB, window=3)


@pytest.fixture
def producer() -> Iterator[Peer]:
    peer = Peer.start(PeerConfig(server=ServerConfig(sweep_interval_s=0.05)))
    yield peer
    peer.close()


@pytest.fixture
def consumer() -> Iterator[Peer]:
    peer = Peer.start(PeerConfig(client=SMALL_CHUNKS))
    yield peer
    peer.close()


def payloads() -> dict[str, np.ndarray | torch.Tensor]:
    rng = np.random.default_rng(11)
    return {
        "float32_1MiB": rng.standard_normal(256 * 1024).astype(np.float32),
        "int8_odd": rng.integers(-128, 127, size=(7, 33_333), dtype=np.int8),  # chunks + a remainder
        "bf16_torch": torch.randn(64, 1000, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16),
        "small_inline": np.arange(10, dtype=np.float64),
        "empty": np.zeros((0, 3), np.float32),
    }


def raw_bytes(value: np.ndarray | torch.Tensor) -> bytes:
    if isinstance(value, torch.Tensor):
        return value.contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(value).tobytes()


def test_in_process_channel_hands_out_a_read_only_view(producer: Peer) -> None:
    array = np.arange(100_000, dtype=np.float32)
    ref = producer.put(array)
    data = InProcessChannel(producer.store).fetch(ref, timeout=1.0)
    assert data.transport is Transport.LOCAL
    view = data.numpy()
    assert np.shares_memory(view, producer.store.get(ref.id).data)
    assert view.tobytes() == array.tobytes() and not view.flags.writeable


@pytest.mark.parametrize("name", list(payloads()))
@pytest.mark.parametrize("channel_kind", ["shm", "tcp"])
def test_fetch_is_bit_exact_on_every_transport(producer: Peer, consumer: Peer, name: str, channel_kind: str) -> None:
    value = payloads()[name]
    ref = producer.put(value)
    channel = SharedMemoryChannel(consumer.client) if channel_kind == "shm" else ZmqChannel(consumer.client)
    data = channel.fetch(ref, timeout=5.0)
    expected = Transport.INLINE if ref.nbytes <= StoreConfig().inline_max_bytes else Transport(channel_kind)
    assert data.transport is expected
    assert data.bytes_view().tobytes() == raw_bytes(value)
    back = data.torch()
    assert tuple(back.shape) == tuple(value.shape)
    assert str(back.dtype).removeprefix("torch.") == ref.dtype


def test_a_sink_pull_takes_the_chunk_size_it_asks_for(producer: Peer, consumer: Peer) -> None:
    """`chunk_bytes` (a KV pull's small chunks) overrides the client's 64 KiB chunks: the sink gets
    the tensor in 16 KiB pieces, bit-exact, every byte over TCP."""
    value = np.arange(64 * 1024, dtype=np.float32)  # 256 KiB
    ref = producer.put(value)
    got: list[tuple[int, bytes]] = []

    data = consumer.pull_to(ref, 5.0, lambda offset, view: got.append((offset, bytes(view))), tcp=True,
                            chunk_bytes=16 * KiB)

    assert data is None
    assert sorted(offset for offset, _ in got) == list(range(0, 256 * KiB, 16 * KiB))
    assert {len(piece) for _, piece in got} == {16 * KiB}
    assert b"".join(piece for _, piece in sorted(got)) == value.tobytes()


def test_same_host_ref_is_read_in_place_without_asking_the_owner(producer: Peer, consumer: Peer) -> None:
    value = np.arange(300_000, dtype=np.float32)
    ref = producer.put(value)
    unreachable = msgspec.structs.replace(ref, owner=free_address())  # any request would fail
    for data in (consumer.pull(unreachable, timeout=1.0), consumer.start_pull(unreachable, timeout=1.0).wait()):
        assert data.transport is Transport.SHM and data.numpy().tobytes() == value.tobytes()


@pytest.mark.parametrize("mode", ["fetch", "pull"])
def test_recycled_segment_is_never_read_as_the_old_ref(producer: Peer, consumer: Peer, mode: str) -> None:
    old = producer.put(np.zeros(300_000, np.float32))
    assert consumer.pull(old, timeout=5.0).numpy()[0] == 0.0
    producer.release(old)
    new = producer.put(np.ones(300_000, np.float32))
    assert new.shm is not None and old.shm is not None and new.shm.segment == old.shm.segment
    with pytest.raises(RefGone):
        consumer.pull(old, 5.0) if mode == "fetch" else consumer.start_pull(old, 5.0).wait()
    assert consumer.pull(new, timeout=5.0).numpy()[0] == 1.0


@pytest.mark.parametrize(
    "change",
    [{"shm": None}, {"lease_expires_at": 0.0}],
    ids=["no-location", "lease-extended-at-owner"],
)
def test_owner_hands_out_the_segment_when_the_ref_cannot_be_read_in_place(
    producer: Peer, consumer: Peer, change: dict[str, object]
) -> None:
    value = np.random.default_rng(2).standard_normal(300_000).astype(np.float32)
    ref = msgspec.structs.replace(producer.put(value), **change)
    for data in (consumer.pull(ref, timeout=5.0), consumer.start_pull(ref, timeout=5.0).wait()):
        assert data.transport is Transport.SHM and data.numpy().tobytes() == value.tobytes()


def test_shared_memory_view_is_read_only_and_not_a_copy(producer: Peer, consumer: Peer) -> None:
    ref = producer.put(np.arange(1 << 20, dtype=np.int32))
    data = consumer.pull(ref, timeout=5.0)
    assert data.transport is Transport.SHM
    view = data.numpy()
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0] = 1
    assert isinstance(data.buffer, mmap.mmap)


@pytest.mark.parametrize("channel_kind", ["shm", "tcp"])
def test_pull_handle_moves_through_its_states(producer: Peer, consumer: Peer, channel_kind: str) -> None:
    value = np.random.default_rng(1).standard_normal(2 << 20).astype(np.float32)
    ref = producer.put(value)
    channel = SharedMemoryChannel(consumer.client) if channel_kind == "shm" else ZmqChannel(consumer.client)
    transfer = channel.pull(ref, timeout=10.0)
    assert transfer.poll() in (TransferState.PENDING, TransferState.TRANSFERRING, TransferState.DONE)
    data = transfer.wait()
    assert transfer.poll() is TransferState.DONE and transfer.error is None
    assert data.numpy().tobytes() == value.tobytes()


def test_failed_transfer_reports_its_typed_error(producer: Peer, consumer: Peer) -> None:
    ref = producer.put(np.ones(10))
    producer.release(ref)
    transfer = consumer.start_pull(ref, timeout=5.0)
    with pytest.raises(RefGone):
        transfer.wait()
    assert transfer.poll() is TransferState.FAILED and isinstance(transfer.error, RefGone)
    with pytest.raises(RefGone):
        consumer.pull(ref, timeout=5.0)


async def test_async_pulls_run_concurrently_and_bit_exact(producer: Peer, consumer: Peer) -> None:
    values = [np.full(50_000 + i, i, np.int32) for i in range(12)]
    refs = [producer.put(v) for v in values]
    tcp = ZmqChannel(consumer.client)
    results = await asyncio.gather(
        *(consumer.pull_async(r, timeout=10.0) if i % 2 else pull_async(tcp, r, 10.0) for i, r in enumerate(refs))
    )
    for value, data in zip(values, results, strict=True):
        assert data.numpy().tobytes() == value.tobytes()


def test_pulls_from_many_threads(producer: Peer, consumer: Peer) -> None:
    values = [np.full(100_000, i, np.float32) for i in range(8)]
    refs = [producer.put(v) for v in values]
    errors: list[BaseException] = []

    tcp = ZmqChannel(consumer.client)

    def work(i: int) -> None:
        try:
            for _ in range(5):
                data = consumer.pull(refs[i], timeout=10.0) if i % 2 else tcp.fetch(refs[i], 10.0)
                assert data.numpy()[0] == i and data.numpy()[-1] == i
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(refs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []


def test_remote_lease_release_and_stats(producer: Peer, consumer: Peer) -> None:
    ref = producer.put(np.ones(100_000, np.float32), lease_s=5.0)
    new_expiry = consumer.extend(ref, 60.0)
    assert new_expiry > ref.lease_expires_at
    stats = consumer.stats(producer.address)
    assert isinstance(stats, StatsReply) and stats.live_refs == 1 and stats.segments == 1
    assert consumer.ping(producer.address) < 1.0
    assert consumer.release(ref) is True
    assert consumer.release(ref) is False
    with pytest.raises(RefGone):
        consumer.extend(ref, 5.0)


def after_a_sweep(monkeypatch: pytest.MonkeyPatch, target: object, method: str,
                  done: Callable[[], bool]) -> threading.Event:
    """An event set once a call of `target.method`, one of the owner's periodic sweeps made by
    its serving thread, returns with `done()` true. The sweep itself is the readiness signal:
    observed by wrapping it (it still runs unchanged), not by polling the owner on a timer."""
    swept = threading.Event()
    sweep = getattr(target, method)

    def observed(*args: object, **kwargs: object) -> object:
        result = sweep(*args, **kwargs)
        if done():
            swept.set()
        return result

    monkeypatch.setattr(target, method, observed)
    return swept


def test_lease_expiry_frees_the_tensor_at_the_owner(consumer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    producer = Peer.start(PeerConfig(server=ServerConfig(sweep_interval_s=0.02),
                                     store=StoreConfig(pool_bytes=0)))
    try:
        ref = producer.put(np.ones(100_000, np.float32), lease_s=0.2)
        assert consumer.pull(ref, timeout=5.0).numpy()[0] == 1.0
        # Until the owner's store sweep has let the expired lease go (no live refs left).
        after_a_sweep(monkeypatch, producer.store, "sweep", lambda: len(producer.store) == 0).wait(5.0)
        assert consumer.stats(producer.address).segments == 0
        with pytest.raises(RefGone):
            consumer.pull(ref, timeout=5.0)
    finally:
        producer.close()


@pytest.mark.parametrize("mode", ["fetch", "pull"])
def test_owner_that_forgot_an_idle_client_is_greeted_again(consumer: Peer, mode: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    producer = Peer.start(PeerConfig(server=ServerConfig(sweep_interval_s=0.02, idle_client_s=0.2)))
    try:
        ref = msgspec.structs.replace(producer.put(np.arange(200_000, dtype=np.float32)), shm=None)
        pull = (lambda: consumer.pull(ref, 5.0)) if mode == "fetch" else (lambda: consumer.start_pull(ref, 5.0).wait())
        assert pull().numpy()[-1] == 199_999.0
        assert producer.server._clients  # the pull asked the owner: it knows the connection
        # Until the server's sweep forgets the idle connection.
        after_a_sweep(monkeypatch, producer.server, "_forget_idle", lambda: not producer.server._clients).wait(5.0)
        assert not producer.server._clients
        assert pull().numpy()[-1] == 199_999.0
        assert consumer.stats(producer.address).live_refs == 1
    finally:
        producer.close()


def test_cuda_ipc_without_cuda_is_refused_with_a_typed_error(producer: Peer, consumer: Peer) -> None:
    """Only CUDA IPC accepted, from a process without CUDA (or for a host tensor): nothing
    can carry it. (CUDA IPC itself is tested on a GPU: tests/gpu.)"""
    ref = producer.put(np.ones(10))
    with pytest.raises(TransportUnavailable):
        consumer.client.fetch(ref, (Transport.CUDA_IPC,), 1.0)
    with pytest.raises(TransportUnavailable):
        consumer.client.pull(ref, (Transport.CUDA_IPC,), 1.0).wait()


def test_unmappable_segment_falls_back_to_tcp(producer: Peer, consumer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    value = np.arange(500_000, dtype=np.int64)
    ref = producer.put(value)

    def refuse(name: str, size: int) -> None:
        raise SegmentGone(name)

    monkeypatch.setattr(consumer.client._mapper, "map", refuse)
    data = consumer.pull(ref, timeout=5.0)
    assert data.transport is Transport.TCP and data.numpy().tobytes() == value.tobytes()
    assert consumer.pull(ref, timeout=5.0).transport is Transport.TCP  # remembered per owner
    with pytest.raises(TransportUnavailable):
        consumer.client.fetch(ref, (Transport.SHM,), 5.0)


def test_other_host_never_tries_shared_memory(producer: Peer) -> None:
    ref = producer.put(np.arange(100_000, dtype=np.int32))
    with ZmqClient(host="elsewhere/boot") as client:
        with pytest.raises(TransportUnavailable):
            SharedMemoryChannel(client).fetch(ref, timeout=5.0)
        data = client.fetch(ref, (Transport.SHM, Transport.TCP), 5.0)
        assert data.transport is Transport.TCP and data.numpy()[-1] == 99_999


# --- peers that do not answer ---------------------------------------------------------------------


@contextlib.contextmanager
def fake_owner(answer_hello: bool) -> Iterator[str]:
    """A ROUTER that reads everything and answers at most the handshake."""
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    codec = WireCodec(1 << 20)

    def serve() -> None:
        while not stop.is_set():
            if not socket.poll(20):
                continue
            identity, payload = socket.recv_multipart()
            if answer_hello and isinstance(codec.decode(payload), HelloRequest):
                socket.send_multipart([identity, codec.encode(HelloReply(PROTOCOL_VERSION, "x", "h", 1 << 20, 1 << 16))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(timeout=5)
        socket.close()
        context.term()


def ref_at(address: str) -> TensorRef:
    return TensorRef(address, RefId("x.1"), "float32", (1000,), 4000, time.time() + 60, "h")


def free_address() -> str:
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    socket.close(linger=0)
    context.term()
    return f"tcp://127.0.0.1:{port}"


def assert_fails_within(call: Callable[[], object], error: type[Exception], timeout: float) -> None:
    start = time.monotonic()
    with pytest.raises(error):
        call()
    assert time.monotonic() - start < timeout + 0.5


@pytest.mark.parametrize("mode", ["fetch", "pull"])
def test_nobody_listening_fails_within_the_timeout(consumer: Peer, mode: str) -> None:
    ref = ref_at(free_address())
    if mode == "fetch":
        assert_fails_within(lambda: consumer.pull(ref, timeout=0.3), PeerUnavailable, 0.3)
    else:
        transfer = consumer.start_pull(ref, timeout=0.3)
        assert_fails_within(transfer.wait, PeerUnavailable, 0.3)
        assert transfer.poll() is TransferState.FAILED


@pytest.mark.parametrize("mode", ["fetch", "pull"])
def test_owner_that_never_answers_fails_within_the_timeout(consumer: Peer, mode: str) -> None:
    with fake_owner(answer_hello=False) as address:
        ref = ref_at(address)
        if mode == "fetch":
            assert_fails_within(lambda: consumer.pull(ref, timeout=0.3), PeerUnavailable, 0.3)
        else:
            assert_fails_within(consumer.start_pull(ref, timeout=0.3).wait, PeerUnavailable, 0.3)


@pytest.mark.parametrize("mode", ["fetch", "pull"])
def test_owner_that_stops_answering_after_the_handshake_times_out(consumer: Peer, mode: str) -> None:
    with fake_owner(answer_hello=True) as address:
        ref = ref_at(address)
        if mode == "fetch":
            assert_fails_within(lambda: consumer.pull(ref, timeout=0.3), TransferTimeout, 0.3)
        else:
            assert_fails_within(consumer.start_pull(ref, timeout=0.3).wait, TransferTimeout, 0.3)


def test_closing_the_client_fails_what_is_in_flight() -> None:
    with fake_owner(answer_hello=False) as address:
        client = ZmqClient()
        transfer = client.pull(ref_at(address), (Transport.TCP,), 30.0)
        client.close()
        assert_fails_within(transfer.wait, PeerUnavailable, 1.0)
        with pytest.raises(PeerUnavailable):
            client.fetch(ref_at(address), (Transport.TCP,), 1.0)


# --- a server that survives bad frames --------------------------------------------------------------


class RawClient:
    """A bare DEALER speaking to a TensorServer frame by frame."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.codec = WireCodec(1 << 30)

    def ask(self, *frames: bytes) -> tuple[object, list[bytes]]:
        self.socket.send_multipart(list(frames))
        if not self.socket.poll(5000):
            raise AssertionError("the server did not answer")
        reply = self.socket.recv_multipart()
        return self.codec.decode(reply[0]), reply[1:]

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def error_code(answer: tuple[object, list[bytes]]) -> ErrorCode:
    message, _ = answer
    assert isinstance(message, ErrorReply), message
    return message.code


def test_server_answers_bad_frames_with_errors_and_keeps_serving(producer: Peer, consumer: Peer) -> None:
    ref = producer.put(np.arange(100_000, dtype=np.float32))
    raw = RawClient(producer.address)
    encode = raw.codec.encode
    try:
        assert error_code(raw.ask(encode(PingRequest(1)))) is ErrorCode.HANDSHAKE_REQUIRED
        assert error_code(raw.ask(encode(HelloRequest(PROTOCOL_VERSION + 1, "raw", "h")))) is ErrorCode.VERSION_MISMATCH
        assert error_code(raw.ask(b"\xc1garbage")) is ErrorCode.MALFORMED
        hello, _ = raw.ask(encode(HelloRequest(PROTOCOL_VERSION, "raw", "h")))
        assert isinstance(hello, HelloReply)
        assert error_code(raw.ask(b"\xc1garbage")) is ErrorCode.MALFORMED
        assert error_code(raw.ask(msgspec.msgpack.encode({"type": "FormatDiskRequest", "request_id": 2}))) \
            is ErrorCode.UNKNOWN_MESSAGE
        assert error_code(raw.ask(b"\x00" * (Limits().max_request_bytes + 1))) is ErrorCode.OVERSIZED
        assert error_code(raw.ask(encode(PingRequest(3)), b"extra")) is ErrorCode.MALFORMED
        assert error_code(raw.ask(encode(PingReply(4)))) is ErrorCode.BAD_REQUEST
        assert error_code(raw.ask(encode(ChunkRequest(5, ref.id, 0, ref.nbytes + 1)))) is ErrorCode.BAD_REQUEST
        assert error_code(raw.ask(encode(ChunkRequest(6, ref.id, 0, 1 << 30)))) is ErrorCode.OVERSIZED
        assert error_code(raw.ask(encode(PullRequest(7, RefId("nope"), (Transport.TCP,))))) is ErrorCode.NOT_FOUND
        assert error_code(raw.ask(encode(PullRequest(8, ref.id, (Transport.CUDA_IPC,))))) is ErrorCode.UNSUPPORTED
        answer, frames = raw.ask(encode(ChunkRequest(9, ref.id, 4, 8)))
        assert np.frombuffer(frames[0], np.float32).tolist() == [1.0, 2.0]
        assert isinstance(raw.ask(encode(PingRequest(10)))[0], PingReply)
    finally:
        raw.close()
    assert consumer.pull(ref, timeout=5.0).numpy()[-1] == 99_999.0
