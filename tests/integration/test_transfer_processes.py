"""Transfers between real processes: bit-exact on every transport with pickle forbidden on
both sides, SIGKILLed consumers and producers leave no segments behind, and a dead owner is
an error within the timeout.

The child processes are this very file run as a script (`python <this file> ROLE ...`); they
talk to the test over stdin/stdout in JSON lines, and over the wire to each other.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

# Imports of engine.* stay below the child's pickle guard (see __main__).
THIS_FILE = Path(__file__).resolve()
REPO_ROOT = THIS_FILE.parents[2]
READY_TIMEOUT_S = 30.0


def make_value(kind: str, seed: int) -> np.ndarray:
    """The bytes both sides agree on, computed independently in each process."""
    rng = np.random.default_rng(seed)
    if kind == "float32_4MiB":
        return rng.standard_normal(1 << 20).astype(np.float32)
    if kind == "int16_odd":
        return rng.integers(-(1 << 15), 1 << 15, size=(3, 77_777), dtype=np.int16)
    if kind == "uint8_small":
        return rng.integers(0, 255, size=1000, dtype=np.uint8)
    if kind == "empty":
        return np.zeros((0, 5), np.float64)
    raise ValueError(kind)


KINDS = ["float32_4MiB", "int16_odd", "uint8_small", "empty"]


PICKLE_ENTRY_POINTS = ("dumps", "loads", "dump", "load", "Pickler", "Unpickler")


def forbid_pickle_stub(*args: object, **kwargs: object) -> None:
    raise AssertionError("pickle used on the wire path")


def forbid_pickle() -> None:
    for name in PICKLE_ENTRY_POINTS:
        setattr(pickle, name, forbid_pickle_stub)


# --- child processes -------------------------------------------------------------------------------


def _emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _producer_main(lease_s: float, pool_idle_s: float, sweep_s: float) -> None:
    from engine.data.peer import Peer, PeerConfig, ServerConfig
    from engine.data.tensor_store import StoreConfig

    config = PeerConfig(
        server=ServerConfig(sweep_interval_s=sweep_s),
        store=StoreConfig(default_lease_s=lease_s, pool_idle_s=pool_idle_s),
    )
    with Peer.start(config) as peer:
        # Count the server's sweeps (its thread calls the store's `sweep`), so the test can wait
        # for the next one: leases expire and pooled segments go only there.
        swept = threading.Condition()
        sweeps = 0
        sweep = peer.store.sweep

        def counted_sweep(now: float | None = None) -> list:
            nonlocal sweeps
            try:
                return sweep(now)
            finally:
                with swept:
                    sweeps += 1
                    swept.notify_all()

        peer.store.sweep = counted_sweep  # type: ignore[method-assign]
        _emit({"address": peer.address, "pid": os.getpid()})
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "next_sweep":
                with swept:
                    target = sweeps + 1
                    arrived = swept.wait_for(lambda target=target: sweeps >= target, 5.0)
                _emit({"swept": arrived})
            elif command["op"] == "put":
                ref = peer.put(make_value(command["kind"], command["seed"]))
                _emit({"ref": msgspec.to_builtins(ref)})
            elif command["op"] == "put_many":
                n, elements = command["n"], command["elements"]
                refs = [peer.put(np.arange(elements, dtype=np.float32) + i) for i in range(n)]
                _emit({"refs": msgspec.to_builtins(refs)})


def _consumer_main() -> None:
    from engine.data.peer import ZmqClient
    from engine.data.wire import TensorRef, Transport

    job = json.loads(sys.stdin.readline())
    refs = msgspec.convert(job["refs"], list[TensorRef])
    if job["ask"]:  # no location: every pull is a request to the owner, answered with the segment
        refs = [msgspec.structs.replace(ref, shm=None) for ref in refs]
    first = job["first"]
    held = []  # keep the last views mapped, as a consumer working on its inputs would
    with ZmqClient() as client:
        _emit({"ready": True})
        done = 0
        while True:
            for i, ref in enumerate(refs):
                data = client.fetch(ref, (Transport.SHM,), 10.0)
                values = data.numpy()
                expected_first, expected_last = first + i, first + i + len(values) - 1
                if data.transport is not Transport.SHM or (values[0], values[-1]) != (expected_first, expected_last):
                    _emit({"error": f"bad transfer of {ref.id}"})
                    return
                held = [*held[-7:], values]
                done += 1
                _emit({"done": done})


# --- the test side ----------------------------------------------------------------------------------


class Child:
    def __init__(self, *args: str, forbid: bool = True) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMNIFLOW_TEST_FORBID_PICKLE="1" if forbid else "0")
        self.proc = subprocess.Popen(
            [sys.executable, str(THIS_FILE), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            cwd=REPO_ROOT,
            env=env,
        )
        self._buffer = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, obj: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = READY_TIMEOUT_S) -> Any:
        """The next JSON line, waiting at most `timeout`."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while "\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"child {self.pid} said nothing within {timeout}s")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 1 << 20).decode()
                if not chunk:
                    raise EOFError(f"child {self.pid} exited with {self.proc.wait()}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split("\n", 1)
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
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_producer(lease_s: float = 60.0, pool_idle_s: float = 10.0, sweep_s: float = 0.05) -> tuple[Child, str]:
    child = Child("producer", str(lease_s), str(pool_idle_s), str(sweep_s))
    hello = child.recv()
    return child, hello["address"]


def segments_of(pid: int) -> list[str]:
    from engine.data.shm import list_segments

    return list_segments(pid=pid)


def test_every_transport_is_bit_exact_between_processes_without_pickle(monkeypatch: Any) -> None:
    import asyncio

    from engine.data.codec import MiB
    from engine.data.peer import ClientConfig, ZmqClient
    from engine.data.wire import TensorRef, Transport

    producer, address = start_producer()
    try:
        for name in PICKLE_ENTRY_POINTS:
            monkeypatch.setattr(pickle, name, forbid_pickle_stub)
        with ZmqClient(ClientConfig(chunk_bytes=1 * MiB, window=2)) as client:
            for seed, kind in enumerate(KINDS):
                producer.send({"op": "put", "kind": kind, "seed": seed})
                ref = msgspec.convert(producer.recv()["ref"], TensorRef)
                expected = make_value(kind, seed)
                small = ref.nbytes <= 64 * 1024
                asked = msgspec.structs.replace(ref, shm=None)  # no location: the owner hands it out
                for target, transports, want in [
                    (ref, (Transport.SHM, Transport.INLINE), Transport.SHM),
                    (asked, (Transport.SHM, Transport.INLINE), Transport.SHM),
                    (ref, (Transport.TCP, Transport.INLINE), Transport.TCP),
                ]:
                    data = client.fetch(target, transports, 10.0)
                    assert data.transport is (Transport.INLINE if small else want), (kind, data.transport)
                    got = data.numpy()
                    assert got.dtype == expected.dtype and got.shape == expected.shape
                    assert got.tobytes() == expected.tobytes()
                carried = asyncio.run(client.pull(ref, (Transport.TCP, Transport.INLINE), 10.0).wait_async())
                assert carried.numpy().tobytes() == expected.tobytes()
    finally:
        producer.stop()


def test_killed_consumers_leave_no_more_segments_than_live_refs() -> None:
    from engine.data.peer import ZmqClient
    from engine.data.wire import LeaseRequest, ReleaseRequest, StatsReply, StatsRequest, TensorRef

    n_refs, n_consumers, elements = 1000, 4, 32 * 1024  # 128 KiB each: shared memory, not inline
    producer, address = start_producer(pool_idle_s=0.2, sweep_s=0.02)
    consumers: list[Child] = []
    try:
        producer.send({"op": "put_many", "n": n_refs, "elements": elements})
        refs = msgspec.convert(producer.recv()["refs"], list[TensorRef])
        assert len(segments_of(producer.pid)) == n_refs

        share = n_refs // n_consumers
        for c in range(n_consumers):
            consumer = Child("consumer")
            consumers.append(consumer)
            mine = refs[c * share : (c + 1) * share]
            consumer.send({"refs": msgspec.to_builtins(mine), "first": c * share, "ask": c % 2 == 1})
        for consumer in consumers:
            assert consumer.recv() == {"ready": True}
        transfers = 0
        for consumer in consumers:
            # Each consumer loops over its refs; kill it once it has pulled each of them, mid-loop.
            while True:
                progress = consumer.recv()
                assert "error" not in progress, progress
                if progress["done"] >= share:
                    break
            consumer.kill()
            transfers += share
        assert transfers >= 1000
        for consumer in consumers:
            assert segments_of(consumer.pid) == []  # consumers never own segments

        with ZmqClient() as client:

            def stats() -> StatsReply:
                reply = client.request(address, StatsRequest, 5.0)
                assert isinstance(reply, StatsReply)
                return reply

            # Half the refs are released explicitly, the other half left to a short lease.
            for ref in refs[: n_refs // 2]:
                client.request(address, lambda rid, ref=ref: ReleaseRequest(rid, ref.id), 5.0)
            for ref in refs[n_refs // 2 :]:
                client.request(address, lambda rid, ref=ref: LeaseRequest(rid, ref.id, 0.2), 5.0)
            deadline = time.monotonic() + 15.0
            while True:
                before = stats()
                on_disk = len(segments_of(producer.pid))
                after = stats()
                # Never more segments than live refs plus the bounded pool of recycled ones.
                assert on_disk <= max(before.segments, after.segments)
                assert after.pooled_bytes <= 512 << 20
                if after.live_refs == 0 and on_disk == 0:
                    break
                assert time.monotonic() < deadline, (after, on_disk)
                # Nothing changes before the producer's next sweep (leases expire and pooled
                # segments go only there): wait for it rather than a fixed interval.
                producer.send({"op": "next_sweep"})
                producer.recv()
            assert len(segments_of(producer.pid)) <= stats().live_refs == 0
    finally:
        for consumer in consumers:
            consumer.stop()
        producer.stop()


def test_killed_producer_is_an_error_within_the_timeout_and_its_segments_are_reclaimed() -> None:
    from engine.data.channel import PeerUnavailable, TransferTimeout
    from engine.data.peer import ZmqClient
    from engine.data.tensor_store import TensorStore
    from engine.data.wire import TensorRef, Transport

    producer, _address = start_producer()
    try:
        refs = []
        for seed in range(5):
            producer.send({"op": "put", "kind": "float32_4MiB", "seed": seed})
            refs.append(msgspec.convert(producer.recv()["ref"], TensorRef))
        assert len(segments_of(producer.pid)) == 5
        with ZmqClient() as client:
            assert client.fetch(refs[0], (Transport.SHM,), 5.0).numpy().tobytes() == make_value(
                "float32_4MiB", 0
            ).tobytes()
            producer.kill()
            for transports in [(Transport.SHM,), (Transport.TCP,)]:
                start = time.monotonic()
                try:
                    client.fetch(refs[1], transports, 0.5)
                    raise AssertionError("a dead owner served a pull")
                except (PeerUnavailable, TransferTimeout):
                    pass
                assert time.monotonic() - start < 1.0
            start = time.monotonic()
            transfer = client.pull(refs[2], (Transport.TCP,), 0.5)
            try:
                transfer.wait()
                raise AssertionError("a dead owner served a pull")
            except (PeerUnavailable, TransferTimeout):
                pass
            assert time.monotonic() - start < 1.5
        # The dead producer's segments outlive it until any later store on this host starts
        # (another process on this host may have been first: hence no count here).
        TensorStore("tcp://127.0.0.1:1").close()
        assert segments_of(producer.pid) == []
    finally:
        producer.stop()


if __name__ == "__main__":
    if os.environ.get("OMNIFLOW_TEST_FORBID_PICKLE") == "1":
        forbid_pickle()
    role = sys.argv[1]
    if role == "producer":
        _producer_main(float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
    elif role == "consumer":
        _consumer_main()
    else:
        raise SystemExit(f"unknown role {role}")
