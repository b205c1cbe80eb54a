"""The distributed path with a real Celery worker (a subprocess, solo pool) acting as a node:
it consumes the node's queue `node.<name>` (deploy, stop_deployment) and a private run
queue (execute_run). Its role workers register in Redis; a run of the deployment executes
in the Celery worker and reaches them through the deployment's namespace. A node whose
`nvidia-smi` (a fake one, first on its PATH) lists GPUs starts each replica asking for one
with `CUDA_VISIBLE_DEVICES` naming its own, read back from the worker's environment. Over
REST a worker the node spawned reads `starting` until it registered, then `ready`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from django.apps import apps
from django.conf import settings

from studio.config import Dispatch
from studio.workflows.apps import build_engine
from studio.workflows.models import Deployment, Run, Worker
from studio.workflows.tasks import deploy as deploy_task
from tests import processes
from tests.studio.factories import create_workflow
from tests.studio.test_deployments import whoami_spec
from tests.studio.test_live_server import database_url

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis,
              pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL (the Celery broker)")]


@dataclasses.dataclass
class CeleryNode:
    node: str
    run_queue: str
    proc: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    env: dict[str, str]

    @classmethod
    def start(cls, node: str, run_queue: str, log: Path, env: dict[str, str],
              include: tuple[str, ...] = ()) -> CeleryNode:
        argv = [sys.executable, "-m", "celery", "-A", "studio", "worker", "-P", "solo", "-Q",
                f"{run_queue},node.{node}", "-n", f"{node}@%h", "--without-gossip", "--without-mingle",
                "--without-heartbeat", "-l", "info", *(["--include", ",".join(include)] if include else [])]
        with log.open("ab") as out:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        return cls(node, run_queue, proc, log, argv, env)

    def stop(self) -> None:
        """SIGTERM the Celery worker (its role workers, in sessions of their own, keep running)."""
        processes.stop(self.proc)

    def restart(self) -> None:
        """Start the Celery worker again, the same node with the same environment, and wait until ready."""
        readies = self.log.read_bytes().count(b" ready.")
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.wait_for("the Celery worker ready again", lambda: self.log.read_bytes().count(b" ready.") > readies)

    def wait_for(self, what: str, check: Callable[[], bool], deadline_s: float = 60.0) -> None:
        """Poll `check` (the database) until true; the pause doubles as a check that the worker lives."""
        deadline = time.monotonic() + deadline_s
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not within {deadline_s} s; worker log:\n{self.log.read_text()[-3000:]}")
            try:
                self.proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                continue
            raise RuntimeError(f"the Celery worker exited:\n{self.log.read_text()[-3000:]}")


def node_environment(tmp: Path, node: str, run_queue: str, extra_env: dict[str, str] | None) -> dict[str, str]:
    """A node's Celery worker's environment: the test's, the node's settings, then `extra_env`."""
    return {**os.environ, "DJANGO_SETTINGS_MODULE": "studio.settings", "DATABASE_URL": database_url(),
            "OMNIFLOW_DISPATCH": "celery", "OMNIFLOW_NODE": node, "OMNIFLOW_RUN_QUEUE": run_queue,
            "OMNIFLOW_ALLOW_MODULE_OPS": "1", "OMNIFLOW_DATA_DIR": str(tmp / "data"),
            "OMNIFLOW_NODE_SUPERVISE_S": "0.3", "OMNIFLOW_WORKER_MAX_RESTARTS": "2",
            "PYTHONPATH": str(ROOT), **(extra_env or {})}


def started_node(tmp: Path, extra_env: dict[str, str] | None = None, include: tuple[str, ...] = ()) -> CeleryNode:
    """A fresh node's Celery worker, started (not yet ready: `CeleryNode.wait_for` its ` ready.`),
    with the task modules `include` besides the studio's."""
    tag = uuid.uuid4().hex[:8]
    node, run_queue = f"test-{tag}", f"omniflow-test-{tag}"
    log = tmp / f"celery-{tag}.log"
    return CeleryNode.start(node, run_queue, log, node_environment(tmp, node, run_queue, extra_env), include)


def wait_ready(worker: CeleryNode) -> None:
    worker.wait_for("the Celery worker ready", lambda: b" ready." in worker.log.read_bytes())


