"""Runs of the Celery mode never stay stuck, with real Celery workers (subprocesses, solo pool)
on a private run queue and a 3 s lease: a worker SIGKILLed mid-run (the run held at a gate
node until the test opens it) is noticed by the other worker's sweep within two lease
periods, and the run is executed again (or failed, with OMNIFLOW_RUN_LEASE_RETRIES=0); a chat
session whose turn's worker died takes the next turn; cancel ends a run queued, running, or
whose worker died."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
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
from django.utils import timezone

from studio.config import Dispatch
from studio.errors import Conflict
from studio.workflows.apps import build_engine
from studio.workflows.chat import turns
from studio.workflows.chat.openai import ChatSampling, parse_messages
from studio.workflows.models import Deployment, Run, RunEvent, Worker
from studio.workflows.runs.lease import RUN_RESTARTED
from tests import processes
from tests.studio.factories import create_workflow, spec_doc
from tests.studio.test_live_server import database_url
from tests.studio.test_run_leases import stored_run, wait_until

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 3.0
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis,
              pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL (the Celery broker)")]


@dataclasses.dataclass
class CeleryWorker:
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        processes.stop(self.proc)


@dataclasses.dataclass
class Cluster:
    """Celery workers sharing one run queue (and, when asked, a node's queue)."""

    tmp: Path
    node: str
    run_queue: str
    retries: int
    workers: list[CeleryWorker] = dataclasses.field(default_factory=list)

    def start(self, name: str, queues: list[str]) -> CeleryWorker:
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "studio.settings", "DATABASE_URL": database_url(),
               "OMNIFLOW_DISPATCH": "celery", "OMNIFLOW_NODE": self.node, "OMNIFLOW_RUN_QUEUE": self.run_queue,
               "OMNIFLOW_ALLOW_MODULE_OPS": "1", "OMNIFLOW_DATA_DIR": str(self.tmp / "data"),
               "OMNIFLOW_RUN_LEASE_S": str(LEASE_S), "OMNIFLOW_RUN_LEASE_RETRIES": str(self.retries),
               "OMNIFLOW_WORKER_RESTART": "0", "PYTHONPATH": str(ROOT)}
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "studio", "worker", "-P", "solo", "-Q", ",".join(queues),
                 "-n", f"{name}-{self.node}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat",
                 "-l", "info"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        worker = CeleryWorker(proc, log)
        self.workers.append(worker)
        return worker

    def ready(self) -> None:
        for worker in self.workers:
            wait_until(f"{worker.log.name} ready", lambda w=worker: self._ready(w), 180)

    @staticmethod
    def _ready(worker: CeleryWorker) -> bool:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"a Celery worker exited:\n{worker.log.read_text()[-3000:]}")
        return b" ready." in worker.log.read_bytes()

    def holder(self, run_id: str) -> CeleryWorker:
        """The worker holding the run's lease (its pid is in the lease owner id)."""
        owner = Run.objects.get(pk=run_id).lease_owner
        pid = int(owner.split(":")[2])
        return next(w for w in self.workers if w.proc.pid == pid)

    def logs(self) -> str:
        return "\n".join(f"--- {w.log.name}\n{w.log.read_text()[-2500:]}" for w in self.workers)


def cluster_fixture(retries: int, with_node: bool) -> Callable[..., Iterator[Cluster]]:
    @pytest.fixture
    def fixture(tmp_path: Path) -> Iterator[Cluster]:
        tag = uuid.uuid4().hex[:8]
        cluster = Cluster(tmp_path, f"lease-{tag}", f"omniflow-lease-{tag}", retries)
        if with_node:
            cluster.start("node", [f"node.{cluster.node}"])
        for name in ("runs-a", "runs-b"):
            cluster.start(name, [cluster.run_queue])
        config = dataclasses.replace(settings.OMNIFLOW, allow_module_ops=True, dispatch=Dispatch.CELERY,
                                     node_name=cluster.node, deploy_node=cluster.node, run_queue=cluster.run_queue,
                                     run_lease_s=LEASE_S, run_lease_retries=retries)
        app = apps.get_app_config("workflows")
        studio = build_engine(config)
        previous = app.install(studio)
        try:
            cluster.ready()
            yield cluster
        finally:
            (tmp_path / "gate" / "open").parent.mkdir(exist_ok=True)
            (tmp_path / "gate" / "open").touch()  # whatever still waits at a gate ends
            for worker in cluster.workers:
                worker.stop()
            for row in Worker.objects.filter(host=cluster.node):  # role workers a failed test left running
                with contextlib.suppress(psutil.NoSuchProcess):
                    if row.pid and row.worker_id in " ".join(psutil.Process(row.pid).cmdline()):
                        psutil.Process(row.pid).kill()
            studio.runs.stop()
            app.install(previous)

    return fixture


