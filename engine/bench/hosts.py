"""Transfers between two nodes against raw ZeroMQ between the same two nodes, in one run.

The nodes are network namespaces of this machine on a private bridge (`engine.bench._netns`;
needs root and iproute2): a producer process in node a, a consumer in node b. Their host
identities differ (`OMNIFLOW_HOST_ID=node:a`, `node:b`), so the transfer plane takes TCP, as
between two machines, and never tries shared memory (which namespaces of one machine share);
the bench checks every pull's path. `omniflow bench transfer --across-nodes` runs this too.

Per repetition (warm-ups first, medians reported, kinds alternated in rotating order so that
drift on a small machine hits all alike), in GB/s = bytes / seconds / 1e9:

* `tensor_auth_gbps`: the consumer's `Peer.pull` of a fresh `--size-mib` float32 tensor from
  the producer's tensor store on the authenticated worker plane as workers use it (CURVE for
  the request and its one-time grant, the bytes over the owner's bulk channel:
  `engine.data.bulk`); `tensor_plain_gbps`: the same on the plaintext plane;
  `tensor_enc_gbps`: with every byte inside CURVE (the plane's `encrypted` bulk mode);
* `kv_auth_gbps`, `kv_plain_gbps`: `engine.data.kv.pull.fetch_pages` of a run of `--kv-pages`
  KV pages (a 24-layer, 8-KV-head, 128-dim, fp16 layout of 16-token pages: 1.5 MiB a page)
  from the producer's `KVPageServer` into the consumer's `KVStore`, as workers pull them: a
  first request of 8 MiB, then the rest of the run (16 MiB requests where the holder copies its
  pages), each asked while the one before travels, the holder lending its pages from their slots
  (`KVStore.lend`: no copy there) and (authenticated plane) granting its bulk channel in the same
  reply, the consumer storing each page from the received chunk as it comes;
* `raw_tensor_gbps`, `raw_kv_gbps`: bare pyzmq between the same namespaces, a DEALER asking
  a ROUTER that answers with the same number of bytes as one `copy=False` frame;
* `kv_enc_gbps`: the KV run with every byte inside CURVE;
* `rawstored_kv_gbps`: raw ZeroMQ's KV bytes, then copied into a buffer as a KV cache stores them
  (a pull must land its pages in the puller's store; bare ZeroMQ leaves them in its frame), and
  `kv_auth_vs_raw_stored`: what the plane costs beyond moving and storing the bytes;
* the ratios `tensor_auth_vs_raw`, `tensor_plain_vs_raw`, `kv_auth_vs_raw`, `kv_plain_vs_raw`
  (goal >= 0.9), `tensor_auth_vs_plain`, `kv_auth_vs_plain` (issue #17's goal: >= 0.9) and
  `tensor_enc_vs_raw`, `kv_enc_vs_raw` (what `encrypted` costs).
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
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from engine.bench._netns import Lan
from engine.data.codec import MiB
from engine.data.curve import BulkMode, PlaneKeys
from engine.data.kv.keys import page_hashes
from engine.data.kv.layout import KVLayout
from engine.data.kv.pull import KVPageServer, fetch_pages
from engine.data.kv.store import KVStore, KVStoreConfig
from engine.data.kv.tier import Capacity
from engine.data.peer import Peer, PeerConfig, ServerConfig
from engine.data.shm import HOST_ID_ENV
from engine.data.tensor_store import StoreConfig
from engine.data.wire import ReleaseRequest, TensorRef, Transport

GOAL = 0.9
PLANES = ("auth", "enc", "plain")
TIMEOUT_S = 60.0
LAYOUT = KVLayout(page_size=16, num_layers=24, num_kv_heads=8, head_dim=128, dtype="float16")
READY_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mib", type=int, default=64, help="tensor size (float32)")
    parser.add_argument("--kv-pages", type=int, default=32, help="pages in the KV run (1.5 MiB each)")
    parser.add_argument("--repeats", type=int, default=9, help="timed repetitions per figure")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")


def _pages(n: int) -> list[Any]:
    return page_hashes(list(range(n * LAYOUT.page_size)), LAYOUT.page_size)


def _store(pages: int) -> KVStore:
    return KVStore(KVStoreConfig(layout=LAYOUT, device_capacity=Capacity(pages=pages), device="cpu"))


# ------------------------------------------------------------------------------------- producer
def _plane_keys(keys_dir: str) -> dict[str, PlaneKeys | None]:
    keys = PlaneKeys.load(keys_dir)
    return {"auth": keys, "enc": keys.with_bulk(BulkMode.ENCRYPTED), "plain": None}


def _producer(address: str, size_mib: int, kv_pages: int, keys_dir: str) -> None:
    keys = _plane_keys(keys_dir)
    nbytes = size_mib * MiB
    base = np.arange(nbytes // 4, dtype=np.float32)
    store_config = StoreConfig(pool_bytes=4 * nbytes, default_lease_s=120.0)
    peers = {plane: Peer.start(PeerConfig(server=ServerConfig(bind=f"tcp://{address}:0"), store=store_config,
                                          keys=keys[plane])) for plane in PLANES}
    kv = _store(kv_pages)
    pages = _pages(kv_pages)
    rng = np.random.default_rng(0)
    for page in pages:
        kv.put(page, _page_tensor(rng))
    servers = [KVPageServer(kv, peer.server) for peer in peers.values()]
    kv_payload = np.concatenate([kv.get(p, promote=False).reshape(-1).view(torch.uint8).numpy() for p in pages])
    context = zmq.Context()
    raw = context.socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    raw_port = raw.bind_to_random_port(f"tcp://{address}")
    control = context.socket(zmq.REP)
    control.setsockopt(zmq.LINGER, 0)
    control_port = control.bind_to_random_port(f"tcp://{address}")
    print(json.dumps({**{plane: peer.address for plane, peer in peers.items()},
                      "raw": f"tcp://{address}:{raw_port}", "control": f"tcp://{address}:{control_port}"}), flush=True)
    payloads = {b"tensor": base, b"kv": kv_payload}
    poller = zmq.Poller()
    poller.register(raw, zmq.POLLIN)
    poller.register(control, zmq.POLLIN)
    try:
        while True:
            for sock, _ in poller.poll():
                if sock is raw:
                    identity, what = raw.recv_multipart()
                    raw.send_multipart([identity, payloads[what]], copy=False)
                    continue
                request = control.recv_string().split()
                if request[0] == "stop":
                    control.send_string("bye")
                    return
                plane, value = request[1], int(request[2])
                reservation = peers[plane].store.reserve(base.shape, "float32")
                np.copyto(reservation.array, base)
                reservation.array[0] = value
                ref = peers[plane].store.commit(reservation)
                control.send_string(json.dumps(msgspec.to_builtins(ref)))
    finally:
        raw.close(linger=0)
        control.close(linger=0)
        context.term()
        for server in servers:
            server.close()
        kv.close()
        for peer in peers.values():
            peer.close()


def _page_tensor(rng: np.random.Generator) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(LAYOUT.page_shape, dtype=np.float32)).to(LAYOUT.torch_dtype)


# ------------------------------------------------------------------------------------- consumer
class _Consumer:
    """Node b's side of a run: a peer and a KV store per plane, a REQ to the producer's control
    socket and a DEALER to its raw ROUTER. `time(kind, i)` times one transfer of a kind
    (`tensor_<plane>`, `kv_<plane>`, `raw_tensor`, `raw_kv`, `rawstored_kv`). A context manager:
    everything it opened closes on exit."""

    def __init__(self, hello: dict[str, str], size_mib: int, kv_pages: int, keys_dir: str) -> None:
        keys = _plane_keys(keys_dir)
        self.hello = hello
        self.nbytes = size_mib * MiB
        self.kv_pages = kv_pages
        self.kv_nbytes = kv_pages * LAYOUT.page_nbytes
        with contextlib.ExitStack() as stack:
            # Unwound in reverse: the sockets, the context, the stores, then the peers.
            self.peers: dict[str, Peer] = {}
            for plane in PLANES:
                self.peers[plane] = Peer.start(PeerConfig(keys=keys[plane]))
                stack.callback(self.peers[plane].close)
            self.stores: dict[str, KVStore] = {}
            for plane in self.peers:
                self.stores[plane] = _store(kv_pages)
                stack.callback(self.stores[plane].close)
            self.pages = _pages(kv_pages)
            context = zmq.Context()
            stack.callback(context.term)
            self.control = context.socket(zmq.REQ)
            stack.callback(self.control.close, linger=0)
            self.control.setsockopt(zmq.LINGER, 0)
            self.control.connect(hello["control"])
            self.raw = context.socket(zmq.DEALER)
            stack.callback(self.raw.close, linger=0)
            self.raw.setsockopt(zmq.LINGER, 0)
            self.raw.connect(hello["raw"])
            self._close = stack.pop_all().close
        # Where raw ZeroMQ's KV bytes are stored, as a KV cache would.
        self.cache = np.empty(self.kv_nbytes, dtype=np.uint8)

    def __enter__(self) -> _Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def time(self, kind: str, i: int) -> float:
        """Seconds of one transfer of `kind`; `i` marks a fresh tensor."""
        what, plane = kind.split("_")
        if what in ("raw", "rawstored"):
            return self._time_raw(what, plane)
        if what == "tensor":
            return self._time_tensor(plane, i)
        return self._time_kv(plane)

    def _time_raw(self, what: str, payload: str) -> float:
        start = time.perf_counter()
        self.raw.send(payload.encode())
        frame = self.raw.recv(copy=False)
        if what == "rawstored":
            np.copyto(self.cache, np.frombuffer(frame.buffer, dtype=np.uint8))
        elapsed = time.perf_counter() - start
        if len(frame.buffer) != (self.nbytes if payload == "tensor" else self.kv_nbytes):
            raise RuntimeError(f"raw ZeroMQ sent {len(frame.buffer)} bytes")
        return elapsed

    def _time_tensor(self, plane: str, i: int) -> float:
        peer = self.peers[plane]
        self.control.send_string(f"put {plane} {i}")
        ref = msgspec.convert(json.loads(self.control.recv_string()), TensorRef)
        start = time.perf_counter()
        data = peer.pull(ref, TIMEOUT_S)
        elapsed = time.perf_counter() - start
        array = data.numpy()
        if data.transport is not Transport.TCP or array[0] != i or array[-1] != self.nbytes // 4 - 1:
            raise RuntimeError(f"tensor pull took {data.transport} or returned the wrong bytes")
        del data, array
        peer.client.request(ref.owner, lambda rid: ReleaseRequest(rid, ref.id), TIMEOUT_S)
        return elapsed

    def _time_kv(self, plane: str) -> float:
        store = self.stores[plane]
        for page in self.pages:
            if store.contains(page):
                store.remove(page)
        start = time.perf_counter()
        result = fetch_pages(store, self.peers[plane], self.hello[plane], self.pages, TIMEOUT_S)
        elapsed = time.perf_counter() - start
        if len(result.pages) != self.kv_pages or set(result.transports) != {Transport.TCP}:
            raise RuntimeError(f"KV fetch brought {len(result.pages)} pages over {result.transports}")
        return elapsed

    def stop_producer(self) -> None:
        self.control.send_string("stop")
        self.control.recv_string()


def _time_kinds(consumer: _Consumer, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Every kind once per repetition, in an order that rotates each time: seconds by kind."""
    times: dict[str, list[float]] = {f"{what}_{plane}": [] for what in ("tensor", "kv") for plane in PLANES}
    times.update(raw_tensor=[], raw_kv=[], rawstored_kv=[])
    kinds = list(times)
    for i in range(warmup + repeats):
        shift = i % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            elapsed = consumer.time(kind, i)
            if i >= warmup:
                times[kind].append(elapsed)
    return times