def leftover_workers(node: str) -> list[psutil.Process]:
    """The role worker processes of `node` whose rows a test left (a failed one: a passing test stops
    its deployments), alive or not yet reaped."""
    left = []
    for row in Worker.objects.filter(host=node):
        with contextlib.suppress(psutil.NoSuchProcess):  # gone, or a zombie of the node's Celery worker
            if row.pid and row.worker_id in " ".join(psutil.Process(row.pid).cmdline()):
                left.append(psutil.Process(row.pid))
    return left


@contextlib.contextmanager
def dispatching_to(worker: CeleryNode, **studio_changes: Any) -> Iterator[CeleryNode]:
    """This process's studio engine dispatching to the node `worker` (its config: `studio_changes` on
    top of the settings'), replaced by the previous one after."""
    config = dataclasses.replace(settings.OMNIFLOW, allow_module_ops=True, dispatch=Dispatch.CELERY,
                                 node_name=worker.node, deploy_node=worker.node, run_queue=worker.run_queue,
                                 **studio_changes)
    app = apps.get_app_config("workflows")
    studio = build_engine(config)
    previous = app.install(studio)
    try:
        yield worker
    finally:
        studio.runs.stop()
        app.install(previous)


@contextlib.contextmanager
def running_node(tmp_path: Path, extra_env: dict[str, str] | None = None,
                 **studio_changes: Any) -> Iterator[CeleryNode]:
    """A Celery node of its own (its environment: `extra_env` on top of the test's) and this process's
    studio engine dispatching to it (its config: `studio_changes` on top of the settings')."""
    worker = started_node(tmp_path, extra_env)
    try:
        with dispatching_to(worker, **studio_changes):
            wait_ready(worker)
            yield worker
    finally:
        if worker.proc.poll() is None:
            worker.stop()
        for process in leftover_workers(worker.node):
            process.kill()


