"""A supervising LocalCluster (`RestartPolicy`) replaces the replicas that end unasked.

Real worker processes (forked by the zygote), the real Redis for the registry test. A
killed replica is deregistered and replaced under a new worker id, and runs go to the new
one; a replacement that cannot start is tried again after the back-off; `max_restarts`
gives a slot up; retiring or stopping replaces nothing. Every wait is on an event the
cluster reports or on a process exit, each with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
import redis.asyncio as aioredis

from engine.compute.models.loader import load_builtin
from engine.data.peer import Peer, PeerConfig
from engine.flow.discovery import InProcessRegistry
from engine.flow.dsl import Workflow
from engine.flow.executor import Executor
from engine.flow.remote import WorkerDispatcher
from engine.spec.graph import GraphSpec
from engine.spec.kinds import default_kinds
from engine.worker.launcher import LaunchState, LocalCluster, WorkerLaunch
from engine.worker.liveness import STALLED_EXIT
from engine.worker.supervise import ReplicaEvent, ReplicaEventKind, RestartPolicy
from tests.integration.deployments import hf_greedy, text_ids
from tests.integration.workerfns import block_loop, die, whoami

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
HB = 0.2
WAIT_S = 30.0


def spec_of(replicas: int) -> GraphSpec:
    wf = Workflow("supervised")
    py = wf.role("py", kind="python", replicas=replicas)
    x = wf.input("x", default=0)
    node = wf.python(whoami, role=py)
    wf.edge(x, node)
    wf.output("out", node)
    return wf.to_spec()


@dataclass
class Events:
    """What the cluster reported, in order, with a wait for the next one."""

    seen: list[ReplicaEvent] = field(default_factory=list)
    queue: asyncio.Queue[ReplicaEvent] = field(default_factory=asyncio.Queue)

    async def __call__(self, event: ReplicaEvent) -> None:
        self.seen.append(event)
        self.queue.put_nowait(event)

    async def count(self, kind: ReplicaEventKind, n: int) -> None:
        """Wait until `n` events of `kind` were reported in all."""
        while sum(e.kind is kind for e in self.seen) < n:
            await self.queue.get()

    async def next(self, kind: ReplicaEventKind) -> ReplicaEvent:
        event = await asyncio.wait_for(self.queue.get(), WAIT_S)
        assert event.kind is kind, f"expected {kind}, got {event}"
        return event


@dataclass
class Launches:
    """Each replica's launch steps as the cluster reported them (`on_launch`), in order."""

    seen: list[WorkerLaunch] = field(default_factory=list)

    async def __call__(self, launch: WorkerLaunch) -> None:
        self.seen.append(launch)

    def of(self, worker_id: str) -> list[LaunchState]:
        return [launch.state for launch in self.seen if launch.worker_id == worker_id]


@dataclass
class Supervised:
    cluster: LocalCluster
    events: Events
    launches: Launches
    executor: Executor
    spec: GraphSpec

    async def run(self, x: Any, port: str = "x") -> Any:
        result = await asyncio.wait_for((await self.executor.submit(self.spec, {port: x})).wait(), WAIT_S)
        assert result.status == "done", result.error
        return result.outputs["out"]


