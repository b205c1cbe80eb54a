"""Deployments in the embedded mode: the studio process starts a version's role workers
(real worker processes, registered in Redis under the deployment's namespace), runs
submitted against the deployment execute on them, roles scale up and down, and stopping
ends the processes. Plus every kind of bad input the API refuses."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import zmq
from django.apps import apps
from django.conf import settings

from engine.data.codec import WireCodec
from engine.data.curve import PlaneKeys, connect_as_client
from engine.data.wire import PROTOCOL_VERSION, HelloRequest, WorkerMessage
from engine.flow.discovery import make_registry
from studio.asgi import EngineStartup
from studio.workflows.apps import StudioEngine, build_engine
from studio.workflows.deployments.service import Resumed, create_deployment, resume_embedded
from studio.workflows.models import Deployment, Worker, WorkflowVersion
from tests.studio.conftest import client_for
from tests.studio.factories import create_workflow, spec_doc

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def settle(studio: StudioEngine, deployment_id: str) -> None:
    """Wait until the deploy/stop handed to the engine loop has finished (readiness)."""
    studio.runs.call(studio.deployments.settled(deployment_id)).result(60)


def whoami_spec(replicas: int = 1) -> dict[str, Any]:
    spec = spec_doc(name="whoami", op="tests.studio.fns:whoami")
    spec["roles"][0]["replicas"] = replicas
    spec["nodes"][1]["outputs"] = {"out": {"type": "json"}}
    spec["nodes"][2]["inputs"] = {"value": {"type": "json"}}
    return spec


def registered(namespace: str) -> list[str]:
    async def read() -> list[str]:
        registry = make_registry(settings.OMNIFLOW.redis_url, namespace=namespace)
        try:
            return [s.worker_id for s in await registry.workers()]
        finally:
            await registry.close()

    return asyncio.run(read())


@pytest.fixture
def whoami_wf(api: Any) -> dict[str, Any]:
    return create_workflow(api, whoami_spec())


def deploy(api: Any, studio: StudioEngine, body: dict[str, Any]) -> dict[str, Any]:
    response = api.post("/api/deployments/", body, format="json")
    assert response.status_code == 201, response.content
    settle(studio, response.json()["id"])
    return api.get(f"/api/deployments/{response.json()['id']}/").json()


def hello_answered(address: str, keys: PlaneKeys | None) -> bool:
    """Whether a worker's control socket answers a hello from a client with `keys` (None:
    plaintext) within a bounded wait."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        connect_as_client(sock, keys)
        sock.connect(address)
        sock.send(WireCodec(1 << 20, WorkerMessage).encode(HelloRequest(PROTOCOL_VERSION, "test", "127.0.0.1")))
        return bool(sock.poll(2000 if keys is None else 15000))
    finally:
        sock.close()
        context.term()


def foreign_hello_answered(address: str, server_public: str) -> bool:
    """Whether a worker answers a hello over CURVE from a keypair of another plane (knowing the
    worker's public key, which is no secret) within a bounded wait."""
    own = PlaneKeys.generate()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_publickey, sock.curve_secretkey = own.public.encode(), own.secret.encode()
        sock.curve_serverkey = server_public.encode()
        sock.connect(address)
        sock.send(WireCodec(1 << 20, WorkerMessage).encode(HelloRequest(PROTOCOL_VERSION, "test", "127.0.0.1")))
        return bool(sock.poll(2000))
    finally:
        sock.close()
        context.term()


def refused_total(client: Any, deployment: str, worker: str) -> float | None:
    """The worker's `omniflow_worker_plane_refused_total` on /metrics (None: no such series yet)."""
    series = f'omniflow_worker_plane_refused_total{{deployment="{deployment}",role="py",worker="{worker}"}} '
    for line in client.get("/metrics").content.decode().splitlines():
        if line.startswith(series):
            return float(line[len(series):])
    return None


