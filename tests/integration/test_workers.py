"""Role workers as real processes: the example workflows, tensors between roles, a worker
killed mid-run, cancellation, SIGTERM drain, parent death, a Redis restart, `omniflow worker`.

Every test waits on readiness (READY lines, marker files the node functions write, registry
polls with deadlines), never on a sleep, and stops every process it starts. Node functions
live in `tests.integration.workerfns`; they report through marker files in `tmp_path`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import psutil
import pytest
import redis.asyncio as aioredis
import torch
import zmq
import zmq.asyncio

from engine.data.curve import PlaneKeys
from engine.data.peer import Peer, PeerConfig
from engine.data.wire import (
    ErrorCode,
    ErrorReply,
    ExecuteResult,
    TensorRef,
)
from engine.flow.discovery import RedisRegistry
from engine.flow.dispatch import InProcessDispatcher
from engine.flow.dsl import Workflow
from engine.flow.executor import Executor, RunResult
from engine.flow.loader import load_workflow
from engine.flow.remote import WorkerDispatcher
from engine.spec.calls import NodeCall, NodeContext, NodeResult, RanOn
from engine.spec.graph import GraphSpec, RoleSpec
from engine.spec.kinds import default_kinds
from engine.worker.announce import FAILED_PREFIX, FENCED_EXIT, READY_PREFIX
from engine.worker.launcher import LaunchedWorker, LocalCluster
from tests.integration import workerfns
from tests.integration.workerfns import RawClient, markers, wait_until, whoami_request, whoami_spec

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
HB = 0.2
"""Heartbeat of workers and dispatchers in these tests (seconds)."""

FNS = "tests.integration.workerfns"


# ------------------------------------------------------------------ deployments
class RecordingDispatcher:
    """Wraps a dispatcher and keeps every value the executor handed in or got back."""

    def __init__(self, inner: WorkerDispatcher) -> None:
        self.inner = inner
        self.inputs: list[tuple[str, str, Any]] = []
        self.outputs: list[tuple[str, str, Any]] = []

    async def execute(self, role: RoleSpec, call: NodeCall, ctx: NodeContext,
                      started: Callable[[RanOn], None]) -> NodeResult:
        self.inputs += [(call.node_id, port, v) for port, v in call.inputs.items()]
        result = await self.inner.execute(role, call, ctx, started)
        self.outputs += [(call.node_id, port, v) for port, v in result.outputs.items()]
        return result

    def execute_stream(self, role: RoleSpec, call: NodeCall, ctx: NodeContext, started: Callable[[RanOn], None]):
        return self.inner.execute_stream(role, call, ctx, started)

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class Deployment:
    cluster: LocalCluster
    peer: Peer
    dispatcher: RecordingDispatcher
    executor: Executor
    marker_dir: Path | None

    def worker(self, pid: int) -> LaunchedWorker:
        return next(w for w in self.cluster.workers if w.pid == pid)

    async def run(self, spec: GraphSpec, inputs: dict[str, Any] | None = None, timeout: float = 20.0) -> RunResult:
        run = await self.executor.submit(spec, inputs)
        return await asyncio.wait_for(run.wait(), timeout)


@contextlib.asynccontextmanager
async def deployed(spec: GraphSpec, marker_dir: Path | None = None, *, registry_url: str | None = None,
                   namespace: str = "omniflow", registry_refresh_s: float = 0.5) -> AsyncIterator[Deployment]:
    """`spec`'s roles as worker processes, an executor dispatching to them; all stopped after."""
    cluster = LocalCluster(spec, allow_module_ops=True, registry_url=registry_url, namespace=namespace, heartbeat_s=HB,
                           stop_timeout_s=10.0, extra_args=("--drain-timeout", "5"))
    peer = Peer.start(PeerConfig(keys=cluster.keys))
    try:
        await cluster.start()
        dispatcher = RecordingDispatcher(WorkerDispatcher(cluster.registry, peer, heartbeat_s=HB,
                                                          connect_timeout_s=5.0,
                                                          registry_refresh_s=registry_refresh_s))
        executor = Executor(dispatcher, default_kinds())
        try:
            yield Deployment(cluster, peer, dispatcher, executor, marker_dir)
        finally:
            if marker_dir is not None:
                workerfns.mark(marker_dir, "release")  # nothing held may outlive the test
            await executor.aclose()
    finally:
        await cluster.stop()
        peer.close()