@contextlib.asynccontextmanager
async def supervised(policy: RestartPolicy, *, replicas: int = 1, heartbeat_s: float = HB,
                     spec: GraphSpec | None = None, max_node_retries: int = 2,
                     **options) -> AsyncIterator[Supervised]:
    spec = spec if spec is not None else spec_of(replicas)
    events, launches = Events(), Launches()
    options.setdefault("extra_args", ("--drain-timeout", "5"))
    options.setdefault("stop_timeout_s", 10.0)
    cluster = LocalCluster(spec, allow_module_ops=True, heartbeat_s=heartbeat_s, restart=policy, on_event=events,
                           on_launch=launches, **options)
    peer = Peer.start(PeerConfig(keys=cluster.keys))
    try:
        await cluster.start()
        executor = Executor(WorkerDispatcher(cluster.registry, peer, heartbeat_s=HB, connect_timeout_s=5.0,
                                             registry_refresh_s=0.05, max_node_retries=max_node_retries),
                            default_kinds())
        try:
            yield Supervised(cluster, events, launches, executor, spec)
        finally:
            await executor.aclose()
    finally:
        await cluster.stop()
        peer.close()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_a_killed_replica_is_replaced_under_a_new_id_and_runs_go_to_it():
    async with supervised(RestartPolicy(backoff_s=0.05)) as s:
        (first,) = s.cluster.workers
        assert (await s.run(1))["pid"] == first.pid
        first.process.send_signal(signal.SIGKILL)

        lost = await s.events.next(ReplicaEventKind.LOST)
        assert lost.worker_id == first.worker_id and lost.role == "py"
        assert f"worker {first.worker_id} of role 'py' was killed by signal SIGKILL" == lost.reason
        replaced = await s.events.next(ReplicaEventKind.REPLACED)
        assert replaced.replaces == first.worker_id
        assert replaced.worker_id == f"{first.worker_id}-r1"
        assert replaced.worker is not None and alive(replaced.worker.pid)

        assert s.cluster.workers == [replaced.worker]
        assert s.cluster.restarting("py") == 0
        assert [w.info.worker_id for w in await s.cluster.registry.workers("py")] == [replaced.worker_id]
        assert (await s.run(2)) == {"x": 2, "pid": replaced.worker.pid}

        # The replacement is supervised in turn: its loss is replaced too.
        replaced.worker.process.send_signal(signal.SIGKILL)
        await s.events.next(ReplicaEventKind.LOST)
        again = await s.events.next(ReplicaEventKind.REPLACED)
        assert again.worker_id == f"{first.worker_id}-r2" and again.replaces == replaced.worker_id
        assert (await s.run(3))["pid"] == again.worker.pid

        # Each replacement came up as a launch of its own, in the place (index) of the first.
        for generation, worker in enumerate([first, replaced.worker, again.worker]):
            steps = [launch for launch in s.launches.seen if launch.worker_id == worker.worker_id]
            assert [launch.state for launch in steps] == [LaunchState.STARTING, LaunchState.READY]
            assert {(launch.role, launch.index, launch.generation, launch.pid) for launch in steps} == {
                ("py", 0, generation, worker.pid)}
            assert steps[1].worker is worker


def tp_spec(name: str, tp_timeout_s: float, max_new_tokens: int) -> GraphSpec:
    """Token ids through one `llm` node on a tiny-llama role split over two ranks."""
    wf = Workflow(name)
    lm = wf.role("lm", kind="llm", model="tiny-llama", tp_size=2, params={"tp_timeout_s": tp_timeout_s})
    prompt = wf.input("x", "tokens")
    gen = wf.node("gen", "llm", role=lm, params={"max_new_tokens": max_new_tokens})
    wf.edge(prompt, gen.inp("tokens"))
    wf.output("out", gen.out("tokens"), "tokens")
    return wf.to_spec()