def wait_for_refused(client: Any, deployment: str, worker: str, ready: Callable[[float | None], bool],
                     deadline_s: float = 20.0) -> float | None:
    """The counter once `ready` holds for it (the worker reports it with its heartbeats)."""
    deadline = time.monotonic() + deadline_s
    while not ready(value := refused_total(client, deployment, worker)):
        assert time.monotonic() < deadline, f"refused connections of {worker}: still {value} after {deadline_s} s"
        time.sleep(0.05)
    return value


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_a_server_start_starts_what_was_recorded_to_start_and_warns_only_of_what_a_process_hosted(
        user: Any, studio_engine: StudioEngine, whoami_wf: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    # As `manage.py setup_demo` does before `make run` serves: recorded, pending, left to the server.
    version = WorkflowVersion.objects.get(workflow_id=whoami_wf["id"], number=1)
    recorded = str(create_deployment(user, version, name="demo", start_workers=False).pk)
    assert Deployment.objects.get(pk=recorded).status == "pending" and not Worker.objects.filter(
        deployment_id=recorded).exists()
    startup = EngineStartup(studio_engine, inner=None, enabled=True)  # the server's first request
    with caplog.at_level("INFO", logger="studio.asgi"):
        try:
            asyncio.run(startup.ensure())
        finally:
            studio_engine.history.stop()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "studio.asgi"]
    assert said == [("INFO", "starting 1 deployment(s) recorded to start with the server")]  # a new database
    settle(studio_engine, recorded)
    assert Deployment.objects.get(pk=recorded).status == "running"
    # The next process start finds it hosted (running, its workers recorded): deployed again, and it says so.
    assert resume_embedded() == Resumed(started=[], redeployed=[recorded])
    settle(studio_engine, recorded)
    assert Deployment.objects.get(pk=recorded).status == "running"


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_deploy_run_scale_stop(api: Any, staff: Any, studio_engine: StudioEngine,
                               whoami_wf: dict[str, Any]) -> None:
    d = deploy(api, studio_engine, {"workflow": whoami_wf["id"], "version": 1, "name": "who"})
    assert d["status"] == "running", d
    assert (d["workflow"], d["version"], d["replicas"], d["chat"]) == (whoami_wf["id"], 1, {"py": 1}, False)
    assert d["inputs"] == [{"name": "text", "type": "text"}]  # what a run of it names (no default here)
    assert d["namespace"] == f"{settings.OMNIFLOW.redis_prefix}-d{uuid.UUID(d['id']).hex}"
    assert [(w["role"], w["status"], w["live"] is not None) for w in d["workers"]] == [("py", "ready", True)]
    assert registered(d["namespace"]) == [w["worker_id"] for w in d["workers"]]

    # the deployment's worker plane: its own CURVE keys; a process without them gets no answer
    keys = Deployment.objects.get(pk=d["id"]).plane_keys()
    assert keys is not None and keys.public != Deployment.objects.exclude(pk=d["id"]).values_list(
        "plane_public", flat=True).first()
    metrics = client_for(staff)
    worker = d["workers"][0]["worker_id"]
    assert wait_for_refused(metrics, d["id"], worker, lambda n: n is not None) == 0.0
    assert hello_answered(d["workers"][0]["address"], None) is False
    assert hello_answered(d["workers"][0]["address"], keys) is True
    # a key of its own (knowing the worker's public key) gets nothing either, and that refusal is
    # counted where operators look: the worker's heartbeat carries it to /metrics
    assert foreign_hello_answered(d["workers"][0]["address"], keys.public) is False
    assert wait_for_refused(metrics, d["id"], worker, lambda n: n is not None and n >= 1) >= 1

    # a run of the deployment executes in its worker process, not here
    response = api.post("/api/runs/", {"deployment": d["id"], "inputs": {"text": "hi"}}, format="json")
    assert response.status_code == 201, response.content
    run_id = response.json()["id"]
    assert studio_engine.runs.wait(run_id) == "done"
    outputs = api.get(f"/api/runs/{run_id}/").json()["outputs"]
    assert outputs["result"]["text"] == "HI"
    assert outputs["result"]["pid"] == d["workers"][0]["pid"] != os.getpid()

    # the workers API: registry snapshots with the studio's status and deployment
    workers = api.get("/api/workers/").json()
    assert [(w["info"]["role"], w["deployment"], w["deployment_name"], w["status"]) for w in workers] == [
        ("py", d["id"], d["name"], "ready")]
    assert workers[0]["load"]["metrics"]["completed"] == 1.0 or workers[0]["load"]["outstanding"] == 0
    assert api.get("/api/workers/", {"role": "nope"}).json() == []

    # scale up, then down: processes follow the count
    scaled = api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 2}, format="json")
    assert scaled.status_code == 200, scaled.content
    settle(studio_engine, d["id"])
    d2 = api.get(f"/api/deployments/{d['id']}/").json()
    live = [w for w in d2["workers"] if w["status"] == "ready"]
    assert len(live) == 2 and d2["replicas"] == {"py": 2}
    assert sorted((w["replica"], w["rank"]) for w in live) == [(0, 0), (1, 0)]  # numbered by start
    assert sorted(registered(d["namespace"])) == sorted(w["worker_id"] for w in live)
    api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 1}, format="json")
    settle(studio_engine, d["id"])
    d3 = api.get(f"/api/deployments/{d['id']}/").json()
    assert sorted(w["status"] for w in d3["workers"]) == ["ready", "stopped"]
    assert {w["status"]: w["replica"] for w in d3["workers"]} == {"ready": 0, "stopped": None}
    gone = next(w for w in d3["workers"] if w["status"] == "stopped")
    assert not psutil.pid_exists(gone["pid"]) or psutil.Process(gone["pid"]).status() == psutil.STATUS_ZOMBIE
    assert registered(d["namespace"]) == [next(w["worker_id"] for w in d3["workers"] if w["status"] == "ready")]

    metrics = client_for(staff).get("/metrics").content.decode()
    assert f'omniflow_worker_up{{deployment="{d["id"]}",role="py",' in metrics
    assert f'omniflow_worker_plane_refused_total{{deployment="{d["id"]}",role="py",' in metrics
    assert 'omniflow_deployments{status="running"} 1.0' in metrics

    # stop: the processes end, the registry forgets them, runs are refused
    pids = [w["pid"] for w in d3["workers"] if w["status"] == "ready"]
    stopped = api.post(f"/api/deployments/{d['id']}/stop/")
    assert stopped.status_code == 200 and stopped.json()["status"] in ("stopping", "stopped")
    settle(studio_engine, d["id"])
    final = api.get(f"/api/deployments/{d['id']}/").json()
    assert final["status"] == "stopped" and {w["status"] for w in final["workers"]} == {"stopped"}
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)
    assert registered(d["namespace"]) == []
    assert Deployment.objects.get(pk=d["id"]).plane_keys() is None  # its keys went with its workers
    refused = api.post("/api/runs/", {"deployment": d["id"], "inputs": {"text": "x"}}, format="json")
    assert refused.status_code == 409
    assert api.post(f"/api/deployments/{d['id']}/stop/").json()["status"] == "stopped"  # idempotent
    assert api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 2},
                    format="json").status_code == 409
    listed = api.get("/api/deployments/", {"workflow": whoami_wf["id"]}).json()
    assert [x["id"] for x in listed["results"]] == [d["id"]]


