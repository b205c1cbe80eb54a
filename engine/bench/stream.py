"""`omniflow bench stream [--json]`: a stream between two role worker processes with
back-pressure, against the same stream without it, measured in the same run.

A node on role `src` yields small frames (ints, sent inline) to a node on role `dst` that
reads them; each on its own worker process (`LocalCluster`), relayed by the executor in this
process. Two executors share the workers: one with credit windows and bounded stream
channels (`--window`, `--capacity`, the defaults of `WorkerDispatcher` and `Executor`), and
the anchor, with neither (0 and 0: what streams were before back-pressure).

* `frames_per_s` / `unbounded_frames_per_s`: frames per second of a run of `--frames` frames
  whose reader takes them as fast as it can, from `submit` until the run is done; median of
  `--runs` runs of each, alternating. `throughput_ratio`: the first over the second (what
  the credit costs; goal >= 0.9).
* `max_lead_frames` / `unbounded_max_lead_frames`: a reader that spends `--slow-read-us` on
  each frame (busy, as a model would) reads `--slow-frames` frames; the most frames the
  producer had made beyond those read, read off a counter it shares with the reader (a
  memory-mapped file). The producer waits after its first frame until the reader runs:
  the bound holds from then on (frames made before a reader starts are held without limit).
  `lead_bound_frames`: 2 x window + capacity + 2, the most the worker links, the executor's
  channel and the two ends can hold (goal: `max_lead_frames` within it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from engine.data.peer import Peer, PeerConfig
from engine.flow.dsl import Workflow
from engine.flow.events import NodeState, NodeStateEvent
from engine.flow.executor import Executor
from engine.flow.remote import WorkerDispatcher
from engine.spec.graph import GraphSpec
from engine.spec.kinds import default_kinds
from engine.worker.launcher import LocalCluster

GOAL_RATIO = 0.9
GATE_POLL_S = 0.001


def _counter(path: str, writable: bool) -> np.memmap:
    return np.memmap(path, dtype=np.int64, mode="r+" if writable else "r", shape=(1,))


async def produce(n: int, counter: str = "", gate: str = "") -> AsyncIterator[int]:
    """Yields 0..n-1; with `counter`, counts them there; with `gate`, waits after the first
    frame until that file exists."""
    made = _counter(counter, writable=True) if counter else None
    for i in range(n):
        if made is not None:
            made[0] = i + 1
        yield i
        if gate and i == 0:
            while not Path(gate).exists():
                await asyncio.sleep(GATE_POLL_S)


async def read_all(items: AsyncIterator[int]) -> int:
    count = 0
    async for _ in items:
        count += 1
    return count


async def read_slowly(items: AsyncIterator[int], counter: str, us: float) -> dict[str, int]:
    made = _counter(counter, writable=False)
    count = lead = 0
    async for i in items:
        lead = max(lead, int(made[0]) - i - 1)
        count += 1
        until = time.perf_counter() + us * 1e-6
        while time.perf_counter() < until:
            pass
    return {"count": count, "max_lead": lead}


def _spec(name: str, reader: Any, produce_params: dict[str, Any], read_params: dict[str, Any]) -> GraphSpec:
    wf = Workflow(name)
    src = wf.python(produce, role=wf.role("src", kind="python"), id="src", stream=True, params=produce_params)
    dst = wf.python(reader, role=wf.role("dst", kind="python"), id="dst", params=read_params)
    wf.edge(src, dst, stream=True)
    wf.output("out", dst)
    return wf.to_spec()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--frames", type=int, default=20000, help="frames of a fast-reader run")
    parser.add_argument("--runs", type=int, default=5, help="fast-reader runs of each executor")
    parser.add_argument("--slow-frames", type=int, default=2000, help="frames of a slow-reader run")
    parser.add_argument("--slow-read-us", type=float, default=100.0, help="what the slow reader spends per frame")
    parser.add_argument("--window", type=int, default=64, help="credit window of each worker link")
    parser.add_argument("--capacity", type=int, default=Executor.DEFAULT_STREAM_CAPACITY,
                        help="frames a stream channel holds for its running reader")


async def _lead(executor: Executor, folder: Path, tag: str, args: argparse.Namespace) -> int:
    counter = folder / f"{tag}.count"
    counter.write_bytes(bytes(8))  # a zero, for the producer to count up from
    gate = folder / f"{tag}.go"
    spec = _spec("bench_stream_slow", read_slowly, {"n": args.slow_frames, "counter": str(counter), "gate": str(gate)},
                 {"counter": str(counter), "us": args.slow_read_us})
    run = await executor.submit(spec)
    async with contextlib.aclosing(run.events()) as events:
        async for event in events:
            if isinstance(event, NodeStateEvent) and event.node == "dst" and event.state == NodeState.RUNNING:
                break
    gate.touch()
    result = await run.wait()
    if result.status != "done" or result.outputs["out"]["count"] != args.slow_frames:
        raise RuntimeError(f"bench run failed: {result.error or result.outputs}")
    return int(result.outputs["out"]["max_lead"])


async def _main(args: argparse.Namespace) -> dict[str, float | bool]:
    fast = _spec("bench_stream", read_all, {"n": args.frames}, {})
    kinds = default_kinds()
    cluster = LocalCluster(fast, allow_module_ops=True)
    with Peer.start(PeerConfig(keys=cluster.keys)) as peer, tempfile.TemporaryDirectory(prefix="omniflow-stream-") as tmp:
        async with cluster:
            credited = Executor(WorkerDispatcher(cluster.registry, peer, stream_window=args.window), kinds,
                                stream_capacity=args.capacity)
            unbounded = Executor(WorkerDispatcher(cluster.registry, peer, stream_window=0), kinds, stream_capacity=0)
            try:
                async def rate(executor: Executor) -> float:
                    t0 = time.perf_counter()
                    run = await executor.submit(fast)
                    result = await run.wait()
                    elapsed = time.perf_counter() - t0
                    if result.status != "done" or result.outputs != {"out": args.frames}:
                        raise RuntimeError(f"bench run failed: {result.error or result.outputs}")
                    executor.forget(run.id)
                    return args.frames / elapsed

                await rate(credited)  # warm-up: connections, imports in the workers
                await rate(unbounded)
                rates: dict[str, list[float]] = {"credited": [], "unbounded": []}
                for _ in range(args.runs):
                    rates["credited"].append(await rate(credited))
                    rates["unbounded"].append(await rate(unbounded))
                lead = await _lead(credited, Path(tmp), "credited", args)
                unbounded_lead = await _lead(unbounded, Path(tmp), "unbounded", args)
            finally:
                await credited.aclose()
                await unbounded.aclose()
    credited_rate = statistics.median(rates["credited"])
    unbounded_rate = statistics.median(rates["unbounded"])
    ratio = credited_rate / unbounded_rate
    bound = 2 * args.window + args.capacity + 2
    return {
        "frames_per_s": round(credited_rate, 1),
        "unbounded_frames_per_s": round(unbounded_rate, 1),
        "throughput_ratio": round(ratio, 3),
        "max_lead_frames": lead,
        "unbounded_max_lead_frames": unbounded_lead,
        "lead_bound_frames": bound,
        "window": args.window,
        "capacity": args.capacity,
        "goal_throughput_ratio": GOAL_RATIO,
        "meets_goal": ratio >= GOAL_RATIO and lead <= bound,
    }


def run(args: argparse.Namespace) -> dict[str, float | bool]:
    return uvloop.run(_main(args))