class SharedNode:
    """One node's Celery worker for the tests of this module that need no node environment of their
    own (starting one costs seconds of imports); its OMNIFLOW_MODEL_DIRS holds `models`, a folder
    empty until a test exports a checkpoint into it. A test that leaves role workers running (a
    failed one) has the node stopped with them, and the next test gets a fresh one."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.models = (tmp / "models").resolve()
        self.worker: CeleryNode | None = None

    def acquire(self) -> CeleryNode:
        if self.worker is None or self.worker.proc.poll() is not None:
            self.worker = started_node(self.tmp, {"OMNIFLOW_MODEL_DIRS": str(self.models)})
            wait_ready(self.worker)
        return self.worker

    def release(self) -> None:
        """After a test: stop the node if the test left role workers (or the node) behind, and them."""
        if self.worker is None:
            return
        left = leftover_workers(self.worker.node)
        if left or self.worker.proc.poll() is not None:
            self.close()
            for process in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()

    def close(self) -> None:
        if self.worker is not None and self.worker.proc.poll() is None:
            self.worker.stop()
        self.worker = None


@pytest.fixture(scope="module")
def shared_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedNode]:
    shared = SharedNode(tmp_path_factory.mktemp("celery-node"))
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
def celery_node(shared_node: SharedNode) -> Iterator[CeleryNode]:
    """The module's node, this test's studio engine dispatching to it."""
    worker = shared_node.acquire()
    try:
        with dispatching_to(worker, model_dirs=(shared_node.models,)):
            yield worker
    finally:
        shared_node.release()


FAKE_GPUS = 3


@pytest.fixture
def gpu_node(tmp_path: Path) -> Iterator[CeleryNode]:
    """A node on whose PATH a fake `nvidia-smi` lists `FAKE_GPUS` GPUs (and no other one answers)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    lines = "".join(f"{i}, NVIDIA Pretend, 16384\n" for i in range(FAKE_GPUS))
    (folder / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{lines}'\n")
    (folder / "nvidia-smi").chmod(0o755)
    path = [p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()]
    env = {"PATH": os.pathsep.join([str(folder), *path]), "CUDA_VISIBLE_DEVICES": "", "OMNIFLOW_NODE_GPUS": ""}
    with running_node(tmp_path, env) as node:
        yield node


CHECKPOINT = "org/tiny"


@pytest.fixture
def checkpoint_node(celery_node: CeleryNode, shared_node: SharedNode) -> tuple[CeleryNode, Path]:
    """The module's node (and this studio) whose OMNIFLOW_MODEL_DIRS holds the checkpoint `CHECKPOINT`:
    tiny-llama exported there by this test, so no other process of the host has loaded it. Its path."""
    from engine.compute.models import export_model

    checkpoint = export_model("tiny-llama", shared_node.models / CHECKPOINT)
    return celery_node, checkpoint


def checkpoint_spec(model: str) -> dict[str, Any]:
    """A prompt through one `llm` node on a role of the checkpoint `model`."""
    return {
        "version": 1,
        "name": "ckptchat",
        "roles": [{"name": "lm", "kind": "llm", "model": model, "params": {"page_size": 4}}],
        "nodes": [
            {"id": "prompt", "kind": "input", "outputs": {"value": {"type": "text"}}},
            {"id": "gen", "kind": "llm", "role": "lm", "params": {"max_new_tokens": 4},
             "inputs": {"prompt": {"type": "text"}},
             "outputs": {"text": {"type": "text"}, "tokens": {"type": "tokens"}, "kv": {"type": "kv"},
                         "usage": {"type": "json"}}},
            {"id": "tokens", "kind": "output", "inputs": {"value": {"type": "tokens"}}},
        ],
        "edges": [
            {"source": "prompt", "source_port": "value", "target": "gen", "target_port": "prompt"},
            {"source": "gen", "source_port": "tokens", "target": "tokens", "target_port": "value"},
        ],
    }


def live_rows(deployment_id: str) -> list[Worker]:
    return list(Worker.objects.filter(deployment_id=deployment_id, status="ready").order_by("worker_id"))


def test_deploy_run_scale_stop_through_a_celery_node(celery_node: CeleryNode, api: Any) -> None:
    wf = create_workflow(api, whoami_spec())
    response = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json")
    assert response.status_code == 201, response.content
    d = response.json()
    assert d["node"] == celery_node.node and d["status"] == "pending"
    celery_node.wait_for("running", lambda: Deployment.objects.get(pk=d["id"]).status == "running")
    rows = live_rows(d["id"])
    assert [(r.role, r.host) for r in rows] == [("py", celery_node.node)]
    assert os.getsid(rows[0].pid) == rows[0].pid  # a session of its own: it outlives the task

    # the run executes in the Celery worker, its node on the deployment's role worker
    run = api.post("/api/runs/", {"deployment": d["id"], "inputs": {"text": "far"}}, format="json").json()
    celery_node.wait_for("the run", lambda: Run.objects.get(pk=run["id"]).finished)
    done = Run.objects.get(pk=run["id"])
    assert done.status == "done", done.error
    assert done.outputs["result"] == {"text": "FAR", "pid": rows[0].pid}

    # a redelivered deploy finds the workers alive and starts nothing
    assert deploy_task.apply(args=[d["id"]]).get() == {"started": [], "stopped": [], "lost": []}
    assert [r.worker_id for r in live_rows(d["id"])] == [rows[0].worker_id]

    assert api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 2},
                    format="json").status_code == 200
    celery_node.wait_for("two workers", lambda: len(live_rows(d["id"])) == 2)
    workers = api.get("/api/workers/").json()
    assert sorted(w["info"]["worker_id"] for w in workers) == [r.worker_id for r in live_rows(d["id"])]

    pids = [r.pid for r in live_rows(d["id"])]
    assert api.post(f"/api/deployments/{d['id']}/stop/").json()["status"] == "stopping"
    celery_node.wait_for("stopped", lambda: Deployment.objects.get(pk=d["id"]).status == "stopped")
    assert not live_rows(d["id"])
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)
    assert api.get("/api/workers/").json() == []
    assert deploy_task.apply(args=[d["id"]]).get() is None  # a stopped deployment stays stopped