def test_failed_start_marks_the_deployment_failed(api: Any) -> None:
    # workers told to listen on an address this machine does not have exit at once
    app = apps.get_app_config("workflows")
    studio = build_engine(dataclasses.replace(settings.OMNIFLOW, allow_module_ops=True,
                                              worker_listen="tcp://192.0.2.1:0"))
    previous = app.install(studio)
    try:
        wf = create_workflow(api, whoami_spec())
        d = deploy(api, studio, {"workflow": wf["id"]})
    finally:
        studio.runs.stop()
        app.install(previous)
    assert d["status"] == "failed" and "exited with status" in d["error"], d
    # The worker that did not come up says so, with why; none is left live.
    assert [(w["status"], w["error"]) for w in d["workers"]] == [("failed", d["error"])]


def test_bad_deployment_requests(api: Any, other_api: Any, studio_engine: StudioEngine,
                                 whoami_wf: dict[str, Any]) -> None:
    def post(body: Any) -> tuple[int, Any]:
        response = api.post("/api/deployments/", body, format="json")
        return response.status_code, response.json()

    wid = whoami_wf["id"]
    assert post({})[0] == 400
    assert post({"workflow": "not-a-uuid"})[0] == 400
    assert post({"workflow": str(uuid.uuid4())})[0] == 404
    assert post({"workflow": wid, "version": 9})[0] == 404
    status, body = post({"workflow": wid, "replicas": {"nope": 1, "py": 0}})
    assert status == 400 and {d["field"] for d in body["details"]} == {"replicas.nope", "replicas.py"}
    for bad in ("2", True, 1.5, -1, 10_000):
        assert post({"workflow": wid, "replicas": {"py": bad}})[0] == 400, bad
    assert post({"workflow": wid, "replicas": ["py"]})[0] == 400
    assert post({"workflow": wid, "node": "gpu-0"})[0] == 400  # embedded: the studio hosts them
    assert post({"workflow": wid, "node": "../etc"})[0] == 400
    status, body = post({"workflow": wid, "name": str(uuid.uuid4())})  # a name never reads as an id
    assert status == 400 and body["details"] == [{"field": "name"}], body
    assert post({"workflow": wid, "name": "x" * 101})[0] == 400
    invalid = create_workflow(api, {**spec_doc(name="invalid"), "edges": []})
    status, body = post({"workflow": invalid["id"]})
    assert status == 422, body
    assert other_api.post("/api/deployments/", {"workflow": wid}, format="json").status_code == 404
    assert Deployment.objects.count() == 0

    assert api.get("/api/deployments/", {"status": "bogus"}).status_code == 400
    assert api.get("/api/deployments/", {"workflow": "x"}).status_code == 400
    assert api.get(f"/api/deployments/{uuid.uuid4()}/").status_code == 404
    assert api.post(f"/api/deployments/{uuid.uuid4()}/stop/").status_code == 404
    assert api.get("/api/workers/", {"deployment": "x"}).status_code == 400
    assert api.get("/api/workers/").json() == []
    from rest_framework.test import APIClient

    anonymous = APIClient()
    assert anonymous.get("/api/deployments/").status_code == 401
    assert anonymous.get("/api/workers/").status_code == 401
    assert anonymous.get("/api/sessions/").status_code == 401