def hold_spec(replicas: int, marker_dir: Path, *, then: Callable[..., Any] | None = None) -> GraphSpec:
    """x -> hold (blocks in the worker until `release`) [-> then] -> out."""
    wf = Workflow("hold")
    py = wf.role("py", kind="python", replicas=replicas)
    x = wf.input("x", default=1)
    node = wf.python(workerfns.hold, role=py, params={"dir": str(marker_dir)})
    wf.edge(x, node)
    if then is not None:
        after = wf.python(then, role=py, id="after")
        wf.edge(node, after)
        node = after
    wf.output("out", node)
    return wf.to_spec()


async def started_pid(marker_dir: Path, timeout: float = 10.0) -> int:
    pids = await wait_until(lambda: markers(marker_dir, "started"), timeout, "the held node starts on a worker")
    assert len(pids) == 1, pids
    return pids[0]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------ 1. example workflows, tensors
EXAMPLES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (workflow, inputs, outputs computed by hand)
    ("diamond", {"n": 6}, {"sum": 6**2 + 6**3}),
    ("loop", {"value": 3, "target": 100}, {"result": {"value": 192, "steps": 6}}),
    ("router", {"message": "What is the meaning of life?"},
     {"reply": "You asked: 'What is the meaning of life?'. The answer is 42."}),
    ("router", {"message": "hello there"}, {"reply": "HELLO THERE"}),
    ("stream", {"text": "frames flow through the graph"}, {"result": "FRAMES FLOW THROUGH THE GRAPH"}),
]


async def test_example_workflows_match_in_process_dispatcher():
    names = sorted({name for name, _, _ in EXAMPLES})
    specs = {name: load_workflow(str(REPO / "workflows" / f"{name}.py")) for name in names}
    kinds = default_kinds()
    inproc = Executor(InProcessDispatcher(kinds), kinds)
    try:
        local = {}
        for name, inputs, _ in EXAMPLES:
            local[(name, json.dumps(inputs))] = await asyncio.wait_for((await inproc.submit(specs[name], inputs)).wait(), 10)
    finally:
        await inproc.aclose()

    async def remote(name: str) -> None:
        async with deployed(specs[name]) as d:
            assert len(d.cluster.workers) == specs[name].role("py").replicas
            for wf_name, inputs, expected in EXAMPLES:
                if wf_name != name:
                    continue
                result = await d.run(specs[name], inputs)
                assert result.status == "done", result.error
                assert result.outputs == expected, (name, inputs)
                reference = local[(name, json.dumps(inputs))]
                assert reference.status == "done"
                assert result.outputs == reference.outputs
                assert {k: v.state for k, v in result.nodes.items()} == \
                       {k: v.state for k, v in reference.nodes.items()}

    await asyncio.gather(*(remote(name) for name in names))


async def test_diamond_memo_path(tmp_path: Path):
    """The memo branch of the diamond wins the race (square and cube wait for the test)."""
    spec = load_workflow(str(REPO / "workflows" / "diamond.py"))
    gated = {"square": 2, "cube": 3}
    spec = msgspec.structs.replace(spec, nodes=[
        msgspec.structs.replace(node, op=f"{FNS}:gated_power", params={"dir": str(tmp_path), "power": gated[node.id]})
        if node.id in gated else node
        for node in spec.nodes
    ])
    async with deployed(spec, tmp_path) as d:
        run = await d.executor.submit(spec, {"n": 3})
        await wait_until(lambda: run.node_state("total").terminal, 10, "total settles on the memo's answer")
        workerfns.mark(tmp_path, "release")
        result = await asyncio.wait_for(run.wait(), 10)
        assert result.status == "done", result.error
        assert result.outputs == {"sum": 3**2 + 3**3}