rerunning = cluster_fixture(retries=1, with_node=True)
failing = cluster_fixture(retries=0, with_node=False)


def gate_dir(tmp: Path) -> Path:
    path = tmp / "gate"
    path.mkdir(exist_ok=True)
    return path


def started(gate: Path) -> list[Path]:
    return sorted(gate.glob("started-*"))


def gated_spec(gate: Path) -> dict[str, Any]:
    spec = spec_doc(name="gated", op="tests.studio.fns:gate_file")
    spec["nodes"][1]["params"] = {"gate": str(gate)}
    return spec


def gated_chat_spec(gate: Path) -> dict[str, Any]:
    """A chat workflow whose prompt waits at a gate (on the deployment's python role) before
    the tiny LLM answers it."""
    return {
        "version": 1,
        "name": "gatedchat",
        "roles": [{"name": "lm", "kind": "llm", "model": "tiny-llama", "params": {"page_size": 4}},
                  {"name": "py", "kind": "python"}],
        "nodes": [
            {"id": "prompt", "kind": "input", "outputs": {"value": {"type": "text"}}},
            {"id": "gate", "kind": "python", "role": "py", "op": "tests.studio.fns:gate_file",
             "params": {"gate": str(gate)}, "inputs": {"text": {"type": "text"}},
             "outputs": {"out": {"type": "text"}}},
            {"id": "reply", "kind": "llm", "role": "lm", "params": {"max_new_tokens": 4},
             "inputs": {"prompt": {"type": "text"}},
             "outputs": {"text": {"type": "text"}, "tokens": {"type": "tokens"}, "kv": {"type": "kv"}}},
            {"id": "text", "kind": "output", "inputs": {"value": {"type": "text"}}},
        ],
        "edges": [
            {"source": "prompt", "source_port": "value", "target": "gate", "target_port": "text"},
            {"source": "gate", "source_port": "out", "target": "reply", "target_port": "prompt"},
            {"source": "reply", "source_port": "text", "target": "text", "target_port": "value"},
        ],
    }


def kill(worker: CeleryWorker) -> float:
    """SIGKILL the worker; when it died (epoch seconds)."""
    worker.proc.kill()
    worker.proc.wait(timeout=10)
    return time.time()


def restart_event(run_id: str) -> dict[str, Any]:
    return RunEvent.objects.get(run_id=run_id, type=RUN_RESTARTED).data