def test_scale_and_visibility_errors(api: Any, other_api: Any, studio_engine: StudioEngine,
                                     whoami_wf: dict[str, Any]) -> None:
    d = deploy(api, studio_engine, {"workflow": whoami_wf["id"]})
    assert d["status"] == "running"
    # a deployment's name defaults to its workflow's, unique among the owner's live deployments
    assert d["name"] == "whoami"
    taken = api.post("/api/deployments/", {"workflow": whoami_wf["id"], "name": "whoami"}, format="json")
    assert taken.status_code == 409 and taken.json()["details"] == [{"field": "name", "name": "whoami"}]
    second = deploy(api, studio_engine, {"workflow": whoami_wf["id"]})
    assert second["name"] == "whoami-2"
    api.post(f"/api/deployments/{second['id']}/stop/")
    settle(studio_engine, second["id"])
    assert deploy(api, studio_engine, {"workflow": whoami_wf["id"], "name": " whoami-2 "})["name"] == "whoami-2"
    url = f"/api/deployments/{d['id']}/scale/"
    assert api.post(url, {"role": "nope", "replicas": 1}, format="json").status_code == 400
    assert api.post(url, {"role": "py", "replicas": 0}, format="json").status_code == 400
    assert api.post(url, {"replicas": 1}, format="json").status_code == 400
    assert other_api.post(url, {"role": "py", "replicas": 2}, format="json").status_code == 404
    assert other_api.get(f"/api/deployments/{d['id']}/").status_code == 404
    assert other_api.get("/api/workers/").json() == []
    assert len(api.get("/api/workers/").json()) == 2
    # a session needs a chat workflow
    response = api.post("/api/sessions/", {"deployment": d["id"]}, format="json")
    assert response.status_code == 400 and "not a chat workflow" in response.json()["error"]