def tensor_spec() -> GraphSpec:
    wf = Workflow("tensors")
    producer = wf.role("producer", kind="python")
    consumer = wf.role("consumer", kind="python")
    seed = wf.input("seed", default=7)
    n = wf.input("n", default=1 << 20)
    make = wf.python(workerfns.make_tensor, role=producer, outputs={"out": "tensor"})
    bf16 = wf.python(workerfns.make_bf16, role=producer, outputs={"out": "tensor"})
    for node in (make, bf16):
        wf.edge(seed, node.inp("seed"))
        wf.edge(n, node.inp("n"))
    check = wf.python(workerfns.inspect_tensor, role=consumer, inputs={"t": "tensor", "b": "tensor"},
                      outputs={"sha256": "json", "bf16_sha256": "json", "kind": "json", "doubled": "tensor"})
    wf.edge(make, check.inp("t"))
    wf.edge(bf16, check.inp("b"))
    for port in ("sha256", "bf16_sha256", "kind", "doubled"):
        wf.output(port, check.out(port))
    wf.output("original", make)
    return wf.to_spec()


async def test_tensor_between_roles_is_bit_exact_and_executor_holds_refs_only():
    seed, n = 11, (1 << 20) + 3  # 4 MiB + 12 bytes: shared memory between workers, odd length
    reference = workerfns.make_tensor(seed, n)
    reference_bf16 = workerfns.make_bf16(seed, n)
    async with deployed(tensor_spec()) as d:
        result = await d.run(tensor_spec(), {"seed": seed, "n": n}, timeout=60)
        assert result.status == "done", result.error
        producer = next(w for w in d.cluster.workers if w.role == "producer")
        consumer = next(w for w in d.cluster.workers if w.role == "consumer")
        assert producer.pid != consumer.pid

        # The consumer read exactly the bytes the producer wrote.
        assert result.outputs["sha256"] == hashlib.sha256(reference.numpy().tobytes()).hexdigest()
        assert result.outputs["bf16_sha256"] == \
            hashlib.sha256(reference_bf16.view(torch.uint8).numpy().tobytes()).hexdigest()
        assert result.outputs["kind"] == "torch.Tensor:torch.float32:torch.bfloat16"

        # Tensor outputs stay with the worker that made them; the executor got refs.
        original, doubled = result.outputs["original"], result.outputs["doubled"]
        assert isinstance(original, TensorRef) and isinstance(doubled, TensorRef)
        assert original.owner == producer.details["data"]
        assert doubled.owner == consumer.details["data"]
        assert (original.dtype, original.shape) == ("float32", (n,))
        got = d.peer.pull(original, timeout=10).numpy(copy=True)
        assert got.tobytes() == reference.numpy().tobytes()
        got2 = d.peer.pull(doubled, timeout=10).numpy(copy=True)
        assert np.array_equal(got2, (reference * 2).numpy())

        # Everything the executor handed to or got back from a worker: refs for tensors, never bytes.
        seen = d.dispatcher.inputs + d.dispatcher.outputs
        tensor_ports = {("make_tensor", "out"), ("make_bf16", "out"), ("inspect_tensor", "t"),
                        ("inspect_tensor", "b"), ("inspect_tensor", "doubled")}
        assert {(node, port) for node, port, v in seen if isinstance(v, TensorRef)} == tensor_ports
        for node, port, value in seen:
            assert not isinstance(value, torch.Tensor | np.ndarray | bytes | bytearray | memoryview), (node, port)


# ------------------------------------------------------------------ 2. worker killed mid-run
async def test_sigkill_mid_run_retries_on_the_other_replica(tmp_path: Path):
    spec = hold_spec(2, tmp_path)
    async with deployed(spec, tmp_path) as d:
        run = await d.executor.submit(spec, {"x": 5})
        victim = await started_pid(tmp_path)
        survivor = next(w.pid for w in d.cluster.workers if w.pid != victim)
        os.kill(victim, signal.SIGKILL)
        result = await asyncio.wait_for(run.wait(), 10)
        assert result.status == "done", result.error
        assert result.outputs["out"] == {"x": 5, "pid": survivor}
        assert markers(tmp_path, "started") == sorted([victim, survivor])
        # Moved by the dispatcher within one attempt; the node itself never failed.
        assert result.nodes["hold"].attempts == 1
        assert await asyncio.wait_for(d.worker(victim).process.wait(), 5) == -signal.SIGKILL


