"""CUDA tensor hand-off between two processes on one GPU, against a device-to-device copy.

Needs a CUDA GPU (it says so and stops otherwise). A producer process keeps a float32 CUDA
tensor (`--size-mib`, default 64 MiB) in its tensor store, a fresh one per repetition; this
process consumes it and reads it once, by copying it into a warm CUDA buffer. Figures are
medians, in GB/s = bytes / seconds / 1e9.

* `d2d_gbps`: the anchor, a device-to-device copy of the same size in this process
  (`dst.copy_(src)`), measured alternately with the hand-offs.
* `cuda_ipc_gbps`: from the pull (`Transport.CUDA_IPC`: the producer shares the block, this
  process opens it) until the tensor has been copied into the buffer. `cuda_ipc_open_us`:
  the pull alone (no copy).
* `staged_gbps`: what a consumer without CUDA IPC gets (and what protocol version 1 did for
  everyone): the producer stages the tensor to host memory, this process maps it (shared
  memory) and copies it to the GPU.
Ratios: `cuda_ipc_vs_d2d` (1.0 means the hand-off costs nothing beyond reading the bytes)
and `cuda_ipc_vs_staged`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import msgspec

from engine.bench.transfer import Producer, gbps
from engine.data.codec import MiB
from engine.data.peer import ClientConfig, Peer, PeerConfig, ZmqClient
from engine.data.tensor_store import StoreConfig
from engine.data.wire import ReleaseRequest, TensorRef, Transport

PULL_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mib", type=int, default=64, help="tensor size (float32)")
    parser.add_argument("--repeats", type=int, default=15, help="timed repetitions per figure")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repetitions first")


def _producer_main(size_mib: int) -> None:
    import torch

    nbytes = size_mib * MiB
    base = torch.arange(nbytes // 4, dtype=torch.float32, device="cuda:0")
    config = StoreConfig(default_lease_s=120.0, cuda_max_bytes=8 * nbytes, pool_bytes=4 * nbytes)
    with Peer.start(PeerConfig(store=config)) as peer:
        print(json.dumps({"address": peer.address}), flush=True)
        for line in sys.stdin:
            tensor = base.clone()
            tensor[0] = int(line.split()[1])
            start = time.perf_counter()
            ref = peer.put(tensor)
            seconds = time.perf_counter() - start
            print(json.dumps({"ref": msgspec.to_builtins(ref), "seconds": seconds}), flush=True)


def run(args: argparse.Namespace) -> dict[str, float]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("omniflow bench cuda_transfer needs a CUDA GPU")
    nbytes = args.size_mib * MiB
    n = nbytes // 4
    producer = Producer(args.size_mib, module="engine.bench.cuda_transfer")
    client = ZmqClient(ClientConfig())
    source = torch.arange(n, dtype=torch.float32, device="cuda:0")
    sink = torch.zeros(n, dtype=torch.float32, device="cuda:0")
    d2d: list[float] = []
    ipc: list[float] = []
    opened: list[float] = []
    staged: list[float] = []

    def release(ref: TensorRef) -> None:
        client.request(ref.owner, lambda rid: ReleaseRequest(rid, ref.id), PULL_TIMEOUT_S)

    def hand_off(ref: TensorRef, transport: Transport, value: int) -> tuple[float, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        data = client.fetch(ref, (transport,), PULL_TIMEOUT_S)
        pulled = time.perf_counter()
        sink.copy_(data.torch(), non_blocking=False)
        torch.cuda.synchronize()
        done = time.perf_counter()
        if data.transport is not transport or int(sink[0].item()) != value:
            raise RuntimeError(f"{transport.value} hand-off returned the wrong tensor ({data.transport.value})")
        del data
        return done - start, pulled - start

    try:
        for i in range(args.warmup + args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            sink.copy_(source)
            torch.cuda.synchronize()
            copy_seconds = time.perf_counter() - start
            ref, _ = producer.put(i)
            ipc_seconds, open_seconds = hand_off(ref, Transport.CUDA_IPC, i)
            staged_seconds, _ = hand_off(ref, Transport.SHM, i)
            release(ref)
            if i >= args.warmup:
                d2d.append(copy_seconds)
                ipc.append(ipc_seconds)
                opened.append(open_seconds)
                staged.append(staged_seconds)
    finally:
        client.close()
        producer.close()
    anchor, ours, host = gbps(nbytes, d2d), gbps(nbytes, ipc), gbps(nbytes, staged)
    return {
        "size_mib": float(args.size_mib),
        "d2d_gbps": anchor,
        "cuda_ipc_gbps": ours,
        "cuda_ipc_open_us": statistics.median(opened) * 1e6,
        "staged_gbps": host,
        "cuda_ipc_vs_d2d": ours / anchor,
        "cuda_ipc_vs_staged": ours / host,
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--producer":
        _producer_main(int(sys.argv[2]))
    else:
        parser = argparse.ArgumentParser(description=__doc__)
        add_arguments(parser)
        print(json.dumps(run(parser.parse_args())))