def test_the_proposed_name_counts_only_your_own_live_deployments(api: Any, other_api: Any, user: Any,
                                                                   other_user: Any, staff: Any) -> None:
    """The deploy dialog proposes what an unnamed deploy would take: a staff user who sees everyone's
    deployments is proposed the workflow's name while only someone else's deployments hold it."""
    mine = create_workflow(api, whoami_spec())
    theirs = create_workflow(other_api, whoami_spec())
    staff_wf = create_workflow(client_for(staff), whoami_spec())

    def proposed(client: Any, workflow: dict[str, Any]) -> str:
        response = client.get("/api/deployments/proposed-name/", {"workflow": workflow["id"]})
        assert response.status_code == 200, response.content
        return response.json()["name"]

    def record(owner: Any, workflow: dict[str, Any], name: str = "") -> Deployment:
        version = WorkflowVersion.objects.get(workflow_id=workflow["id"], number=1)
        return create_deployment(owner, version, name=name, start_workers=False)

    assert proposed(api, mine) == "whoami"
    assert record(user, mine).name == "whoami"
    assert record(user, mine, "whoami-3").name == "whoami-3"
    assert proposed(api, mine) == "whoami-2"
    assert record(user, mine).name == "whoami-2"
    assert proposed(api, mine) == "whoami-4"
    record(other_user, theirs)
    record(other_user, theirs)
    assert proposed(client_for(staff), staff_wf) == "whoami"
    assert proposed(other_api, theirs) == "whoami-3"
    assert other_api.get("/api/deployments/proposed-name/", {"workflow": mine["id"]}).status_code == 404
    assert api.get("/api/deployments/proposed-name/", {"workflow": "x"}).status_code == 400
    assert api.get("/api/deployments/proposed-name/").status_code == 400