def test_a_node_replaces_a_worker_that_died_until_too_many_are_lost(celery_node: CeleryNode, api: Any) -> None:
    """No deploy in between: the node's Celery worker finds the dead worker, marks it lost and
    starts another, and runs go to the new one; once more than OMNIFLOW_WORKER_MAX_RESTARTS (2)
    replicas in a row were lost young it stops replacing them and says so on the deployment."""
    wf = create_workflow(api, whoami_spec())
    d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    celery_node.wait_for("running", lambda: Deployment.objects.get(pk=d["id"]).status == "running")
    (first,) = live_rows(d["id"])

    psutil.Process(first.pid).kill()
    celery_node.wait_for("a replacement", lambda: [r.worker_id for r in live_rows(d["id"])] not in ([], [first.worker_id]))
    (second,) = live_rows(d["id"])
    assert Worker.objects.get(worker_id=first.worker_id).status == "lost"
    run = api.post("/api/runs/", {"deployment": d["id"], "inputs": {"text": "again"}}, format="json").json()
    celery_node.wait_for("the run", lambda: Run.objects.get(pk=run["id"]).finished)
    done = Run.objects.get(pk=run["id"])
    assert done.status == "done" and done.outputs["result"]["pid"] == second.pid, done.error

    psutil.Process(second.pid).kill()
    celery_node.wait_for("a second replacement", lambda: [r.worker_id for r in live_rows(d["id"])]
                         not in ([], [second.worker_id]))
    (third,) = live_rows(d["id"])
    psutil.Process(third.pid).kill()
    celery_node.wait_for("the third loss given up on", lambda: Deployment.objects.get(pk=d["id"]).error.startswith(
        "role 'py': 3 replicas in a row were lost within 60 s of starting"))
    assert [Worker.objects.get(worker_id=w.worker_id).status for w in (first, second, third)] == ["lost"] * 3
    assert live_rows(d["id"]) == [] and Deployment.objects.get(pk=d["id"]).status == "running"

    api.post(f"/api/deployments/{d['id']}/stop/")
    celery_node.wait_for("stopped", lambda: Deployment.objects.get(pk=d["id"]).status == "stopped")


def test_a_tp_role_through_a_celery_node_runs_its_ranks_and_loses_them_together(celery_node: CeleryNode,
                                                                                   api: Any) -> None:
    from engine.worker.launcher import rank_worker_id
    from tests.studio.test_deployments import tp_chat_spec

    wf = create_workflow(api, tp_chat_spec())
    d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    celery_node.wait_for("running", lambda: Deployment.objects.get(pk=d["id"]).status == "running", 120.0)
    leader, follower = live_rows(d["id"])
    assert follower.worker_id == rank_worker_id(leader.worker_id, 1) and follower.address == ""
    assert leader.address and psutil.pid_exists(follower.pid)

    run = api.post("/api/runs/", {"deployment": d["id"], "inputs": {"prompt": "split heads"}}, format="json").json()
    celery_node.wait_for("the run", lambda: Run.objects.get(pk=run["id"]).finished, 120.0)
    done = Run.objects.get(pk=run["id"])
    assert done.status == "done", done.error
    assert len(done.outputs["tokens"]) == 6

    # A rank that dies loses the whole replica: the node's supervision, or the next deploy, whichever
    # comes first, ends the rest and starts a fresh one.
    psutil.Process(follower.pid).kill()
    celery_node.wait_for("the killed rank gone", lambda: not psutil.pid_exists(follower.pid)
                         or psutil.Process(follower.pid).status() == psutil.STATUS_ZOMBIE)
    assert api.post(f"/api/deployments/{d['id']}/scale/", {"role": "lm", "replicas": 1},
                    format="json").status_code == 200  # the same count: the node reconciles
    old = {leader.worker_id, follower.worker_id}
    celery_node.wait_for("a fresh replica", lambda: {r.worker_id for r in live_rows(d["id"])}.isdisjoint(old)
                         and len(live_rows(d["id"])) == 2, 120.0)
    assert {r.worker_id: r.status for r in Worker.objects.filter(worker_id__in=old)} == dict.fromkeys(old, "lost")
    fresh = live_rows(d["id"])
    assert not psutil.pid_exists(leader.pid) or psutil.Process(leader.pid).status() == psutil.STATUS_ZOMBIE

    pids = [r.pid for r in fresh]
    api.post(f"/api/deployments/{d['id']}/stop/")
    celery_node.wait_for("stopped", lambda: Deployment.objects.get(pk=d["id"]).status == "stopped")
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


