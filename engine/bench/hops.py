"""`omniflow bench hops [--json]`: node-to-node hops between role worker processes, against a
Celery task round trip measured in the same run.

A chain `x -> a -> b -> c -> y` of no-op python nodes, each on its own role, so each node runs
in its own worker process (`LocalCluster`), dispatched by `WorkerDispatcher` from an executor
in this process. Values are small ints, sent inline.

* A *hop* is one node execution on a remote worker as a run sees it: the executor sends the
  node's `ExecuteRequest`, the worker runs the function and answers, the executor takes the
  result and hands it to the next node. Measured as the wall time of one run, from
  `Executor.submit()` until `Run.wait()` returns, one run at a time, divided by 3 (its three
  remote nodes; the input and output nodes run in the executor and are included).
  `hop_p50_us` / `hop_p99_us`: median and 99th percentile over `--runs` runs, after
  `--warmup` runs. Goals: `hop_p50_us` <= 250 and <= 0.1 x `celery_roundtrip_p50_us`.
* `celery_roundtrip_p50_us` / `_p99_us`: `noop.delay(i).get()` of a no-op Celery task with
  Redis as broker and result backend (`--redis-url`, default $REDIS_URL, database
  `--celery-db`, a queue of its own), served by a solo-pool Celery worker. Celery runs only
  in subprocesses, its client too (the engine never imports it); readiness is a first task
  answered; `--celery-n` round trips are timed.
* The two are measured side by side: `--blocks` alternating blocks of hop runs and Celery
  round trips, so that drift on a busy machine hits both alike. `hop_ratio_vs_celery` is
  `hop_p50_us / celery_roundtrip_p50_us` (goal <= 0.1).
* `runs_per_s`: `--concurrent` (64) runs submitted at once, completed runs per second
  (median of `--rounds` rounds, after one warm-up round).

The executor runs on uvloop, as `omniflow run` and the workers do, and reaches the workers
as `omniflow run` does on one host: over their local stream sockets (`engine.data.framed`),
polling briefly for each answer (`WorkerDispatcher(poll_after_send_s=...)`).
`--poll-after-send-us 0` measures the dispatcher sleeping in epoll after every send instead.

The authenticated worker plane (CURVE keys, `engine.data.curve`) is what `hop_p50_us` measures;
the same chain on a plaintext cluster (`LocalCluster(plaintext=True)`) is measured in the same
blocks: `plain_hop_p50_us`, and `hop_ratio_auth_vs_plain` (goal <= 1.2). On one host the
control path is a local stream, which CURVE does not touch (its peer check is one getsockopt at
connect), so the same pair is measured over ZeroMQ TCP, the path across hosts, where CURVE
encrypts every message: `tcp_hop_p50_us`, `tcp_plain_hop_p50_us`, `tcp_hop_ratio_auth_vs_plain`
(goal <= 1.2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

from engine.data.peer import Peer, PeerConfig
from engine.flow.dsl import Workflow
from engine.flow.executor import Executor
from engine.flow.plan import Plan
from engine.flow.remote import WorkerDispatcher
from engine.spec.graph import GraphSpec
from engine.spec.kinds import default_kinds
from engine.worker.launcher import LocalCluster

NODES = 3
GOAL_HOP_US = 250.0
GOAL_RATIO = 0.1
GOAL_AUTH_RATIO = 1.2
"""Hop p50 on the authenticated plane over the plaintext one, on each path."""


async def noop(x: int) -> int:
    """A coroutine that never suspends: the hop is the plane's cost alone. (A plain function
    would run in the python unit's thread pool, adding a thread hand-off and an ExecuteStarted.)"""
    return x


