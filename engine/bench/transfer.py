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
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


def run(args: argparse.Namespace) -> dict[str, float]:
    if args.across_nodes:
        from engine.bench import hosts

        return hosts.run(args)
    nbytes = args.size_mib * MiB
    total = args.warmup + args.repeats
    keys_home = tempfile.TemporaryDirectory(prefix="omniflow-bench-transfer-")
    keys = PlaneKeys.generate()
    planes: dict[str, PlaneKeys | None] = {"auth": keys, "mac": keys.with_bulk(BulkMode.MAC),
                                           "curve": keys.with_bulk(BulkMode.ENCRYPTED), "plain": None}
    producers = {plane: Producer(args.size_mib, None if k is None else str(k.write(Path(keys_home.name) / plane)))
                 for plane, k in planes.items()}
    producer = producers["auth"]
    config = ClientConfig(chunk_bytes=args.chunk_mib * MiB, window=args.window)
    clients = {plane: ZmqClient(config, keys=k) for plane, k in planes.items()}
    client = clients["auth"]
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(producers["plain"].hello["raw"])
    source = np.arange(nbytes // 4, dtype=np.float32)
    sink = np.empty(nbytes // 4, dtype=np.float32)
    sink[:] = 0  # warm: the consumer's destination is faulted in before timing
    memcpy_times: list[float] = []
    shm_times: list[float] = []
    asked_times: list[float] = []
    asked_plain_times: list[float] = []
    put_times: list[float] = []
    tcp_times: dict[str, list[float]] = {kind: [] for kind in ("plain", "raw", "auth", "mac", "curve")}
    cold = 0.0

    def release(ref: TensorRef, plane: str = "auth") -> None:
        clients[plane].request(ref.owner, lambda rid: ReleaseRequest(rid, ref.id), PULL_TIMEOUT_S)

    try:
        for i in range(total):
            # memcpy and the hand-off alternate, into the same buffer, so drift hits both.
            start = time.perf_counter()
            np.copyto(sink, source)
            copy_seconds = time.perf_counter() - start
            ref, put_seconds = producer.put(i)
            start = time.perf_counter()
            data = client.fetch(ref, (Transport.SHM,), PULL_TIMEOUT_S)
            np.copyto(sink, data.numpy())
            elapsed = time.perf_counter() - start
            if sink[0] != i or sink[-1] != nbytes // 4 - 1 or data.transport is not Transport.SHM:
                raise RuntimeError("shared-memory hand-off returned the wrong bytes")
            del data
            release(ref)
            if i == 0:
                cold = nbytes / elapsed / 1e9
            if i >= args.warmup:
                shm_times.append(elapsed)
                put_times.append(put_seconds)
                memcpy_times.append(copy_seconds)

        for i in range(total):
            for plane in ("auth", "plain") if i % 2 == 0 else ("plain", "auth"):
                ref, _ = producers[plane].put(i)
                start = time.perf_counter()
                data = clients[plane].fetch(msgspec.structs.replace(ref, shm=None), (Transport.SHM,), PULL_TIMEOUT_S)
                np.copyto(sink, data.numpy())
                elapsed = time.perf_counter() - start
                if sink[0] != i or data.transport is not Transport.SHM:
                    raise RuntimeError("shared-memory hand-off returned the wrong bytes")
                del data
                release(ref, plane)
                if i >= args.warmup:
                    (asked_times if plane == "auth" else asked_plain_times).append(elapsed)

        kinds = tuple(tcp_times)
        for i in range(total):
            refs = {kind: producers[kind].put(i)[0] for kind in kinds if kind != "raw"}
            for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
                start = time.perf_counter()
                if kind != "raw":
                    data = clients[kind].fetch(refs[kind], (Transport.TCP,), PULL_TIMEOUT_S)
                    array = data.numpy()
                else:
                    raw.send(b"go")
                    frame = raw.recv(copy=False)
                    array = np.frombuffer(frame.buffer, np.float32)
                elapsed = time.perf_counter() - start
                if array[-1] != nbytes // 4 - 1 or (kind != "raw" and array[0] != i):
                    raise RuntimeError(f"{kind} transfer returned the wrong bytes")
                if i >= args.warmup:
                    tcp_times[kind].append(elapsed)
            for kind, ref in refs.items():
                release(ref, kind)
    finally:
        raw.close(linger=0)
        context.term()
        for started_client in clients.values():
            started_client.close()
        for started in producers.values():
            started.close()
        keys_home.cleanup()

    memcpy = gbps(nbytes, memcpy_times)
    shm = gbps(nbytes, shm_times)
    tcp = {kind: gbps(nbytes, times) for kind, times in tcp_times.items()}
    ours, bare = tcp["plain"], tcp["raw"]
    return {
        "size_mib": float(args.size_mib),
        "memcpy_gbps": memcpy,
        "shm_gbps": shm,
        "shm_vs_memcpy": shm / memcpy,
        "shm_asked_gbps": gbps(nbytes, asked_times),
        "shm_cold_gbps": cold,
        "shm_put_gbps": gbps(nbytes, put_times),
        "zmq_gbps": ours,
        "raw_zmq_gbps": bare,
        "zmq_vs_raw_zmq": ours / bare,
        "shm_asked_plain_gbps": gbps(nbytes, asked_plain_times),
        "auth_vs_plain": gbps(nbytes, asked_times) / gbps(nbytes, asked_plain_times),
        "auth_zmq_gbps": tcp["auth"],
        "tcp_auth_vs_plain": tcp["auth"] / ours,
        "mac_zmq_gbps": tcp["mac"],
        "tcp_mac_vs_plain": tcp["mac"] / ours,
        "curve_zmq_gbps": tcp["curve"],
        "tcp_encrypted_vs_plain": tcp["curve"] / ours,
        "goal_auth_vs_plain": GOAL_AUTH_RATIO,
    }


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--producer":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _producer_main(int(sys.argv[2]), sys.argv[3] if len(sys.argv) == 4 else None)
    else:
        parser = argparse.ArgumentParser(description=__doc__)
        add_arguments(parser)
        print(json.dumps(run(parser.parse_args())))
