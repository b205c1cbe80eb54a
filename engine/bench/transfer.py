"""Tensor hand-off between two processes on one host, against memcpy and bare ZeroMQ.

A producer process keeps a float32 tensor (`--size-mib`, default 64 MiB) in its tensor store
and serves it; this process consumes it. Every repetition is a new tensor: the producer
writes fresh contents (reusing a pooled segment once warm, as a steady stream of outputs
does), hands out a new ref, and the consumer pulls it. Warm-up repetitions come first; the
figures are medians, in GB/s = bytes / seconds / 1e9.

* `memcpy_gbps`: single-thread `np.copyto` of the same size between two warm buffers in this
  process, measured alternately with the shared-memory hand-off (same destination buffer).
* `shm_gbps`: the same-host hand-off, timed in the consumer from `fetch(ref)` until the
  tensor has been read once, by copying it out of the mapped segment into a warm buffer.
  The ref names the owner's segment: the consumer checks the owner is alive and that the
  segment's generation word still names this ref (then no round trip is needed), reuses its
  read-only mapping of the segment, and makes one pass over the bytes.
  Goal: >= 0.8 x memcpy_gbps. Beside it, for context: `shm_asked_gbps`, the same with a ref
  that carries no location, so the consumer asks the owner (one request round trip);
  `shm_cold_gbps`, the very first hand-off (a segment the producer just created, mapped
  for the first time); `shm_put_gbps`, the producer's write of a tensor into its store.
* `zmq_gbps`: our `ZmqChannel` over TCP loopback, from the pull request until the whole
  tensor sits in the consumer's memory (chunked frames, credit window).
* `raw_zmq_gbps`: bare pyzmq, same run, same sockets kind: a DEALER asks a ROUTER, which
  answers with the whole array as one `copy=False` frame, received with `copy=False`.
  Goal: `zmq_gbps` >= 0.9 x `raw_zmq_gbps`. The two are measured alternately, repetition by
  repetition, so that drift on a small machine hits both alike.

`--across-nodes` measures between two nodes instead (`engine.bench.hosts`: a tensor and a KV
page run between two network namespaces against raw ZeroMQ between the same two).

Producer processes serve on the authenticated worker plane (CURVE keys, what workers use;
`engine.data.curve`), one per `BulkMode`, and one on the plaintext plane, all measured in the
same run. The shared-memory figures above are the authenticated plane's; beside them:

* `shm_asked_plain_gbps` and `auth_vs_plain` (goal >= 0.9): the asked same-host hand-off on
  the plaintext plane, and the authenticated one over it. On one host the bytes never touch
  the socket (it carries the request and the header: CURVE encrypts those few hundred bytes).
* `auth_zmq_gbps` and `tcp_auth_vs_plain` (goal >= 0.9): `ZmqChannel` over TCP on the
  authenticated plane as deployed (`clear`: the request and its one-time grant inside CURVE,
  the bytes over the owner's bulk channel, `engine.data.bulk`), and over the plaintext
  `zmq_gbps`, measured in the same alternation.
* `mac_zmq_gbps` and `tcp_mac_vs_plain`: the same with every chunk MAC'd (`mac`: what the
  receiver's check of each chunk's Poly1305 tag costs).
* `curve_zmq_gbps` and `tcp_encrypted_vs_plain`: every byte inside CURVE (`encrypted`, for
  networks where others can read the wire).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import zmq

from engine.data.codec import MiB
from engine.data.curve import BulkMode, PlaneKeys
from engine.data.peer import ClientConfig, Peer, PeerConfig, ZmqClient
from engine.data.tensor_store import StoreConfig
from engine.data.wire import ReleaseRequest, TensorRef, Transport

READY_TIMEOUT_S = 30.0
PULL_TIMEOUT_S = 30.0
GOAL_AUTH_RATIO = 0.9
"""Bandwidth on the authenticated plane over the plaintext one."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mib", type=int, default=64, help="tensor size (float32)")
    parser.add_argument("--repeats", type=int, default=15, help="timed repetitions per figure")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repetitions first")
    parser.add_argument("--chunk-mib", type=int, default=ClientConfig().chunk_bytes // MiB)
    parser.add_argument("--window", type=int, default=ClientConfig().window)
    parser.add_argument("--across-nodes", action="store_true",
                        help="between two nodes (network namespaces, needs root) instead: `omniflow bench hosts`")
    parser.add_argument("--kv-pages", type=int, default=32, help="--across-nodes: pages in the KV run")


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


class Producer:
    """The producer process (`python -m MODULE --producer SIZE_MIB`), driven line by line over
    its stdin/stdout: it first prints a JSON hello, then answers each `put N` with the JSON
    `{"ref": ..., "seconds": ...}` of a fresh tensor."""

    def __init__(self, size_mib: int, keys_dir: str | None = None, module: str = "engine.bench.transfer") -> None:
        """`keys_dir`: serve on the authenticated plane with these keys (None: plaintext)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--producer", str(size_mib), *([keys_dir] if keys_dir else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.hello: dict[str, str] = json.loads(self._read())

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the producer process exited with {self.proc.wait(timeout=READY_TIMEOUT_S)}")
        return line

    def put(self, value: int) -> tuple[TensorRef, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"put {value}\n")
        answer = json.loads(self._read())
        return msgspec.convert(answer["ref"], TensorRef), answer["seconds"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _producer_main(size_mib: int, keys_dir: str | None) -> None:
    nbytes = size_mib * MiB
    base = np.arange(nbytes // 4, dtype=np.float32)
    keys = None if keys_dir is None else PlaneKeys.load(keys_dir)
    peer = Peer.start(PeerConfig(store=StoreConfig(pool_bytes=4 * nbytes, default_lease_s=120.0), keys=keys))
    context = zmq.Context()
    raw = context.socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
    raw_payload = base.copy()
    print(json.dumps({"address": peer.address, "raw": f"tcp://127.0.0.1:{raw_port}"}), flush=True)
    poller = zmq.Poller()
    poller.register(raw, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    try:
        while True:
            for item, _ in poller.poll():
                if item is raw:
                    identity, _go = raw.recv_multipart()
                    raw.send_multipart([identity, raw_payload], copy=False)
                    continue
                line = sys.stdin.readline()
                if not line:
                    return
                value = int(line.split()[1])
                start = time.perf_counter()
                reservation = peer.store.reserve(base.shape, "float32")
                np.copyto(reservation.array, base)
                reservation.array[0] = value
                ref = peer.store.commit(reservation)
                seconds = time.perf_counter() - start
                print(json.dumps({"ref": msgspec.to_builtins(ref), "seconds": seconds}), flush=True)
    finally:
        raw.close(linger=0)
        context.term()
        peer.close()


class _Consumer:
    """This process's side of a run: a producer process and a client on each plane, a bare
    DEALER to the plaintext producer's raw ROUTER, and the source and warm destination buffers
    of `size_mib`. A context manager: everything it started stops on exit."""

    def __init__(self, size_mib: int, chunk_mib: int, window: int) -> None:
        self.nbytes = size_mib * MiB
        with contextlib.ExitStack() as stack:
            # Unwound in reverse: the raw socket, the clients, the producers, then the keys.
            keys_home = stack.enter_context(tempfile.TemporaryDirectory(prefix="omniflow-bench-transfer-"))
            keys = PlaneKeys.generate()
            planes: dict[str, PlaneKeys | None] = {"auth": keys, "mac": keys.with_bulk(BulkMode.MAC),
                                                   "curve": keys.with_bulk(BulkMode.ENCRYPTED), "plain": None}
            self.producers: dict[str, Producer] = {}
            for plane, k in planes.items():
                keys_dir = None if k is None else str(k.write(Path(keys_home) / plane))
                self.producers[plane] = Producer(size_mib, keys_dir)
                stack.callback(self.producers[plane].close)
            config = ClientConfig(chunk_bytes=chunk_mib * MiB, window=window)
            self.clients: dict[str, ZmqClient] = {}
            for plane, k in planes.items():
                self.clients[plane] = ZmqClient(config, keys=k)
                stack.callback(self.clients[plane].close)
            context = zmq.Context()
            stack.callback(context.term)
            self.raw = context.socket(zmq.DEALER)
            stack.callback(self.raw.close, linger=0)
            self.raw.setsockopt(zmq.LINGER, 0)
            self.raw.connect(self.producers["plain"].hello["raw"])
            self._close = stack.pop_all().close
        self.source = np.arange(self.nbytes // 4, dtype=np.float32)
        self.sink = np.empty(self.nbytes // 4, dtype=np.float32)
        self.sink[:] = 0  # warm: the consumer's destination is faulted in before timing

    def __enter__(self) -> _Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def release(self, ref: TensorRef, plane: str = "auth") -> None:
        self.clients[plane].request(ref.owner, lambda rid: ReleaseRequest(rid, ref.id), PULL_TIMEOUT_S)


@dataclass(slots=True)
class _HandOffTimes:
    """Seconds per timed repetition of the same-host hand-off and the memcpy beside it."""

    memcpy: list[float] = field(default_factory=list)
    shm: list[float] = field(default_factory=list)
    put: list[float] = field(default_factory=list)
    cold_gbps: float = 0.0


def _time_handoff(consumer: _Consumer, warmup: int, repeats: int) -> _HandOffTimes:
    """memcpy and the authenticated plane's shared-memory hand-off (a ref with its location),
    alternately into the same buffer, so drift hits both."""
    nbytes, sink, times = consumer.nbytes, consumer.sink, _HandOffTimes()
    producer, client = consumer.producers["auth"], consumer.clients["auth"]
    for i in range(warmup + repeats):
        start = time.perf_counter()
        np.copyto(sink, consumer.source)
        copy_seconds = time.perf_counter() - start
        ref, put_seconds = producer.put(i)
        start = time.perf_counter()
        data = client.fetch(ref, (Transport.SHM,), PULL_TIMEOUT_S)
        np.copyto(sink, data.numpy())
        elapsed = time.perf_counter() - start
        if sink[0] != i or sink[-1] != nbytes // 4 - 1 or data.transport is not Transport.SHM:
            raise RuntimeError("shared-memory hand-off returned the wrong bytes")
        del data
        consumer.release(ref)
        if i == 0:
            times.cold_gbps = nbytes / elapsed / 1e9
        if i >= warmup:
            times.shm.append(elapsed)
            times.put.append(put_seconds)
            times.memcpy.append(copy_seconds)
    return times


def _time_asked(consumer: _Consumer, warmup: int, repeats: int) -> dict[str, list[float]]:
    """The asked hand-off (a ref without its location: one round trip to the owner), on the
    authenticated and the plaintext plane in alternating order: seconds by plane."""
    sink = consumer.sink
    times: dict[str, list[float]] = {"auth": [], "plain": []}
    for i in range(warmup + repeats):
        for plane in ("auth", "plain") if i % 2 == 0 else ("plain", "auth"):
            ref, _ = consumer.producers[plane].put(i)
            start = time.perf_counter()
            data = consumer.clients[plane].fetch(msgspec.structs.replace(ref, shm=None), (Transport.SHM,),
                                                 PULL_TIMEOUT_S)
            np.copyto(sink, data.numpy())
            elapsed = time.perf_counter() - start
            if sink[0] != i or data.transport is not Transport.SHM:
                raise RuntimeError("shared-memory hand-off returned the wrong bytes")
            del data
            consumer.release(ref, plane)
            if i >= warmup:
                times[plane].append(elapsed)
    return times


def _time_tcp(consumer: _Consumer, warmup: int, repeats: int) -> dict[str, list[float]]:
    """`ZmqChannel` over TCP on every plane and bare pyzmq (`raw`), in rotating order: seconds by kind."""
    nbytes = consumer.nbytes
    times: dict[str, list[float]] = {kind: [] for kind in ("plain", "raw", "auth", "mac", "curve")}
    kinds = tuple(times)
    for i in range(warmup + repeats):
        refs = {kind: consumer.producers[kind].put(i)[0] for kind in kinds if kind != "raw"}
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            start = time.perf_counter()
            if kind != "raw":
                data = consumer.clients[kind].fetch(refs[kind], (Transport.TCP,), PULL_TIMEOUT_S)
                array = data.numpy()
            else:
                consumer.raw.send(b"go")
                frame = consumer.raw.recv(copy=False)
                array = np.frombuffer(frame.buffer, np.float32)
            elapsed = time.perf_counter() - start
            if array[-1] != nbytes // 4 - 1 or (kind != "raw" and array[0] != i):
                raise RuntimeError(f"{kind} transfer returned the wrong bytes")
            if i >= warmup:
                times[kind].append(elapsed)
        for kind, ref in refs.items():
            consumer.release(ref, kind)
    return times


def _figures(size_mib: int, handoff: _HandOffTimes, asked: dict[str, list[float]],
             tcp_times: dict[str, list[float]]) -> dict[str, float]:
    nbytes = size_mib * MiB
    memcpy = gbps(nbytes, handoff.memcpy)
    shm = gbps(nbytes, handoff.shm)
    tcp = {kind: gbps(nbytes, times) for kind, times in tcp_times.items()}
    ours, bare = tcp["plain"], tcp["raw"]
    return {
        "size_mib": float(size_mib),
        "memcpy_gbps": memcpy,
        "shm_gbps": shm,
        "shm_vs_memcpy": shm / memcpy,
        "shm_asked_gbps": gbps(nbytes, asked["auth"]),
        "shm_cold_gbps": handoff.cold_gbps,
        "shm_put_gbps": gbps(nbytes, handoff.put),
        "zmq_gbps": ours,
        "raw_zmq_gbps": bare,
        "zmq_vs_raw_zmq": ours / bare,
        "shm_asked_plain_gbps": gbps(nbytes, asked["plain"]),
        "auth_vs_plain": gbps(nbytes, asked["auth"]) / gbps(nbytes, asked["plain"]),
        "auth_zmq_gbps": tcp["auth"],
        "tcp_auth_vs_plain": tcp["auth"] / ours,
        "mac_zmq_gbps": tcp["mac"],
        "tcp_mac_vs_plain": tcp["mac"] / ours,
        "curve_zmq_gbps": tcp["curve"],
        "tcp_encrypted_vs_plain": tcp["curve"] / ours,
        "goal_auth_vs_plain": GOAL_AUTH_RATIO,
    }


def run(args: argparse.Namespace) -> dict[str, float]:
    if args.across_nodes:
        from engine.bench import hosts

        return hosts.run(args)
    with _Consumer(args.size_mib, args.chunk_mib, args.window) as consumer:
        handoff = _time_handoff(consumer, args.warmup, args.repeats)
        asked = _time_asked(consumer, args.warmup, args.repeats)
        tcp = _time_tcp(consumer, args.warmup, args.repeats)
    return _figures(args.size_mib, handoff, asked, tcp)


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--producer":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _producer_main(int(sys.argv[2]), sys.argv[3] if len(sys.argv) == 4 else None)
    else:
        parser = argparse.ArgumentParser(description=__doc__)
        add_arguments(parser)
        print(json.dumps(run(parser.parse_args())))
