"""Executor overhead per node, against calling the same functions directly.

A 100-node chain and a 100-wide fan-out/fan-in of no-op python nodes run in process;
`per_node_us_*` is the median run's wall time divided by its node count (so it
includes the call itself), `direct_us_per_call` the same functions called in a loop.
Goal: at most 50 us per node.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from engine.flow.dispatch import InProcessDispatcher
from engine.flow.dsl import Workflow
from engine.flow.executor import Executor
from engine.spec.graph import GraphSpec
from engine.spec.kinds import default_kinds


def noop(x: int) -> int:
    return x


def gather(values: list[int]) -> int:
    return len(values)


def chain_spec(n: int) -> GraphSpec:
    wf = Workflow("bench_chain")
    py = wf.role("py", kind="python")
    prev = wf.input("x", default=0)
    for i in range(n):
        node = wf.python(noop, role=py, id=f"n{i}")
        wf.edge(prev, node)
        prev = node
    wf.output("y", prev)
    return wf.to_spec()


def fanout_spec(n: int) -> GraphSpec:
    wf = Workflow("bench_fanout")
    py = wf.role("py", kind="python")
    src = wf.input("x", default=0)
    sink = wf.python(gather, role=py, id="sink", inputs={"values": {"type": "json", "join": "all"}})
    for i in range(n):
        node = wf.python(noop, role=py, id=f"n{i}")
        wf.edge(src, node)
        wf.edge(node, sink)
    wf.output("y", sink)
    return wf.to_spec()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=50)


async def _per_node_us(executor: Executor, spec: GraphSpec, nodes: int, repeats: int) -> float:
    plan = executor.plan(spec)
    for _ in range(5):
        await (await executor.submit(plan)).wait()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run = await executor.submit(plan)
        result = await run.wait()
        times.append(time.perf_counter() - t0)
        assert result.status == "done", result.error
        executor.forget(run.id)
    return statistics.median(times) / nodes * 1e6


def _direct_us(nodes: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = 0
        for _ in range(nodes):
            x = noop(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / nodes * 1e6


async def _main(args: argparse.Namespace) -> dict[str, float]:
    kinds = default_kinds()
    executor = Executor(InProcessDispatcher(kinds), kinds)
    try:
        chain = await _per_node_us(executor, chain_spec(args.nodes), args.nodes, args.repeats)
        # The fan-out's node count includes its sink.
        fan = await _per_node_us(executor, fanout_spec(args.nodes), args.nodes + 1, args.repeats)
    finally:
        await executor.aclose()
    direct = _direct_us(args.nodes, args.repeats)
    return {
        "per_node_us_chain": round(chain, 2),
        "per_node_us_fanout": round(fan, 2),
        "direct_us_per_call": round(direct, 4),
        "goal_us": 50.0,
        "chain_vs_direct": round(chain / direct, 1),
    }


def run(args: argparse.Namespace) -> dict[str, float]:
    return asyncio.run(_main(args))
