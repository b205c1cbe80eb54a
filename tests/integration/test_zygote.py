"""Workers forked by the zygote (`engine.worker.zygote`), LocalCluster's default way to start them.

The forked workers run nodes, carry their own process titles, are the zygote's children
and stop with the cluster; a SIGKILLed zygote or a SIGKILLed launcher leaves no process
behind. Every wait is on readiness (READY lines, process exits with deadlines).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from engine.data.peer import Peer, PeerConfig
from engine.flow.dsl import Workflow
from engine.flow.executor import Executor
from engine.flow.remote import WorkerDispatcher
from engine.spec.graph import GraphSpec, encode_spec
from engine.spec.kinds import default_kinds
from engine.worker.launcher import LaunchError, LaunchState, LocalCluster, WorkerLaunch
from engine.worker.zygote import INHERITED_FD, ForkedProcess, Zygote
from tests.integration.workerfns import wait_until, whoami

REPO = Path(__file__).resolve().parents[2]
HB = 0.2


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def title(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline())


def two_replicas_spec() -> GraphSpec:
    wf = Workflow("zygote")
    py = wf.role("py", kind="python", replicas=2)
    x = wf.input("x", default=0)
    node = wf.python(whoami, role=py)
    wf.edge(x, node)
    wf.output("out", node)
    return wf.to_spec()


def cluster_of(spec: GraphSpec, **options) -> LocalCluster:
    return LocalCluster(spec, allow_module_ops=True, heartbeat_s=HB, stop_timeout_s=10.0,
                        extra_args=("--drain-timeout", "5"), **options)


class Launches:
    """Each replica's launch steps (`on_launch`), in the order reported."""

    def __init__(self) -> None:
        self.seen: list[WorkerLaunch] = []

    async def __call__(self, launch: WorkerLaunch) -> None:
        self.seen.append(launch)

    def streams(self) -> dict[str, list[LaunchState]]:
        out: dict[str, list[LaunchState]] = {}
        for launch in self.seen:
            out.setdefault(launch.worker_id, []).append(launch.state)
        return out


async def test_forked_workers_run_nodes_and_stop_with_the_cluster():
    spec = two_replicas_spec()
    cluster = cluster_of(spec)
    peer = Peer.start(PeerConfig(keys=cluster.keys))
    try:
        await cluster.start()
        assert cluster.launcher.zygote is not None
        zygote = cluster.launcher.zygote.pid
        assert title(zygote).startswith("omniflow-zygote")
        pids = [w.pid for w in cluster.workers]
        assert len(set(pids)) == 2
        for worker in cluster.workers:
            assert isinstance(worker.process, ForkedProcess)
            assert worker.details["pid"] == worker.pid
            assert psutil.Process(worker.pid).ppid() == zygote
            assert title(worker.pid).startswith(f"omniflow-worker role=py id={worker.worker_id} listen=tcp://")
        executor = Executor(WorkerDispatcher(cluster.registry, peer, heartbeat_s=HB, connect_timeout_s=5.0),
                            default_kinds())
        try:
            seen = set()
            for i in range(6):
                result = await asyncio.wait_for((await executor.submit(spec, {"x": i})).wait(), 20)
                assert result.status == "done", result.error
                assert result.outputs["out"]["x"] == i
                seen.add(result.outputs["out"]["pid"])
            assert seen <= set(pids) and seen
        finally:
            await executor.aclose()
        workers = list(cluster.workers)
    finally:
        await cluster.stop()
        peer.close()
    assert [w.process.returncode for w in workers] == [0, 0]
    assert not any(alive(pid) for pid in [*pids, zygote])


@pytest.mark.parametrize("fork_server", [True, False])
async def test_each_replica_is_reported_starting_with_its_process_then_ready(fork_server):
    launches = Launches()
    cluster = cluster_of(two_replicas_spec(), on_launch=launches, fork_server=fork_server)
    try:
        await cluster.start()
        workers = {w.worker_id: w for w in cluster.workers}
        assert launches.streams() == {worker_id: [LaunchState.STARTING, LaunchState.READY] for worker_id in workers}
        for launch in launches.seen:
            worker = workers[launch.worker_id]
            assert (launch.role, launch.pid, launch.host, launch.generation, launch.error) == (
                "py", worker.pid, "127.0.0.1", 0, "")
            assert launch.worker is (worker if launch.state is LaunchState.READY else None)
        assert sorted(launch.index for launch in launches.seen if launch.state is LaunchState.READY) == [0, 1]
    finally:
        await cluster.stop()