def chain_spec() -> GraphSpec:
    wf = Workflow("bench_hops")
    prev = wf.input("x", default=0)
    for name in ("a", "b", "c")[:NODES]:
        node = wf.python(noop, role=wf.role(name, kind="python"), id=name)
        wf.edge(prev, node)
        prev = node
    wf.output("y", prev)
    return wf.to_spec()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=1500, help="timed sequential runs")
    parser.add_argument("--warmup", type=int, default=200, help="untimed runs first")
    parser.add_argument("--blocks", type=int, default=5, help="alternating blocks of hop runs and Celery calls")
    parser.add_argument("--concurrent", type=int, default=64, help="runs in flight for runs_per_s")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of concurrent runs")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                        help="the Redis of the Celery anchor (default: $REDIS_URL)")
    parser.add_argument("--celery-db", type=int, default=15, help="Redis database index of the Celery anchor")
    parser.add_argument("--celery-n", type=int, default=500, help="timed Celery round trips")
    parser.add_argument("--no-celery", action="store_true", help="skip the Celery anchor")
    parser.add_argument("--poll-after-send-us", type=float, default=None,
                        help="the dispatcher's polling window after a send (default: its own, 200)")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# ------------------------------------------------------------------ celery
_CELERY_MODULE = "omniflow_hops_celery"
_CELERY_SOURCE = '''"""The Celery anchor of `omniflow bench hops`, run in subprocesses only.

`python -m omniflow_hops_celery`: the client. It answers one first task (readiness) and
prints `ready`, then for each line N on standard input times N round trips and prints
them as one JSON line; at end of input it forgets its results and exits.
"""
import json
import os
import sys
import time

import celery
from celery import Celery

app = Celery("omniflow_hops", broker=os.environ["HOPS_BROKER"], backend=os.environ["HOPS_BROKER"])
app.conf.update(
    task_default_queue=os.environ["HOPS_QUEUE"],
    result_expires=120,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="omniflow_hops.noop")
def noop(x):
    return x


def client():
    sent = [noop.delay(-1)]
    sent[0].get(timeout=120)
    for i in range(50):
        sent.append(noop.delay(i))
        sent[-1].get(timeout=10)
    print(json.dumps({"ready": True, "celery_version": celery.__version__}), flush=True)
    for line in sys.stdin:
        times = []
        for i in range(int(line)):
            t0 = time.perf_counter()
            result = noop.delay(i)
            if result.get(timeout=10) != i:
                raise SystemExit("celery: wrong answer")
            times.append(time.perf_counter() - t0)
            sent.append(result)
        print(json.dumps(times), flush=True)
    for result in sent:
        result.forget()


if __name__ == "__main__":
    client()
'''