def tp_chat_spec() -> dict[str, Any]:
    """A text prompt through one `llm` node on a tiny-llama role split over two tensor-parallel ranks."""
    return {
        "version": 1,
        "name": "tpchat",
        "roles": [{"name": "lm", "kind": "llm", "model": "tiny-llama", "tp_size": 2, "params": {"page_size": 4}}],
        "nodes": [
            {"id": "prompt", "kind": "input", "outputs": {"value": {"type": "text"}}},
            {"id": "gen", "kind": "llm", "role": "lm", "params": {"max_new_tokens": 6},
             "inputs": {"prompt": {"type": "text"}},
             "outputs": {"text": {"type": "text"}, "tokens": {"type": "tokens"}, "kv": {"type": "kv"}}},
            {"id": "tokens", "kind": "output", "inputs": {"value": {"type": "tokens"}}},
        ],
        "edges": [
            {"source": "prompt", "source_port": "value", "target": "gen", "target_port": "prompt"},
            {"source": "gen", "source_port": "tokens", "target": "tokens", "target_port": "value"},
        ],
    }


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_deploying_a_tp_role_starts_and_lists_its_ranks(api: Any, studio_engine: StudioEngine) -> None:
    from engine.compute.llm.engine import LLMEngine
    from engine.compute.models.loader import load_builtin
    from engine.compute.sampling import SamplingParams
    from engine.worker.launcher import rank_worker_id

    wf = create_workflow(api, tp_chat_spec())
    d = deploy(api, studio_engine, {"workflow": wf["id"], "version": 1, "name": "tp"})
    assert d["status"] == "running", d
    rows = sorted(d["workers"], key=lambda w: w["worker_id"])
    assert [(w["role"], w["status"]) for w in rows] == [("lm", "ready"), ("lm", "ready")]
    leader, follower = rows
    assert follower["worker_id"] == rank_worker_id(leader["worker_id"], 1)
    assert [(w["replica"], w["rank"]) for w in rows] == [(0, 0), (0, 1)]  # one replica, two ranks
    assert leader["address"] and leader["live"] is not None   # rank 0: the replica's endpoint
    assert follower["address"] == "" and follower["live"] is None
    assert registered(d["namespace"]) == [leader["worker_id"]]
    pids = [w["pid"] for w in rows]
    assert len(set(pids)) == 2 and all(psutil.pid_exists(p) for p in pids)

    response = api.post("/api/runs/", {"deployment": d["id"], "inputs": {"prompt": "split heads"}}, format="json")
    assert response.status_code == 201, response.content
    assert studio_engine.runs.wait(response.json()["id"]) == "done"
    tokens = api.get(f"/api/runs/{response.json()['id']}/").json()["outputs"]["tokens"]
    engine = LLMEngine(load_builtin("tiny-llama"))
    try:
        (expected,) = engine.generate(["split heads"], SamplingParams(max_new_tokens=6))
    finally:
        engine.close()
    assert tokens == list(expected.output_ids)

    api.post(f"/api/deployments/{d['id']}/stop/")
    settle(studio_engine, d["id"])
    final = api.get(f"/api/deployments/{d['id']}/").json()
    assert final["status"] == "stopped" and {w["status"] for w in final["workers"]} == {"stopped"}
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