async def test_sigkill_of_the_only_replica_fails_the_run_naming_worker_and_node(tmp_path: Path):
    spec = hold_spec(1, tmp_path)
    async with deployed(spec, tmp_path) as d:
        run = await d.executor.submit(spec)
        victim = await started_pid(tmp_path)
        worker_id = d.worker(victim).worker_id
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        result = await asyncio.wait_for(run.wait(), 10)
        elapsed = time.monotonic() - killed_at
        assert result.status == "failed"
        assert result.failed_node == "hold"
        assert worker_id in result.error and "'hold'" in result.error, result.error
        # Two missed heartbeats, plus up to one interval until the next ping, plus margin.
        assert elapsed < 3 * HB + 0.5, elapsed


# ------------------------------------------------------------------ 3. cancellation
async def test_cancel_stops_the_node_on_the_worker(tmp_path: Path):
    spec = hold_spec(1, tmp_path)
    async with deployed(spec, tmp_path) as d:
        run = await d.executor.submit(spec)
        pid = await started_pid(tmp_path)
        await run.cancel()
        assert (await run.wait()).status == "cancelled"
        await wait_until(lambda: markers(tmp_path, "cancelled") == [pid], 5,
                         "the node's coroutine sees CancelledError on the worker")
        # The worker is free again and serves the next run.
        workerfns.mark(tmp_path, "release")
        result = await d.run(spec, {"x": 2})
        assert result.status == "done", result.error
        assert result.outputs["out"] == {"x": 2, "pid": pid}


# ------------------------------------------------------------------ 4. SIGTERM drains
@pytest.fixture
async def redis_namespace() -> AsyncIterator[str]:
    ns = f"omniflow-test-{uuid.uuid4().hex[:12]}"
    yield ns
    client = aioredis.Redis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(match=f"{ns}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.mark.redis
async def test_sigterm_drains_finishes_in_flight_refuses_new_and_deregisters(tmp_path: Path, redis_namespace: str):
    spec = hold_spec(2, tmp_path)
    async with deployed(spec, tmp_path, registry_url=REDIS_URL, namespace=redis_namespace) as d:
        registry = d.cluster.registry
        assert len(await registry.workers("py")) == 2
        run = await d.executor.submit(spec, {"x": 9})
        pid = await started_pid(tmp_path)
        draining = d.worker(pid)
        other = next(w for w in d.cluster.workers if w.pid != pid)
        draining.process.send_signal(signal.SIGTERM)

        # New work is refused with DRAINING once the worker has begun to drain.
        context = zmq.asyncio.Context()
        raw = RawClient(context, draining.details["address"], d.cluster.keys)
        try:
            await raw.hello()
            ids = iter(range(1, 10_000))

            async def refused() -> bool:
                rid = next(ids)
                reply = await raw.call(whoami_request(rid))
                while not isinstance(reply, ErrorReply | ExecuteResult):
                    reply = await raw.recv()
                return isinstance(reply, ErrorReply) and reply.code == ErrorCode.DRAINING and reply.request_id == rid

            await wait_until(refused, 5, "the worker refuses new work with DRAINING")
        finally:
            raw.close()
            context.term()

        # ... and the dispatcher takes such work to the other replica.
        for i in range(4):
            result = await d.run(whoami_spec(), {"x": i})
            assert result.status == "done", result.error
            assert result.outputs["out"] == {"x": i, "pid": other.pid}
        assert draining.process.returncode is None  # still finishing the held node

        workerfns.mark(tmp_path, "release")
        result = await asyncio.wait_for(run.wait(), 10)
        assert result.status == "done", result.error
        assert result.outputs["out"] == {"x": 9, "pid": pid}
        assert await asyncio.wait_for(draining.process.wait(), 10) == 0
        # Deregistered on the way out (its lease of 4 heartbeats has not run out yet).
        listed = {s.worker_id for s in await registry.workers("py")}
        assert listed == {other.worker_id}


@pytest.mark.redis
async def test_a_fenced_worker_drains_and_exits_and_one_whose_record_was_lost_registers_again(
        tmp_path: Path, redis_namespace: str, capfd: pytest.CaptureFixture[str]):
    """One worker is fenced, as the studio does to the workers of a node declared lost (cut off,
    its processes alive): its heartbeat finds no record, registering again is refused, and it
    drains and exits. The other's record is merely deleted (what a lapsed TTL or a flush leaves):
    it registers again by itself and keeps serving."""
    spec = hold_spec(2, tmp_path)
    async with deployed(spec, tmp_path, registry_url=REDIS_URL, namespace=redis_namespace) as d:
        registry = d.cluster.registry
        fenced, kept = d.cluster.workers
        raw = aioredis.Redis.from_url(REDIS_URL)
        try:
            assert await raw.delete(f"{redis_namespace}:worker:{kept.worker_id}") == 1
            assert await registry.fence(fenced.worker_id) is True
            assert await asyncio.wait_for(fenced.process.wait(), 20) == FENCED_EXIT
        finally:
            await raw.aclose()

        async def only_kept() -> bool:
            return [s.worker_id for s in await registry.workers("py")] == [kept.worker_id]

        await wait_until(only_kept, 10, "the worker whose record was lost registers again")
        assert kept.process.returncode is None
        for i in range(3):  # every call goes to the one left
            result = await d.run(whoami_spec(), {"x": i})
            assert result.status == "done", result.error
            assert result.outputs["out"] == {"x": i, "pid": kept.pid}
        assert await only_kept()  # the fenced one never came back
    assert f"worker {fenced.worker_id!r} was fenced" in capfd.readouterr().err


# ------------------------------------------------------------------ 5. parent death
async def test_worker_exits_when_its_parent_dies(tmp_path: Path):
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", f"{FNS}", "parent",
        "--role", "py", "--workflow", str(REPO / "workflows" / "diamond.py"),
        "--heartbeat", str(HB), "--registry-ttl", str(4 * HB), "--keys", str(PlaneKeys.generate().write(tmp_path / "k")),
        stdout=asyncio.subprocess.PIPE, cwd=REPO,
    )
    worker_pid = None
    try:
        assert parent.stdout is not None
        while worker_pid is None:
            line = (await asyncio.wait_for(parent.stdout.readline(), 30)).decode()
            assert line, "the intermediate parent exited before its worker was ready"
            if line.startswith(READY_PREFIX):
                worker_pid = json.loads(line[len(READY_PREFIX):])["pid"]
        assert psutil.Process(worker_pid).ppid() == parent.pid
        parent.kill()
        await parent.wait()
        await wait_until(lambda: not alive(worker_pid), 5, f"worker {worker_pid} exits after its parent died")
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()
        if worker_pid is not None and alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