class _CeleryAnchor:
    """A solo-pool Celery worker and a client process, on a queue of their own."""

    def __init__(self, redis_url: str, db: int) -> None:
        parts = urllib.parse.urlsplit(redis_url)
        broker = urllib.parse.urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))
        self._tmp = tempfile.TemporaryDirectory(prefix="omniflow-hops-")
        Path(self._tmp.name, f"{_CELERY_MODULE}.py").write_text(_CELERY_SOURCE)
        queue = f"omniflow-hops-{uuid.uuid4().hex[:10]}"
        self._env = dict(os.environ, PYTHONPATH=self._tmp.name, HOPS_QUEUE=queue, HOPS_BROKER=broker)
        self._worker: asyncio.subprocess.Process | None = None
        self._client: asyncio.subprocess.Process | None = None
        self._queue = queue
        self.version = ""

    async def start(self) -> None:
        # The worker's log goes to a file: a pipe nobody reads could fill and stall it.
        with open(Path(self._tmp.name, "worker.log"), "wb") as log:
            self._worker = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "celery", "-A", _CELERY_MODULE, "worker", "--pool", "solo",
                "-Q", self._queue, "-n", f"{self._queue}@%h", "--without-heartbeat", "--without-gossip",
                "--without-mingle", "--loglevel", "WARNING",
                cwd=self._tmp.name, env=self._env, stdout=log, stderr=log,
            )
        self._client = await asyncio.create_subprocess_exec(
            sys.executable, "-m", _CELERY_MODULE, cwd=self._tmp.name, env=self._env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        hello = json.loads(await self._line(180.0))
        self.version = hello["celery_version"]

    async def _line(self, timeout: float) -> str:
        assert self._client is not None and self._client.stdout is not None
        async with asyncio.timeout(timeout):
            line = await self._client.stdout.readline()
        if not line:
            raise RuntimeError(f"the Celery client exited with status {await self._client.wait()}"
                               f" (worker: {await self._worker_error()})")
        return line.decode()

    async def _worker_error(self) -> str:
        assert self._worker is not None
        state = "running" if self._worker.returncode is None else f"exited with status {self._worker.returncode}"
        tail = Path(self._tmp.name, "worker.log").read_text(errors="replace")[-2000:]
        return f"{state}; its log ends: {tail}"

    async def round_trips(self, n: int) -> list[float]:
        """`n` timed round trips, in microseconds."""
        assert self._client is not None and self._client.stdin is not None
        self._client.stdin.write(f"{n}\n".encode())
        await self._client.stdin.drain()
        return [t * 1e6 for t in json.loads(await self._line(60.0 + n * 0.5))]

    async def stop(self) -> None:
        if self._client is not None and self._client.stdin is not None:
            self._client.stdin.close()  # the client's end of input: it exits
            await _reap(self._client, 30)
        if self._worker is not None and self._worker.returncode is None:
            self._worker.send_signal(signal.SIGTERM)
            await _reap(self._worker, 15)
        self._tmp.cleanup()


async def _reap(process: asyncio.subprocess.Process, timeout_s: float) -> None:
    """Wait `timeout_s` for `process`, told to stop, to exit; then kill it."""
    try:
        async with asyncio.timeout(timeout_s):
            await process.wait()
    except TimeoutError:
        process.kill()
        await process.wait()


# ------------------------------------------------------------------ the run
PLANES = ("curve", "plain")
"""The authenticated worker plane (CURVE keys, the default) and the plaintext one."""
PATHS = ("local", "tcp")
"""How the executor reaches the workers: their local stream sockets (one host), or ZeroMQ TCP."""
Key = tuple[str, str]
"""(plane, path)."""
KEYS: list[Key] = [(plane, path) for plane in PLANES for path in PATHS]


def _hop_key(plane: str, path: str) -> str:
    return {("curve", "local"): "hop", ("plain", "local"): "plain_hop",
            ("curve", "tcp"): "tcp_hop", ("plain", "tcp"): "tcp_plain_hop"}[(plane, path)]


class _Chains:
    """The chain on each plane's `LocalCluster`, with an `Executor` (and its plan) per plane and
    path, all in this process; `aclose` stops what `start` started."""

    def __init__(self, spec: GraphSpec, poll_after_send_us: float | None) -> None:
        self.spec = spec
        self._poll = {} if poll_after_send_us is None else {"poll_after_send_s": poll_after_send_us * 1e-6}
        # Generous readiness: the figures are of serving, not of starting, and a busy machine starts slowly.
        self.clusters = {"curve": LocalCluster(spec, allow_module_ops=True, ready_timeout_s=300.0),
                         "plain": LocalCluster(spec, allow_module_ops=True, plaintext=True, ready_timeout_s=300.0)}
        self.peers = {plane: Peer.start(PeerConfig(keys=cluster.keys)) for plane, cluster in self.clusters.items()}
        self.executors: dict[Key, Executor] = {}
        self._plans: dict[Key, Plan] = {}

    async def start(self) -> None:
        kinds = default_kinds()
        for cluster in self.clusters.values():
            await cluster.start()
        for plane, path in KEYS:
            dispatcher = WorkerDispatcher(self.clusters[plane].registry, self.peers[plane],
                                          local_streams=path == "local", **self._poll)
            self.executors[plane, path] = Executor(dispatcher, kinds)
        self._plans = {key: executor.plan(self.spec) for key, executor in self.executors.items()}

    async def one(self, key: Key, i: int) -> float:
        """Seconds of one run of the chain with input `i`, from submit until its result."""
        executor = self.executors[key]
        t0 = time.perf_counter()
        run = await executor.submit(self._plans[key], {"x": i})
        result = await run.wait()
        elapsed = time.perf_counter() - t0
        if result.status != "done" or result.outputs != {"y": i}:
            raise RuntimeError(f"bench run failed ({key[0]} plane, {key[1]}): {result.error or result.outputs}")
        executor.forget(run.id)
        return elapsed

    async def aclose(self) -> None:
        for executor in self.executors.values():
            await executor.aclose()
        for cluster in self.clusters.values():
            await cluster.stop()
        for peer in self.peers.values():
            peer.close()


@dataclass(slots=True)
class _Timings:
    hops: dict[Key, list[float]] = field(default_factory=lambda: {key: [] for key in KEYS})
    """Microseconds per hop, by (plane, path)."""
    celery: list[float] = field(default_factory=list)
    """Microseconds per Celery round trip."""
    rates: list[float] = field(default_factory=list)
    """Completed runs per second, per round of concurrent runs."""


async def _time_sequential(chains: _Chains, anchor: _CeleryAnchor | None, args: argparse.Namespace,
                           timings: _Timings) -> None:
    """Warm-up runs, then alternating blocks of hop runs (every plane and path) and Celery round
    trips, so that drift on a busy machine hits them all alike."""
    for key in KEYS:
        for i in range(args.warmup):
            await chains.one(key, i)
    for runs, calls in zip(_split(args.runs, args.blocks), _split(args.celery_n, args.blocks), strict=True):
        for key in KEYS:
            for i in range(runs):
                timings.hops[key].append(await chains.one(key, i) / NODES * 1e6)
        if anchor is not None:
            timings.celery.extend(await anchor.round_trips(calls))


async def _time_concurrent(chains: _Chains, args: argparse.Namespace, timings: _Timings) -> None:
    """`--concurrent` runs at once on the authenticated local path, `--rounds` times after a warm-up round."""
    for r in range(args.rounds + 1):
        t0 = time.perf_counter()
        await asyncio.gather(*(chains.one(("curve", "local"), i) for i in range(args.concurrent)))
        if r:  # the first round warms up the concurrent path
            timings.rates.append(args.concurrent / (time.perf_counter() - t0))


def _figures(timings: _Timings, celery_version: str | None) -> dict[str, float | str | bool]:
    hops = timings.hops
    p50 = {key: statistics.median(values) for key, values in hops.items()}
    hop_p50 = p50["curve", "local"]
    result: dict[str, float | str | bool] = {
        "hop_p50_us": round(hop_p50, 1),
        "hop_p99_us": round(_pct(hops["curve", "local"], 0.99), 1),
        "runs_per_s": round(statistics.median(timings.rates), 1),
        "goal_hop_p50_us": GOAL_HOP_US,
    }
    for key in [k for k in hops if k != ("curve", "local")]:
        result[f"{_hop_key(*key)}_p50_us"] = round(p50[key], 1)
        result[f"{_hop_key(*key)}_p99_us"] = round(_pct(hops[key], 0.99), 1)
    result["hop_ratio_auth_vs_plain"] = round(hop_p50 / p50["plain", "local"], 3)
    result["tcp_hop_ratio_auth_vs_plain"] = round(p50["curve", "tcp"] / p50["plain", "tcp"], 3)
    result["goal_auth_vs_plain"] = GOAL_AUTH_RATIO
    meets = hop_p50 <= GOAL_HOP_US and max(result["hop_ratio_auth_vs_plain"],
                                           result["tcp_hop_ratio_auth_vs_plain"]) <= GOAL_AUTH_RATIO
    if celery_version is not None:
        celery_p50 = statistics.median(timings.celery)
        result["celery_roundtrip_p50_us"] = round(celery_p50, 1)
        result["celery_roundtrip_p99_us"] = round(_pct(timings.celery, 0.99), 1)
        result["celery_version"] = celery_version
        result["hop_ratio_vs_celery"] = round(hop_p50 / celery_p50, 3)
        meets = meets and hop_p50 <= GOAL_RATIO * celery_p50
    result["meets_goal"] = meets
    return result


async def _main(args: argparse.Namespace) -> dict[str, float | str | bool]:
    anchor = None if args.no_celery else _CeleryAnchor(args.redis_url, args.celery_db)
    chains = _Chains(chain_spec(), args.poll_after_send_us)
    timings = _Timings()
    try:
        await chains.start()
        if anchor is not None:
            await anchor.start()
        await _time_sequential(chains, anchor, args, timings)
        await _time_concurrent(chains, args, timings)
    finally:
        if anchor is not None:
            await anchor.stop()
        await chains.aclose()
    return _figures(timings, None if anchor is None else anchor.version)


def run(args: argparse.Namespace) -> dict[str, float | str | bool]:
    return uvloop.run(_main(args))