@pytest.mark.parametrize("fork_server", [True, False])
async def test_a_forked_worker_that_fails_before_ready_fails_the_start_and_leaves_nothing_running(fork_server):
    """Forked or spawned: the workers still starting when one fails are ended too."""
    wf = Workflow("zygotebad")
    wf.role("py", kind="python", replicas=2)
    wf.role("bad", kind="llm", model="no-such-model")
    wf.input("x", "json")
    launches = Launches()
    cluster = cluster_of(wf.to_spec(), fork_server=fork_server, on_launch=launches)
    # Other tests' long-lived helpers (a live studio, say) may be children of this process too.
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(LaunchError, match=r"exited with status 1 before it was ready"):
        await cluster.start()
    assert cluster.workers == []
    # The role that cannot start is reported starting, then failed with the reason; the others
    # were ready, or abandoned when its failure cancelled them.
    streams = launches.streams()
    (bad,) = [launch for launch in launches.seen if launch.role == "bad" and launch.state is not LaunchState.STARTING]
    assert streams[bad.worker_id] == [LaunchState.STARTING, LaunchState.FAILED]
    assert re.search(r"worker .*-bad-0-\d+ of role 'bad' exited with status 1 before it was ready", bad.error)
    # Why, as the worker said it (its FAILED line), not only that it exited.
    assert re.search(r"before it was ready: ModelLoadError: .*'no-such-model'", bad.error), bad.error
    assert bad.pid is not None and bad.worker is None
    py = [states for worker_id, states in streams.items() if worker_id != bad.worker_id]
    assert len(py) == 2
    assert all(states in ([LaunchState.STARTING, LaunchState.READY], [LaunchState.STARTING, LaunchState.ABANDONED])
               for states in py), py
    # The zygote and the worker that did start are stopped and reaped: no child of this start is left.
    assert [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in before and alive(c.pid)] == []


async def test_a_worker_killed_by_signal_reports_it():
    cluster = cluster_of(two_replicas_spec())
    try:
        await cluster.start()
        victim = cluster.workers[0]
        victim.process.send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(victim.process.wait(), 10) == -signal.SIGKILL
        assert alive(cluster.workers[1].pid)
    finally:
        await cluster.stop()


async def test_a_sigkilled_zygote_leaves_no_orphans():
    cluster = cluster_of(two_replicas_spec())
    try:
        await cluster.start()
        assert cluster.launcher.zygote is not None
        zygote = cluster.launcher.zygote.pid
        workers = list(cluster.workers)
        os.kill(zygote, signal.SIGKILL)
        for worker in workers:
            # The zygote cannot report the status any more; the pidfd still says when it ended.
            assert await asyncio.wait_for(worker.process.wait(), 10) is None
            assert not alive(worker.pid)
    finally:
        await asyncio.wait_for(cluster.stop(), 20)


LAUNCHER = """
import asyncio, json, sys
from engine.worker.launcher import LaunchError, LaunchState, LocalCluster, WorkerLaunch
from tests.integration.test_zygote import two_replicas_spec

async def main():
    cluster = LocalCluster(two_replicas_spec(), allow_module_ops=True, heartbeat_s=0.2)
    await cluster.start()
    print(json.dumps({"zygote": cluster.launcher.zygote.pid, "workers": [w.pid for w in cluster.workers]}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_sigkilled_launcher_leaves_no_orphans():
    launcher = await asyncio.create_subprocess_exec(sys.executable, "-c", LAUNCHER, stdout=asyncio.subprocess.PIPE,
                                                    cwd=REPO)
    pids: list[int] = []
    try:
        assert launcher.stdout is not None
        line = await asyncio.wait_for(launcher.stdout.readline(), 60)
        assert line, "the launcher exited before its workers were ready"
        started = json.loads(line)
        pids = [started["zygote"], *started["workers"]]
        assert all(psutil.Process(pid).ppid() == started["zygote"] for pid in started["workers"])
        launcher.kill()
        await launcher.wait()
        await wait_until(lambda: not any(alive(pid) for pid in pids), 15,
                         "the zygote and its workers exit after the launcher was killed")
    finally:
        if launcher.returncode is None:
            launcher.kill()
            await launcher.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_a_spawn_passes_its_inherited_descriptor_by_the_number_the_child_has(tmp_path: Path, capfd):
    """The child's arguments name the inherited socket by its own fd number (INHERITED_FD is
    replaced), so the worker's option check sees that socket: here one that does not listen,
    which it refuses naming the number. A spawn that inherits without naming it is refused."""
    zygote = await Zygote.start(["engine.worker.__main__"], ready_timeout_s=60.0)
    wf = Workflow("inherit")
    wf.role("two", kind="llm", model="tiny-llama", tp_size=2)
    wf.input("x", "json")
    spec_path = tmp_path / "spec.json"
    spec_path.write_bytes(encode_spec(wf.to_spec()))
    unbound = socket.socket()
    try:
        with pytest.raises(ValueError, match="names it in its arguments"):
            await zygote.spawn(["--role", "two"], title="t", inherit=unbound.fileno())
        with pytest.raises(ValueError, match="names it in its arguments"):
            await zygote.spawn(["--tp-listen-fd", INHERITED_FD], title="t")
        child = await zygote.spawn(["--role", "two", "--workflow", str(spec_path), "--tp-address",
                                    "tcp://127.0.0.1:9", "--tp-listen-fd", INHERITED_FD],
                                   title="omniflow-test-inherit", inherit=unbound.fileno())
        assert await asyncio.wait_for(child.wait(), 30) == 1
    finally:
        unbound.close()
        await zygote.close(5.0)
    assert re.search(r"--tp-listen-fd \d+: not an open, listening TCP socket", capfd.readouterr().err)


def test_a_zygote_whose_launcher_is_gone_before_it_is_ready_exits_quietly():
    """A launcher that gives up while the zygote imports (a deployment stopped during its start)
    has closed the channel: the zygote's ready event finds no reader, and it exits 0 without a
    traceback on the studio's log."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.close()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "engine.worker.zygote", "--control-fd", str(theirs.fileno()),
             "--parent-pid", str(os.getpid())],
            pass_fds=[theirs.fileno()], capture_output=True, text=True, timeout=60, check=False,
        )
    finally:
        theirs.close()
    assert (done.returncode, done.stderr) == (0, "")