# ------------------------------------------------------------------ 6. Redis restart
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """A redis-server of our own (no persistence), stoppable and restartable on its port."""

    def __init__(self, directory: Path) -> None:
        self.port = _free_port()
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = aioredis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5)

        async def answers() -> bool:
            assert self.process is not None and self.process.poll() is None, "redis-server exited"
            try:
                return bool(await client.ping())
            except (OSError, aioredis.ConnectionError, aioredis.TimeoutError):
                return False

        try:
            await wait_until(answers, 10, f"redis-server on port {self.port} answers")
        finally:
            await client.aclose()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


@pytest.fixture
async def private_redis(tmp_path: Path) -> AsyncIterator[PrivateRedis]:
    directory = tmp_path / "redis"
    directory.mkdir()
    server = PrivateRedis(directory)
    await server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("release", ["after_restart", "during_outage"])
async def test_redis_restart_run_finishes_and_workers_register_again(tmp_path: Path, private_redis: PrivateRedis,
                                                                     release: str):
    """The held node is released once Redis is back but before the workers have re-registered
    (the next node finds an empty registry), or while Redis is down (it finds no registry)."""
    markers_dir = tmp_path / "markers"
    markers_dir.mkdir()
    spec = hold_spec(2, markers_dir, then=workerfns.whoami)
    # registry_refresh_s=0: the dispatcher reads the registry for every call, none is served from its cache.
    async with deployed(spec, markers_dir, registry_url=private_redis.url, namespace="restart",
                        registry_refresh_s=0.0) as d:
        ids = {w.worker_id for w in d.cluster.workers}
        pids = {w.pid for w in d.cluster.workers}
        registry = d.cluster.registry
        assert {s.worker_id for s in await registry.workers("py")} == ids
        run = await d.executor.submit(spec, {"x": 4})
        pid = await started_pid(markers_dir)

        private_redis.stop()
        if release == "during_outage":
            workerfns.mark(markers_dir, "release")
            result = await asyncio.wait_for(run.wait(), 15)
        await private_redis.start()  # same port, empty: every registration is gone
        if release == "after_restart":
            workerfns.mark(markers_dir, "release")
            result = await asyncio.wait_for(run.wait(), 15)
        assert result.status == "done", result.error
        assert result.outputs["out"]["x"] == {"x": 4, "pid": pid}
        assert result.outputs["out"]["pid"] in pids

        async def registered_again() -> bool:
            return {s.worker_id for s in await registry.workers("py")} == ids

        await wait_until(registered_again, 10, "the workers register again by themselves", interval=0.05)
        assert all(w.process.returncode is None for w in d.cluster.workers)