def _figures(times: dict[str, list[float]], size_mib: int, kv_pages: int) -> dict[str, float]:
    nbytes = size_mib * MiB
    kv_nbytes = kv_pages * LAYOUT.page_nbytes
    size = {"tensor": nbytes, "kv": kv_nbytes}
    gbps = {k: size[k.split("_")[1] if k.startswith("raw") else k.split("_")[0]]
            / statistics.median(v) / 1e9 for k, v in times.items()}
    return {
        "size_mib": float(size_mib), "kv_pages": float(kv_pages), "kv_mib": kv_nbytes / MiB,
        **{f"{k}_gbps": v for k, v in gbps.items()},
        **{f"{what}_{plane}_vs_raw": gbps[f"{what}_{plane}"] / gbps[f"raw_{what}"]
           for what in ("tensor", "kv") for plane in PLANES},
        "tensor_auth_vs_plain": gbps["tensor_auth"] / gbps["tensor_plain"],
        "kv_auth_vs_plain": gbps["kv_auth"] / gbps["kv_plain"],
        "kv_auth_vs_raw_stored": gbps["kv_auth"] / gbps["rawstored_kv"],
        "goal_vs_raw": GOAL,
        "goal_auth_vs_plain": GOAL,
    }


def _consumer(hello: dict[str, str], size_mib: int, kv_pages: int, repeats: int, warmup: int,
              keys_dir: str) -> dict[str, float]:
    with _Consumer(hello, size_mib, kv_pages, keys_dir) as consumer:
        times = _time_kinds(consumer, repeats, warmup)
        consumer.stop_producer()
    return _figures(times, size_mib, kv_pages)