async def test_a_tensor_parallel_replica_that_loses_a_rank_is_replaced_whole():
    """Rank 0 outlives its killed follower but can serve nothing (its group is broken): the
    cluster stops it too and starts both ranks afresh, and the new replica's greedy tokens
    equal Hugging Face `generate`."""
    async with supervised(RestartPolicy(backoff_s=0.05), spec=tp_spec("supervisedtp", 3.0, 6),
                          ready_timeout_s=120.0) as s:
        (first,) = s.cluster.workers
        leader, follower = first.processes
        # The ranks met on the socket the launcher bound and handed to rank 0: rank 0 listens on
        # it, the follower is connected to it, and the launcher kept no copy.
        listening = {c.laddr.port for c in psutil.Process(leader.pid).net_connections("tcp") if c.status == "LISTEN"}
        met = {c.raddr.port for c in psutil.Process(follower.pid).net_connections("tcp") if c.raddr}
        assert listening & met
        assert not listening & {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"}
        follower.process.send_signal(signal.SIGKILL)
        lost = await s.events.next(ReplicaEventKind.LOST)
        assert lost.reason == (f"worker {follower.worker_id} (tensor-parallel rank 1) of role 'lm'"
                               " was killed by signal SIGKILL")
        assert leader.process.returncode is not None  # stopped with its follower, not left serving errors
        replaced = await s.events.next(ReplicaEventKind.REPLACED)
        assert [r.tp_rank for r in replaced.worker.processes] == [0, 1]
        assert all(alive(r.pid) for r in replaced.worker.processes)
        assert replaced.worker.ranks[0].worker_id == f"{replaced.worker_id}.tp1"
        # One launch stream per replica, named by rank 0, its pid rank 0's: never one per rank.
        assert [(launch.worker_id, launch.state, launch.pid) for launch in s.launches.seen] == [
            (first.worker_id, LaunchState.STARTING, first.pid), (first.worker_id, LaunchState.READY, first.pid),
            (replaced.worker_id, LaunchState.STARTING, replaced.worker.pid),
            (replaced.worker_id, LaunchState.READY, replaced.worker.pid)]
        tokens = text_ids(11, 9)
        assert await s.run(tokens) == hf_greedy(load_builtin("tiny-llama").model, tokens, 6)


async def test_a_replica_whose_unit_failed_stops_itself_and_is_replaced_whole():
    """A follower rank that hangs (SIGSTOP) rather than dies: rank 0's next collective times out
    (tp_timeout_s), its unit reports the broken group (`health`), and the worker stops with
    status 4 instead of failing every later call; the cluster then replaces the replica whole."""
    tokens = text_ids(5, 7)
    async with supervised(RestartPolicy(backoff_s=0.05), spec=tp_spec("supervisedhang", 2.0, 4), ready_timeout_s=120.0,
                          stop_timeout_s=2.0, max_node_retries=0) as s:
        (first,) = s.cluster.workers
        leader, follower = first.processes
        follower.process.send_signal(signal.SIGSTOP)
        failed = await asyncio.wait_for((await s.executor.submit(s.spec, {"x": tokens})).wait(), WAIT_S)
        assert failed.status == "failed" and "tensor-parallel group failed" in failed.error, failed.error
        lost = await s.events.next(ReplicaEventKind.LOST)
        assert lost.reason == f"worker {leader.worker_id} of role 'lm' exited with status 4"
        replaced = await s.events.next(ReplicaEventKind.REPLACED)
        assert follower.process.returncode is not None  # the hung rank was ended with its replica
        assert await s.run(tokens) == hf_greedy(load_builtin("tiny-llama").model, tokens, 4)
        assert replaced.worker is not None and alive(replaced.worker.pid)


async def test_a_worker_that_exits_by_itself_is_replaced_and_its_status_is_reported():
    """A worker that stops on its own (here SIGTERM from outside: it drains and exits 0, as one
    whose attached GPU weights are gone exits 4) is lost to the cluster all the same."""
    async with supervised(RestartPolicy(backoff_s=0.05)) as s:
        (first,) = s.cluster.workers
        first.process.send_signal(signal.SIGTERM)
        lost = await s.events.next(ReplicaEventKind.LOST)
        assert lost.reason == f"worker {first.worker_id} of role 'py' exited with status 0"
        replaced = await s.events.next(ReplicaEventKind.REPLACED)
        assert (await s.run(4))["pid"] == replaced.worker.pid


@pytest.mark.redis
async def test_with_a_redis_registry_the_lost_replica_is_deregistered_at_once():
    namespace = f"omniflow-test-{uuid.uuid4().hex[:12]}"
    try:
        # Workers' registry TTL is four heartbeats, 20 s here: only the cluster's own deregistration
        # can take the dead worker off the list in time.
        async with supervised(RestartPolicy(backoff_s=0.05), registry_url=REDIS_URL, namespace=namespace,
                              heartbeat_s=5.0) as s:
            (first,) = s.cluster.workers
            first.process.send_signal(signal.SIGKILL)
            await s.events.next(ReplicaEventKind.LOST)
            assert first.worker_id not in [w.info.worker_id for w in await s.cluster.registry.workers("py")]
            replaced = await s.events.next(ReplicaEventKind.REPLACED)
            listed = [w.info.worker_id for w in await s.cluster.registry.workers("py")]
            assert listed == [replaced.worker_id]
            assert (await s.run(5))["pid"] == replaced.worker.pid
    finally:
        client = aioredis.Redis.from_url(REDIS_URL)
        keys = [key async for key in client.scan_iter(match=f"{namespace}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def test_max_restarts_gives_the_slot_up_and_the_other_replica_keeps_serving():
    async with supervised(RestartPolicy(backoff_s=0.05, max_restarts=1), replicas=2) as s:
        victim, survivor = s.cluster.workers
        victim.process.send_signal(signal.SIGKILL)
        await s.events.next(ReplicaEventKind.LOST)
        replaced = await s.events.next(ReplicaEventKind.REPLACED)
        # The replacement did not last `healthy_after_s`: its loss is the second in a row.
        replaced.worker.process.send_signal(signal.SIGKILL)
        await s.events.next(ReplicaEventKind.LOST)
        gave_up = await s.events.next(ReplicaEventKind.GAVE_UP)
        assert gave_up.replaces == replaced.worker_id
        assert "1 replacement(s) in a row" in gave_up.reason
        assert s.cluster.workers == [survivor]
        assert s.cluster.restarting("py") == 0
        assert [w.info.worker_id for w in await s.cluster.registry.workers("py")] == [survivor.worker_id]
        assert (await s.run(6))["pid"] == survivor.pid


async def test_a_replica_lost_while_being_retired_is_not_replaced_and_retire_does_not_fail():
    """Scaling down picks replicas first and retires them one by one: one of them may die in
    between. A real-time signal has no name; the reason gives its number."""
    async with supervised(RestartPolicy(backoff_s=60.0, max_backoff_s=60.0), replicas=2) as s:
        victim, kept = s.cluster.workers
        number = int(signal.SIGRTMIN) + 3
        victim.process.send_signal(number)  # its default action ends the process
        lost = await s.events.next(ReplicaEventKind.LOST)
        assert lost.reason == f"worker {victim.worker_id} of role 'py' was killed by signal {number}"
        assert s.cluster.restarting("py") == 1
        await s.cluster.retire(victim)
        assert s.cluster.restarting("py") == 0 and s.cluster.workers == [kept]


async def test_max_restarts_zero_reports_the_loss_and_gives_up_at_once():
    async with supervised(RestartPolicy(max_restarts=0)) as s:
        (only,) = s.cluster.workers
        only.process.send_signal(signal.SIGKILL)
        await s.events.next(ReplicaEventKind.LOST)
        gave_up = await s.events.next(ReplicaEventKind.GAVE_UP)
        assert gave_up.reason == "restarts are off (max_restarts 0)"
        assert s.cluster.workers == [] and s.cluster.restarting("py") == 0


async def test_a_replacement_that_cannot_start_is_retried_then_given_up():
    """The fork server is killed: the workers it forked exit with it (they watch their parent),
    and every replacement fails to start, each failure reported, until `max_restarts`."""
    async with supervised(RestartPolicy(backoff_s=0.01, max_restarts=2)) as s:
        (first,) = s.cluster.workers
        assert s.cluster.launcher.zygote is not None
        os.kill(s.cluster.launcher.zygote.pid, signal.SIGKILL)
        lost = await s.events.next(ReplicaEventKind.LOST)
        assert lost.worker_id == first.worker_id
        for _ in range(2):
            failed = await s.events.next(ReplicaEventKind.RESTART_FAILED)
            assert failed.replaces == first.worker_id and "fork server" in failed.reason
        await s.events.next(ReplicaEventKind.GAVE_UP)
        assert s.cluster.workers == []
        # No process was spawned for them: each replacement failed straight away, with the reason.
        for generation in (1, 2):
            (launch,) = [x for x in s.launches.seen if x.generation == generation]
            assert launch.state is LaunchState.FAILED and launch.pid is None and "fork server" in launch.error


async def test_retire_and_stop_replace_nothing_and_stop_ends_a_pending_replacement():
    async with supervised(RestartPolicy(backoff_s=0.05), replicas=2) as s:
        retired, kept = s.cluster.workers
        await s.cluster.retire(retired)
        assert retired.process.returncode == 0
        assert s.cluster.workers == [kept] and s.cluster.restarting("py") == 0
    assert s.events.seen == []

    # A loss whose replacement waits out a long back-off: stop() cancels it and leaves nothing.
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    async with supervised(RestartPolicy(backoff_s=60.0, max_backoff_s=60.0)) as s:
        (only,) = s.cluster.workers
        only.process.send_signal(signal.SIGKILL)
        await s.events.next(ReplicaEventKind.LOST)
        assert s.cluster.restarting("py") == 1
        assert await s.cluster.cancel_restarts("py", 5) == 1
        assert s.cluster.restarting("py") == 0
        only_again = await s.cluster.spawn("py", 7)  # scaling up again after the cancel
        only_again.process.send_signal(signal.SIGKILL)
        await s.events.next(ReplicaEventKind.LOST)
        assert s.cluster.restarting("py") == 1
        stopping = asyncio.ensure_future(s.cluster.stop())
        await asyncio.wait_for(stopping, 10)
    assert s.events.queue.empty()
    # The replacement waiting out its back-off never started: no launch of it was reported.
    assert {launch.generation for launch in s.launches.seen} == {0}
    assert [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in before and alive(c.pid)] == []


async def test_a_worker_whose_loop_is_stuck_ends_itself_with_its_stacks_and_is_replaced(capfd):
    """Its liveness thread would keep answering pings for a worker that serves nothing; past
    `--stall-timeout` it dumps every thread's stack, deregisters and exits (status 5)."""
    wf = Workflow("stall")
    py = wf.role("py", kind="python")
    x = wf.input("x", default=0)
    stuck = wf.python(block_loop, role=py, params={"seconds": 120.0})
    wf.edge(x, stuck)
    wf.output("out", stuck)
    # No retry: whether a retry would find the replacement up yet is a matter of timing.
    async with supervised(RestartPolicy(backoff_s=0.05), spec=wf.to_spec(), max_node_retries=0,
                          extra_args=("--drain-timeout", "5", "--stall-timeout", "1")) as s:
        (first,) = s.cluster.workers
        run = await s.executor.submit(s.spec, {"x": 1})
        lost = await s.events.next(ReplicaEventKind.LOST)
        assert lost.reason == f"worker {first.worker_id} of role 'py' exited with status {STALLED_EXIT}"
        assert first.worker_id not in [w.info.worker_id for w in await s.cluster.registry.workers("py")]
        # Its node is not retried: it failed, naming the worker and itself.
        ended = await asyncio.wait_for(run.wait(), WAIT_S)
        assert ended.status == "failed" and first.worker_id in ended.error and "'block_loop'" in ended.error
        await s.events.next(ReplicaEventKind.REPLACED)
    err = capfd.readouterr().err
    assert "the worker's event loop has not turned for" in err
    assert 'in block_loop' in err  # the stack dump shows where the loop is stuck


async def test_a_node_that_kills_its_worker_is_retried_at_most_max_node_retries_times():
    """A poison input: each worker it reaches dies. The dispatcher moves it to another replica
    twice (its default max_node_retries) and then fails it, naming the three workers, instead of
    bringing down every replica in turn; the supervisor replaces the three."""
    wf = Workflow("poison")
    py = wf.role("py", kind="python", replicas=4)
    x = wf.input("x", default=0)
    node = wf.python(die, role=py, retries=3)  # the node's own retries do not multiply the count
    wf.edge(x, node)
    wf.output("out", node)
    async with supervised(RestartPolicy(backoff_s=0.05), spec=wf.to_spec()) as s:
        result = await asyncio.wait_for((await s.executor.submit(s.spec, {"x": 1})).wait(), WAIT_S)
        assert result.status == "failed"
        assert "NodeKillsWorkers" in result.error and "is not retried again" in result.error
        assert "node 'die' lost every worker it was sent to (3: " in result.error
        await asyncio.wait_for(s.events.count(ReplicaEventKind.REPLACED, 3), WAIT_S)
        lost = [e.worker_id for e in s.events.seen if e.kind is ReplicaEventKind.LOST]
        assert len(lost) == 3 and all(worker_id in result.error for worker_id in lost)
        assert len(s.cluster.workers) == 4  # the fourth never ran it; three replacements


def test_the_back_off_doubles_up_to_its_cap_and_bad_policies_are_refused():
    policy = RestartPolicy(backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.delay_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="backoff_s <= max_backoff_s"):
        RestartPolicy(backoff_s=2.0, max_backoff_s=1.0)
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        RestartPolicy(max_restarts=-1)


def test_a_negative_max_node_retries_is_refused():
    peer = Peer.start()
    try:
        with pytest.raises(ValueError, match="max_node_retries must be >= 0, got -1"):
            WorkerDispatcher(InProcessRegistry(), peer, max_node_retries=-1)
    finally:
        peer.close()