# ------------------------------------------------------------------ 8. `omniflow worker`
@pytest.mark.redis
async def test_omniflow_worker_command_registers_and_has_a_readable_title(redis_namespace: str, tmp_path: Path):
    command = [str(Path(sys.executable).with_name("omniflow")), "worker", "--role", "py",
               "--workflow", "workflows/diamond.py", "--registry", REDIS_URL, "--namespace", redis_namespace,
               "--heartbeat", str(HB), "--registry-ttl", str(4 * HB),
               "--keys", str(PlaneKeys.generate().write(tmp_path / "keys"))]
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE, cwd=REPO)
    registry = RedisRegistry(REDIS_URL, namespace=redis_namespace)
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        assert line.startswith(READY_PREFIX), line
        details = json.loads(line[len(READY_PREFIX):])
        assert details["pid"] == process.pid

        [snapshot] = await registry.workers("py")
        assert snapshot.worker_id == details["worker_id"]
        assert (snapshot.info.pid, snapshot.info.address) == (process.pid, details["address"])
        assert snapshot.info.meta["workflow"] == "diamond"

        title = Path(f"/proc/{process.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        assert title.startswith(f"omniflow-worker role=py id={details['worker_id']}"), title
        ps = subprocess.run(["ps", "-o", "cmd=", "-p", str(process.pid)], capture_output=True, text=True, check=True)
        assert ps.stdout.strip() == title

        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 10) == 0
        assert await registry.workers("py") == []
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await registry.close()


@pytest.mark.parametrize("keys", ["none", "open"])
def test_a_worker_without_usable_keys_does_not_start(tmp_path: Path, keys: str):
    """No silent plaintext: a worker given no keys, or keys others can read, exits at once
    with an error naming --keys."""
    command = [sys.executable, "-m", "engine.worker", "--role", "py", "--workflow", "workflows/diamond.py"]
    if keys == "open":
        directory = PlaneKeys.generate().write(tmp_path / "keys")
        os.chmod(directory, 0o755)
        command += ["--keys", str(directory)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 1
    expected = "--keys DIR is required" if keys == "none" else "mode 0755 lets group or others in"
    assert expected in done.stderr and "--keys" in done.stderr, done.stderr
    # Never ready: the one line on standard output is why, for whoever launched it.
    (line,) = done.stdout.splitlines()
    assert line.startswith(FAILED_PREFIX) and expected in json.loads(line.removeprefix(FAILED_PREFIX))["error"], line


async def test_an_in_process_registry_gets_each_workers_load(tmp_path: Path):
    """Without a registry URL the cluster asks each worker's liveness endpoint for its load,
    so the embedded studio shows live worker metrics too."""
    spec = load_workflow(str(REPO / "workflows" / "diamond.py"))
    async with deployed(spec, tmp_path) as d:
        registry = d.cluster.registry

        async def loads_with_metrics():
            snapshots = await registry.workers("py")
            return len(snapshots) == 2 and all(s.load.metrics.get("rss_bytes", 0) > 0 for s in snapshots)

        await wait_until(loads_with_metrics, 10, "every worker's load reaches the in-process registry")
        result = await d.run(spec, {"n": 4})
        assert result.outputs == {"sum": 4**2 + 4**3}

        async def completed_counted():
            return sum(s.load.metrics.get("completed", 0) for s in await registry.workers("py")) >= 4

        await wait_until(completed_counted, 10, "completed node executions show up in the loads")