# ------------------------------------------------------------------------------------- driver
def run(args: argparse.Namespace) -> dict[str, float]:
    reason = Lan.unavailable()
    if reason is not None:
        raise SystemExit(f"omniflow bench hosts: {reason}")
    with tempfile.TemporaryDirectory(prefix="omniflow-bench-hosts-") as home, Lan.make(["a", "b"]) as lan:
        keys_dir = str(PlaneKeys.generate().write(Path(home) / "keys"))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        a, b = lan.nodes["a"], lan.nodes["b"]
        producer = subprocess.Popen(
            [*a.exec_prefix, sys.executable, "-m", __name__, "--producer", a.address, str(args.size_mib),
             str(args.kv_pages), keys_dir],
            env={**env, HOST_ID_ENV: "node:a"}, stdout=subprocess.PIPE, text=True)
        try:
            assert producer.stdout is not None
            line = producer.stdout.readline()
            if not line:
                raise RuntimeError(f"the producer in node a exited with {producer.wait(timeout=READY_TIMEOUT_S)}")
            consumer = subprocess.run(
                [*b.exec_prefix, sys.executable, "-m", __name__, "--consumer", line.strip(), str(args.size_mib),
                 str(args.kv_pages), str(args.repeats), str(args.warmup), keys_dir],
                env={**env, HOST_ID_ENV: "node:b"}, capture_output=True, text=True, check=False,
                timeout=60 + 20 * (args.repeats + args.warmup))
            if consumer.returncode != 0:
                raise RuntimeError(f"the consumer in node b failed:\n{consumer.stderr[-3000:]}")
            result = json.loads(consumer.stdout.strip().splitlines()[-1])
        finally:
            try:
                producer.wait(timeout=10)
            except subprocess.TimeoutExpired:
                producer.kill()
                producer.wait(timeout=10)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--producer":
        _producer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    elif len(sys.argv) == 8 and sys.argv[1] == "--consumer":
        print(json.dumps(_consumer(json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                                   int(sys.argv[6]), sys.argv[7])))
    else:
        parser = argparse.ArgumentParser(description=__doc__)
        add_arguments(parser)
        print(json.dumps(run(parser.parse_args())))