def environment(pid: int) -> dict[str, str]:
    """A process's environment as the kernel shows it (what it was started with)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_a_gpu_node_starts_each_replica_on_gpus_of_its_own(gpu_node: CeleryNode, api: Any) -> None:
    spec = whoami_spec(replicas=2)
    spec["roles"][0]["resources"] = {"gpus": 1}
    wf = create_workflow(api, spec)
    preview = api.post("/api/nodes/placement/", {"workflow": wf["id"]}, format="json").json()
    assert [(s["node"], s["gpus"]) for s in preview["placement"]] == [(gpu_node.node, [0]), (gpu_node.node, [1])]

    d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    gpu_node.wait_for("running", lambda: Deployment.objects.get(pk=d["id"]).status == "running")

    def seen() -> list[tuple[list[int], str]]:
        return sorted((r.gpus, environment(r.pid)["CUDA_VISIBLE_DEVICES"]) for r in live_rows(d["id"]))

    assert seen() == [([0], "0"), ([1], "1")]
    assert all(environment(r.pid)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for r in live_rows(d["id"]))
    detail = api.get(f"/api/deployments/{d['id']}/").json()
    assert sorted(w["gpus"] for w in detail["workers"]) == [[0], [1]]
    assert sorted(s["gpus"] for s in detail["placement"]["slots"]) == [[0], [1]]
    (node,) = [n for n in api.get("/api/nodes/").json() if n["name"] == gpu_node.node]
    assert [g["index"] for g in node["gpus"]] == [0, 1, 2]
    assert sorted(w["gpus"] for w in node["workers"]) == [[0], [1]]

    # One more replica takes the GPU left; scaling down keeps replica 0 on its GPU.
    assert api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 3},
                    format="json").status_code == 200
    gpu_node.wait_for("three workers", lambda: len(live_rows(d["id"])) == 3)
    assert seen() == [([0], "0"), ([1], "1"), ([2], "2")]
    refused = api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 4}, format="json")
    assert refused.status_code == 409 and "needs 1 GPU, 0 free" in refused.json()["error"], refused.content
    assert api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 1},
                    format="json").status_code == 200
    gpu_node.wait_for("one worker", lambda: len(live_rows(d["id"])) == 1)
    assert seen() == [([0], "0")]

    api.post(f"/api/deployments/{d['id']}/stop/")
    gpu_node.wait_for("stopped", lambda: Deployment.objects.get(pk=d["id"]).status == "stopped")


def test_a_nodes_worker_row_reads_starting_over_the_api_until_it_registers_then_ready(
        checkpoint_node: tuple[CeleryNode, Path], api: Any) -> None:
    """Over REST, as the deploy dialog reads it: the llm worker a Celery node spawned is `starting`
    (its host, pid, replica) for as long as it has not registered, then the same row is `ready`.
    It is held starting by the host lock of its model's weights, which the test takes as another
    process of the host loading that model would (`HostWeights.publishing`): the worker waits for
    it, and once it is let go loads the model itself, registers and serves."""
    from engine.compute.weights.shared import HostWeights
    from engine.compute.weights.store import WeightStore

    node, checkpoint = checkpoint_node
    wf = create_workflow(api, checkpoint_spec(CHECKPOINT))
    seen: dict[str, list[str]] = {}  # worker id -> the statuses the API showed it in, in order

    def detail(deployment_id: str) -> dict[str, Any]:
        body = api.get(f"/api/deployments/{deployment_id}/").json()
        for row in body["workers"]:
            states = seen.setdefault(row["worker_id"], [])
            if states[-1:] != [row["status"]]:
                states.append(row["status"])
        return body

    def starting(deployment_id: str) -> bool:
        return any(row["status"] == "starting" for row in detail(deployment_id)["workers"])

    with HostWeights().publishing(str(WeightStore.llm_key(str(checkpoint))), wait_s=0) as locked:
        assert locked, "another process of this host holds the test checkpoint's weights lock"
        response = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json")
        assert response.status_code == 201, response.content
        d = response.json()
        node.wait_for("a worker row starting", lambda: starting(d["id"]))
        shown = detail(d["id"])
        (row,) = shown["workers"]
        assert (row["role"], row["status"], row["host"], row["replica"], row["error"]) == (
            "lm", "starting", node.node, 0, "")
        assert row["pid"] is not None and psutil.pid_exists(row["pid"])
        assert shown["status"] == "starting"

    node.wait_for("the deployment running", lambda: detail(d["id"])["status"] == "running", 120.0)
    (ready,) = detail(d["id"])["workers"]
    assert (ready["worker_id"], ready["status"], ready["pid"]) == (row["worker_id"], "ready", row["pid"])
    assert ready["address"].startswith("tcp://") and ready["live"] is not None
    assert seen == {row["worker_id"]: ["starting", "ready"]}

    run = api.post("/api/runs/", {"deployment": d["id"], "inputs": {"prompt": "held, then loaded"}},
                   format="json").json()
    node.wait_for("the run", lambda: Run.objects.get(pk=run["id"]).finished, 120.0)
    done = Run.objects.get(pk=run["id"])
    assert done.status == "done", done.error
    assert len(done.outputs["tokens"]) == 4

    api.post(f"/api/deployments/{d['id']}/stop/")
    node.wait_for("stopped", lambda: Deployment.objects.get(pk=d["id"]).status == "stopped")
    assert [w["status"] for w in detail(d["id"])["workers"]] == ["stopped"]