@pytest.mark.timeout(300)  # three Celery workers and a deployment with a model role start on a busy machine
def test_a_chat_turn_whose_celery_worker_is_killed_is_run_again_and_the_session_takes_the_next_turn(
        rerunning: Cluster, api: Any, user: Any) -> None:
    gate = gate_dir(rerunning.tmp)
    wf = create_workflow(api, gated_chat_spec(gate))
    response = api.post("/api/deployments/", {"workflow": wf["id"], "name": "gated"}, format="json")
    assert response.status_code == 201, response.content
    d = response.json()
    wait_until("the deployment running", lambda: Deployment.objects.get(pk=d["id"]).status == "running", 120)
    session = api.post("/api/sessions/", {"deployment": d["id"]}, format="json").json()
    hello = parse_messages([{"role": "user", "content": "hello"}], "content", roles=("user",))
    turn = turns.start_session_turn(user, session["id"], hello, ChatSampling(), 120.0)

    wait_until("the turn at its gate", lambda: started(gate) or Run.objects.get(pk=turn.run_id).finished)
    assert len(started(gate)) == 1, (Run.objects.get(pk=turn.run_id).error, rerunning.logs())
    holder = rerunning.holder(turn.run_id)
    killed_at = kill(holder)
    with pytest.raises(Conflict, match="turn in flight"):  # the run is not over yet: the session is busy
        turns.start_session_turn(user, session["id"], hello, ChatSampling(), 120.0)
    (gate / "open").touch()

    wait_until("the turn's run ended", lambda: Run.objects.get(pk=turn.run_id).finished, 60)
    run = Run.objects.get(pk=turn.run_id)
    assert run.status == "done" and run.attempts == 2, (run.error, rerunning.logs())
    restart = restart_event(turn.run_id)
    assert restart["time"] - killed_at <= 2 * LEASE_S, restart
    assert restart["error"].startswith("the worker executing this run stopped (lease expired at ")
    assert run.lease_owner and int(run.lease_owner.split(":")[2]) != holder.proc.pid
    events = list(RunEvent.objects.filter(run_id=turn.run_id).order_by("seq").values_list("seq", "type"))
    assert [seq for seq, _ in events] == list(range(len(events)))
    types = [t for _, t in events]  # the killed attempt may have stored none of its events yet
    assert types[types.index(RUN_RESTARTED) + 1] == "run_started" and types[-1] == "run_finished"
    assert isinstance(run.outputs["text"], str)

    follow = turns.start_session_turn(user, session["id"], hello, ChatSampling(), 120.0)  # the session is free again
    wait_until("the next turn", lambda: Run.objects.get(pk=follow.run_id).finished, 60)
    assert Run.objects.get(pk=follow.run_id).status == "done"

    api.post(f"/api/deployments/{d['id']}/stop/")
    wait_until("stopped", lambda: Deployment.objects.get(pk=d["id"]).status == "stopped", 60)


@pytest.mark.timeout(240)
def test_a_run_whose_celery_worker_is_killed_fails_and_cancel_works_in_every_state(
        failing: Cluster, api: Any, user: Any) -> None:
    gate = gate_dir(failing.tmp)
    wf = create_workflow(api, gated_spec(gate))

    # queued, not started: it ends at once, and a worker that gets it later does nothing
    queued = stored_run(user, wf, str(gate))
    response = api.post(f"/api/runs/{queued.pk}/cancel/")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"

    # running in a live worker: its lease holder cancels it
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "a"}}, format="json").json()
    wait_until("the run at its gate", lambda: len(started(gate)) == 1)
    response = api.post(f"/api/runs/{run['id']}/cancel/")
    assert response.status_code in (200, 202), response.content
    wait_until("cancelled", lambda: Run.objects.get(pk=run["id"]).finished)
    done = Run.objects.get(pk=run["id"])
    assert (done.status, done.error) == ("cancelled", "cancelled by request"), failing.logs()

    # its worker killed: the other worker's sweep fails it within two lease periods
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "b"}}, format="json").json()
    wait_until("the run at its gate", lambda: len(started(gate)) == 2)
    holder = failing.holder(run["id"])
    killed_at = kill(holder)
    wait_until("failed", lambda: Run.objects.get(pk=run["id"]).finished, 4 * LEASE_S)
    failed = Run.objects.get(pk=run["id"])
    assert failed.status == "failed" and failed.attempts == 1, failing.logs()
    assert failed.error.startswith("the worker executing this run stopped (lease expired at ")
    assert failed.finished_at.timestamp() - killed_at <= 2 * LEASE_S
    assert not RunEvent.objects.filter(run_id=run["id"], type=RUN_RESTARTED).exists()

    # the last worker killed too, nobody left to sweep: cancel ends the run once its lease lapsed
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "c"}}, format="json").json()
    wait_until("the run at its gate", lambda: len(started(gate)) == 3)
    kill(failing.holder(run["id"]))
    wait_until("the lease lapsed", lambda: Run.objects.get(pk=run["id"]).lease_expires_at
               < timezone.now() - dt.timedelta(seconds=0.1), 4 * LEASE_S)
    response = api.post(f"/api/runs/{run['id']}/cancel/")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "cancelled"
    assert body["error"].startswith("cancelled by request; the worker executing this run stopped")