def rows_until(deployment_id: str, done: Any, what: str, timeout_s: float = 30.0) -> list[Worker]:
    """The deployment's worker rows once `done(rows)` holds (read again until a deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = list(Worker.objects.filter(deployment_id=deployment_id).order_by("started_at"))
        if done(rows):
            return rows
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s; rows: {[(r.worker_id, r.status) for r in rows]}"
        time.sleep(0.05)  # the rows change on the studio's database thread: read them again


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_a_killed_worker_is_replaced_and_its_row_marked_lost(api: Any, studio_engine: StudioEngine,
                                                            whoami_wf: dict[str, Any]) -> None:
    d = deploy(api, studio_engine, {"workflow": whoami_wf["id"], "version": 1, "name": "supervised"})
    assert d["status"] == "running", d
    (first,) = d["workers"]
    psutil.Process(first["pid"]).kill()

    rows = rows_until(d["id"], lambda rows: len(rows) == 2 and rows[1].status == "ready", "a replacement row")
    lost, fresh = rows
    assert (lost.worker_id, lost.status) == (first["worker_id"], "lost")
    assert fresh.worker_id == f"{first['worker_id']}-r1" and fresh.pid != first["pid"]
    assert registered(d["namespace"]) == [fresh.worker_id]

    response = api.post("/api/runs/", {"deployment": d["id"], "inputs": {"text": "again"}}, format="json")
    assert response.status_code == 201, response.content
    assert studio_engine.runs.wait(response.json()["id"]) == "done"
    assert api.get(f"/api/runs/{response.json()['id']}/").json()["outputs"]["result"]["pid"] == fresh.pid

    # Stopping ends the replacement and replaces nothing.
    api.post(f"/api/deployments/{d['id']}/stop/")
    settle(studio_engine, d["id"])
    final = api.get(f"/api/deployments/{d['id']}/").json()
    assert final["status"] == "stopped"
    assert sorted(w["status"] for w in final["workers"]) == ["lost", "stopped"]
    assert not psutil.pid_exists(fresh.pid) or psutil.Process(fresh.pid).status() == psutil.STATUS_ZOMBIE


async def _restarting(studio: StudioEngine, deployment_id: str) -> int:
    return studio.deployments._hosted[deployment_id].cluster.restarting("py")


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_scaling_counts_a_pending_replacement_once(api: Any) -> None:
    """A lost worker whose replacement waits out its back-off: scaling 1 -> 2 starts one worker
    (the pending replacement is the other), and 2 -> 1 gives the pending replacement up rather
    than stopping the live worker."""
    app = apps.get_app_config("workflows")
    studio = build_engine(dataclasses.replace(settings.OMNIFLOW, allow_module_ops=True,
                                              worker_restart_backoff_s=600.0))
    previous = app.install(studio)
    try:
        d = deploy(api, studio, {"workflow": create_workflow(api, whoami_spec())["id"]})
        assert d["status"] == "running", d
        (first,) = d["workers"]
        psutil.Process(first["pid"]).kill()
        rows_until(d["id"], lambda rows: [r.status for r in rows] == ["lost"], "the lost row")
        assert studio.runs.call(_restarting(studio, d["id"])).result(10) == 1

        api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 2}, format="json")
        settle(studio, d["id"])
        rows = list(Worker.objects.filter(deployment_id=d["id"]).order_by("started_at"))
        assert [r.status for r in rows] == ["lost", "ready"]
        assert registered(d["namespace"]) == [rows[1].worker_id]

        api.post(f"/api/deployments/{d['id']}/scale/", {"role": "py", "replicas": 1}, format="json")
        settle(studio, d["id"])
        assert studio.runs.call(_restarting(studio, d["id"])).result(10) == 0
        after = list(Worker.objects.filter(deployment_id=d["id"]).order_by("started_at"))
        assert [(r.worker_id, r.status) for r in after] == [(r.worker_id, r.status) for r in rows]
        assert registered(d["namespace"]) == [rows[1].worker_id]
        assert psutil.pid_exists(rows[1].pid)
        api.post(f"/api/deployments/{d['id']}/stop/")
        settle(studio, d["id"])
    finally:
        studio.runs.stop()
        app.install(previous)


def test_embedded_deployments_share_the_machines_gpus(api: Any) -> None:
    """The studio's own deployments seat their replicas on one pool of the machine's GPUs (here
    two, as `OMNIFLOW_NODE_GPUS=2` says): each replica gets one nobody else holds, and a
    deployment that finds none left fails naming it; a stopped one gives its GPUs back."""
    app = apps.get_app_config("workflows")
    config = settings.OMNIFLOW
    studio = build_engine(dataclasses.replace(config, allow_module_ops=True,
                                              node=dataclasses.replace(config.node, gpus=2)))
    previous = app.install(studio)
    spec = whoami_spec()
    spec["roles"][0]["resources"] = {"gpus": 1}
    wf = create_workflow(api, spec)
    try:
        first = deploy(api, studio, {"workflow": wf["id"], "name": "first"})
        second = deploy(api, studio, {"workflow": wf["id"], "name": "second"})
        assert (first["status"], second["status"]) == ("running", "running"), (first, second)
        assert [w["gpus"] for w in first["workers"]] == [[0]]
        assert [w["gpus"] for w in second["workers"]] == [[1]]
        assert list(Worker.objects.filter(deployment_id=first["id"]).values_list("gpus", flat=True)) == [[0]]

        third = deploy(api, studio, {"workflow": wf["id"], "name": "third"})
        assert third["status"] == "failed" and "role 'py', replica 0: needs 1 GPUs, the node has 2" in third["error"]

        api.post(f"/api/deployments/{first['id']}/stop/")
        settle(studio, first["id"])
        again = deploy(api, studio, {"workflow": wf["id"], "name": "again"})
        assert [w["gpus"] for w in again["workers"]] == [[0]]
        for d in (second, again):
            api.post(f"/api/deployments/{d['id']}/stop/")
            settle(studio, d["id"])
    finally:
        studio.runs.stop()
        app.install(previous)
