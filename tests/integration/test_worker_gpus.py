"""`LocalCluster` seats each replica asking for GPUs on GPUs of its own (`engine.flow.gpus`).

The machine's GPUs come from a fake `nvidia-smi` on `PATH` (the workers run on the CPU: a GPU
index in `CUDA_VISIBLE_DEVICES` changes nothing for them). What each worker runs under is what
it reports itself (its READY line's `cuda_visible_devices`) and, for a worker the cluster spawns
without the fork server, its environment as the kernel shows it (`/proc/<pid>/environ`).
Every cluster is stopped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.flow.dsl import Workflow
from engine.flow.gpus import GpuPool
from engine.spec.graph import GraphSpec
from engine.worker.launcher import LaunchedWorker, LaunchError, LocalCluster


@pytest.fixture
def fake_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`fake_gpus(n)`: an `nvidia-smi` listing n GPUs comes first on PATH (0: none on PATH at all)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)

    def install(count: int) -> None:
        folder = tmp_path / "bin"
        folder.mkdir(exist_ok=True)
        script = folder / "nvidia-smi"
        if count:
            lines = "".join(f"{i}, NVIDIA Pretend, 81559\n" for i in range(count))
            script.write_text(f"#!/bin/sh\nprintf '{lines}'\n")
            script.chmod(0o755)
        # Only the fake (or nothing) answers to nvidia-smi: a real one on this machine is not consulted.
        path = [p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()]
        monkeypatch.setenv("PATH", os.pathsep.join([str(folder), *path]))

    return install


def spec(*, a: int = 2, tp_role: bool = False, gpus: int = 1) -> GraphSpec:
    """Role `a` (`a` replicas, `gpus` GPUs each), role `c` (none asked), and with `tp_role` a
    tensor-parallel llm role `lm` (2 ranks of one GPU each, on the CPU)."""
    wf = Workflow("gpus")
    wf.role("a", replicas=a, resources={"gpus": gpus})
    wf.role("c")
    if tp_role:
        wf.role("lm", kind="llm", model="tiny-llama", tp_size=2, resources={"gpus": 1}, params={"tp_timeout_s": 5.0})
    return wf.to_spec()


def visible(worker: LaunchedWorker) -> str | None:
    return worker.details["cuda_visible_devices"]


def by_role(cluster: LocalCluster) -> dict[str, list[LaunchedWorker]]:
    out: dict[str, list[LaunchedWorker]] = {}
    for worker in sorted(cluster.workers, key=lambda w: w.worker_id):
        out.setdefault(worker.role, []).append(worker)
    return out


async def test_replicas_get_distinct_gpus_tp_ranks_share_their_replicas_and_scaling_reuses_them(fake_gpus):
    fake_gpus(4)
    cluster = LocalCluster(spec(tp_role=True), allow_module_ops=True, ready_timeout_s=120.0)
    try:
        await cluster.start()
        roles = by_role(cluster)
        # The 2-GPU replica first, on 0 and 1; then one GPU per replica of `a`; `c` asked for none.
        [lm] = roles["lm"]
        assert [visible(w) for w in lm.processes] == ["0,1", "0,1"]
        assert [w.gpus for w in lm.processes] == [(0,), (1,)]
        assert sorted((visible(w), w.gpus) for w in roles["a"]) == [("2", (2,)), ("3", (3,))]
        [c] = roles["c"]
        assert (visible(c), c.gpus) == (None, ())
        assert cluster.gpus is not None and cluster.gpus.held == {0, 1, 2, 3}

        # A replica more: no GPU is free.
        with pytest.raises(LaunchError, match="needs 1 GPUs, the node has 4, held by others: 0, 1, 2, 3"):
            await cluster.spawn("a", 2)
        # One retired gives its GPU back; the next replica gets it.
        gone = next(w for w in roles["a"] if w.gpus == (3,))
        await cluster.retire(gone)
        assert cluster.gpus.held == {0, 1, 2}
        added = await cluster.spawn("a", 3)
        assert (visible(added), added.gpus) == ("3", (3,))
    finally:
        await cluster.stop()
    assert cluster.gpus.held == frozenset()


async def test_spawned_workers_have_the_variables_in_their_environment(fake_gpus):
    fake_gpus(2)
    cluster = LocalCluster(spec(), allow_module_ops=True, fork_server=False)
    try:
        await cluster.start()
        environments = {}
        for worker in by_role(cluster)["a"]:
            raw = Path(f"/proc/{worker.pid}/environ").read_bytes().split(b"\0")
            env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
            environments[worker.gpus] = (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"])
        assert environments == {(0,): ("0", "PCI_BUS_ID"), (1,): ("1", "PCI_BUS_ID")}
        [c] = by_role(cluster)["c"]
        assert b"CUDA_VISIBLE_DEVICES=" not in Path(f"/proc/{c.pid}/environ").read_bytes()
    finally:
        await cluster.stop()


async def test_too_few_gpus_is_a_launch_error_naming_the_replica(fake_gpus):
    fake_gpus(3)
    cluster = LocalCluster(spec(a=2, gpus=2), allow_module_ops=True)
    with pytest.raises(LaunchError, match=r"role 'a', replica 1: needs 2 GPUs, the node has 3, .* free: 2$"):
        await cluster.start()
    assert cluster.workers == []


async def test_a_machine_without_gpus_seats_nothing(fake_gpus):
    fake_gpus(0)
    cluster = LocalCluster(spec(), allow_module_ops=True)
    try:
        await cluster.start()
        assert [(visible(w), w.gpus) for w in cluster.workers] == [(None, ())] * 3
    finally:
        await cluster.stop()


async def test_clusters_sharing_a_pool_never_share_a_gpu(fake_gpus):
    fake_gpus(0)  # the pool says how many there are
    pool = GpuPool(3)
    first = LocalCluster(spec(a=2), allow_module_ops=True, gpus=pool)
    second = LocalCluster(spec(a=1), allow_module_ops=True, gpus=pool)
    try:
        await first.start()
        await second.start()
        assert sorted(visible(w) for w in by_role(first)["a"]) == ["0", "1"]
        assert [visible(w) for w in by_role(second)["a"]] == ["2"]
    finally:
        await second.stop()
        await first.stop()
    assert pool.held == frozenset()
