"""Runs never stay stuck, without Celery: the lease a run is claimed under, what the sweep does
with a lapsed one (restart once, then fail), cancelling a run in any state from another
process, deleting runs and workflows (their files go, live deployments refuse), and who may
read `/metrics`."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.apps import apps
from django.conf import settings
from django.utils import timezone

from engine.client.runs import NodeProgressEvent, NodeState, NodeStateEvent, RunStarted
from studio.workflows.apps import StudioEngine
from studio.workflows.chat.turns import turn_in_flight
from studio.workflows.models import (
    Deployment,
    DeploymentStatus,
    NodeRun,
    Run,
    RunEvent,
    RunFile,
    Session,
    Workflow,
)
from studio.workflows.runs.bus import LocalRunEventBus
from studio.workflows.runs.lease import RUN_RESTARTED, LeaseLost, LeaseTerms
from studio.workflows.runs.recovery import sweep_expired
from studio.workflows.runs.service import RunService
from studio.workflows.runs.store import StoredEvent, claim, record
from tests.studio.conftest import client_for
from tests.studio.factories import create_workflow, spec_doc

pytestmark = pytest.mark.django_db(transaction=True)


def stored_run(user: Any, wf: dict[str, Any], text: str = "x") -> Run:
    """A pending run of `wf`'s latest version that nothing was asked to execute."""
    workflow = Workflow.objects.get(pk=wf["id"])
    version = workflow.latest_version()
    run = Run.objects.create(owner=user, workflow=workflow, version=version, inputs={"text": text})
    NodeRun.objects.bulk_create([NodeRun(run=run, node=n["id"], kind=n["kind"]) for n in version.spec["nodes"]])
    return run


def wait_until(what: str, check: Callable[[], bool], deadline_s: float = 30.0) -> None:
    """Poll `check` (the database) until it holds."""
    deadline = time.monotonic() + deadline_s
    pause = threading.Event()
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {deadline_s} s")
        pause.wait(0.02)


def lapse(run: Run) -> None:
    """As if the lease holder had stopped renewing a while ago."""
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=5))


def started_events(run_id: str, seq_base: int) -> list[StoredEvent]:
    return [RunStarted(seq=seq_base, run_id=run_id, time=timezone.now().timestamp(), workflow="echo",
                       nodes=["text", "step", "result"]),
            NodeStateEvent(seq=seq_base + 1, run_id=run_id, time=timezone.now().timestamp(), node="step",
                           state=NodeState.RUNNING, attempt=1)]


def test_a_lapsed_lease_restarts_the_run_once_then_fails_it(api: Any, user: Any) -> None:
    run = stored_run(user, create_workflow(api, spec_doc()))
    first = LeaseTerms("worker-a", 30.0)
    ticket = claim(str(run.pk), first)
    assert ticket is not None and ticket.seq_base == 0
    row = Run.objects.get(pk=run.pk)
    assert (row.status, row.lease_owner, row.attempts) == ("running", "worker-a", 1)
    assert row.lease_expires_at > timezone.now() + dt.timedelta(seconds=25)
    record(str(run.pk), started_events(str(run.pk), 0), owner="worker-a")
    assert sweep_expired(retries=1) == []  # a live lease is left alone

    lapse(run)
    (swept,) = sweep_expired(retries=1)
    assert swept.restarted and [e["type"] for e in swept.events] == [RUN_RESTARTED]
    restart = swept.events[0]
    assert restart["seq"] == 2 and restart["attempt"] == 2
    assert restart["error"].startswith("the worker executing this run stopped (lease expired at ")
    row = Run.objects.get(pk=run.pk)
    assert (row.status, row.lease_owner, row.lease_expires_at, row.last_seq) == ("pending", "", None, 2)
    assert set(NodeRun.objects.filter(run=run).values_list("state", flat=True)) == {"pending"}
    with pytest.raises(LeaseLost):  # the stopped executor, were it only slow, can write nothing more
        record(str(run.pk), [NodeProgressEvent(seq=3, run_id=str(run.pk), time=0.0, node="step")], owner="worker-a")

    ticket = claim(str(run.pk), LeaseTerms("worker-b", 30.0))
    assert ticket is not None and ticket.seq_base == 3  # the new execution's events follow the restart
    record(str(run.pk), started_events(str(run.pk), 3), owner="worker-b")
    lapse(run)
    (swept,) = sweep_expired(retries=1)
    assert not swept.restarted
    row = Run.objects.get(pk=run.pk)
    assert row.status == "failed" and row.attempts == 2
    assert row.error.startswith("the worker executing this run stopped (lease expired at ")
    assert row.error.endswith("it was executed 2 times")
    types = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", "type"))
    assert types == [(0, "run_started"), (1, "node_state"), (2, RUN_RESTARTED), (3, "run_started"),
                     (4, "node_state"), (5, "run_finished")]
    assert sweep_expired(retries=1) == []


def test_a_run_asked_to_cancel_whose_executor_stopped_is_cancelled_by_the_sweep(api: Any, user: Any) -> None:
    run = stored_run(user, create_workflow(api, spec_doc()))
    claim(str(run.pk), LeaseTerms("worker-a", 30.0))
    Run.objects.filter(pk=run.pk).update(cancel_requested=True)
    lapse(run)
    (swept,) = sweep_expired(retries=1)
    assert not swept.restarted and Run.objects.get(pk=run.pk).status == "cancelled"


def test_cancel_a_pending_run_and_one_whose_executor_died(api: Any, user: Any) -> None:
    wf = create_workflow(api, spec_doc())
    queued = stored_run(user, wf)
    response = api.post(f"/api/runs/{queued.pk}/cancel/")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"

    orphan = stored_run(user, wf)
    claim(str(orphan.pk), LeaseTerms("studio:gone:1:x", 30.0))
    lapse(orphan)
    response = api.post(f"/api/runs/{orphan.pk}/cancel/")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "cancelled"
    assert body["error"].startswith("cancelled by request; the worker executing this run stopped")
    assert {n["node"]: n["state"] for n in body["nodes"]}["step"] == "cancelled"


def test_cancel_reaches_the_process_executing_the_run(api: Any, user: Any, studio_engine: StudioEngine) -> None:
    """A run another studio process executes (here: a second RunService) is cancelled by its
    executor when asked through this one; the request waits for it and answers 200."""
    wf = create_workflow(api, spec_doc(op="tests.studio.fns:wait_forever"))
    run = stored_run(user, wf)
    other = RunService(studio_engine.kinds, LocalRunEventBus(), ops=studio_engine.ops, lease_s=1.5)
    try:
        other.submit(str(run.pk))
        wait_until("the run executing", lambda: Run.objects.get(pk=run.pk).status == "running")
        response = api.post(f"/api/runs/{run.pk}/cancel/")
        assert response.status_code == 200, response.content
        assert response.json()["status"] == "cancelled"
        assert other.wait(str(run.pk)) in ("cancelled", None)
    finally:
        other.stop()
    events = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("type", flat=True))
    assert events[0] == "run_started" and events[-1] == "run_finished"
    assert Run.objects.get(pk=run.pk).error == "cancelled by request"


# ------------------------------------------------------------- the embedded studio's sweep
def left_running(user: Any, wf: dict[str, Any], owner: str, *, attempts: int = 1, lapsed: bool = True) -> Run:
    """A run as a studio process `owner` leaves it: claimed, started, its step running; its lease
    lapsed (the process died) unless `lapsed` is False (a live process renews it: here a lease
    longer than the test)."""
    run = stored_run(user, wf)
    assert claim(str(run.pk), LeaseTerms(owner, 30.0 if lapsed else 3600.0)) is not None
    record(str(run.pk), started_events(str(run.pk), 0), owner=owner)
    Run.objects.filter(pk=run.pk).update(attempts=attempts)
    if lapsed:
        lapse(run)
    return run


def test_the_embedded_studio_takes_up_what_a_dead_process_left_and_leaves_live_leases_alone(
        api: Any, user: Any, studio_engine: StudioEngine) -> None:
    """At its start the studio's RunService executes again a run whose executor died mid-run (its
    chat session takes turns again once it has ended) and the runs left pending; while it runs it
    sweeps every half lease period, failing a run executed twice already. A run under another live
    process's fresh lease is never touched."""
    wf = create_workflow(api, spec_doc())
    version = Workflow.objects.get(pk=wf["id"]).latest_version()
    dead = left_running(user, wf, "studio:gone:1:x")
    chat = Deployment.objects.create(owner=user, version=version, name="chat", status=DeploymentStatus.RUNNING)
    session = Session.objects.create(owner=user, deployment=chat, turn=dead)
    queued = stored_run(user, wf, "queued")
    alive = left_running(user, wf, "studio:alive:2:y", lapsed=False)
    assert turn_in_flight(session)

    service = RunService(studio_engine.kinds, LocalRunEventBus(), ops=studio_engine.ops, lease_s=1.0,
                         lease_retries=1)
    try:
        taken = service.resume_stale()
        assert set(taken) == {str(dead.pk), str(queued.pk)}
        wait_until("the dead process's run executed again", lambda: Run.objects.get(pk=dead.pk).finished)
        wait_until("the queued run executed", lambda: Run.objects.get(pk=queued.pk).finished)
        row = Run.objects.get(pk=dead.pk)
        assert (row.status, row.outputs, row.attempts) == ("done", {"result": "X"}, 2)
        restart = RunEvent.objects.get(run=dead, type=RUN_RESTARTED).data
        assert restart["seq"] == 2 and restart["error"].startswith("the worker executing this run stopped")
        assert not turn_in_flight(Session.objects.get(pk=session.pk))
        assert Run.objects.get(pk=queued.pk).outputs == {"result": "QUEUED"}

        # While it runs: another process dies with a run it had executed twice already.
        twice = left_running(user, wf, "studio:gone-too:3:z", attempts=2)
        wait_until("the sweep failing it", lambda: Run.objects.get(pk=twice.pk).finished, 10.0)
        row = Run.objects.get(pk=twice.pk)
        assert row.status == "failed" and row.attempts == 2
        assert row.error.startswith("the worker executing this run stopped (lease expired at ")
        assert row.error.endswith("it was executed 2 times")
        assert {n.node: n.state for n in NodeRun.objects.filter(run=twice)}["step"] == "cancelled"
    finally:
        service.stop()
    untouched = Run.objects.get(pk=alive.pk)
    assert (untouched.status, untouched.lease_owner, untouched.attempts, untouched.last_seq) == (
        "running", "studio:alive:2:y", 1, 1)
    assert not RunEvent.objects.filter(run=alive, type__in=[RUN_RESTARTED, "run_finished"]).exists()


# ---------------------------------------------------------------------------- deleting
def test_deleting_runs_and_workflows_removes_their_files(api: Any, user: Any) -> None:
    from tests.studio.test_api_runs import finished, submit

    wf = create_workflow(api, spec_doc(op="tests.studio.fns:png"))
    runs = [finished(api, submit(api, wf["id"], {"text": t})) for t in ("a", "b")]
    files = [Path(f.file.path) for f in RunFile.objects.filter(run_id__in=[r["id"] for r in runs])]
    assert len(files) == 2 and all(p.is_file() and str(p).startswith(str(settings.MEDIA_ROOT)) for p in files)

    assert api.delete(f"/api/runs/{runs[0]['id']}/").status_code == 204
    assert not files[0].exists() and files[1].is_file()
    assert not Run.objects.filter(pk=runs[0]["id"]).exists()

    assert api.delete(f"/api/workflows/{wf['id']}/").status_code == 204
    assert not files[1].exists() and not RunFile.objects.exists()


def test_deleting_a_run_in_progress_is_refused(api: Any, user: Any) -> None:
    run = stored_run(user, create_workflow(api, spec_doc()))
    response = api.delete(f"/api/runs/{run.pk}/")
    assert response.status_code == 409 and "pending" in response.json()["error"]


def test_deleting_a_workflow_with_live_deployments_is_refused_naming_them(api: Any, user: Any,
                                                                          other_api: Any) -> None:
    wf = create_workflow(api, spec_doc())
    version = Workflow.objects.get(pk=wf["id"]).latest_version()
    live = Deployment.objects.create(owner=user, version=version, name="serving", status=DeploymentStatus.RUNNING)
    ended = Deployment.objects.create(owner=user, version=version, name="old", status=DeploymentStatus.STOPPED)
    assert other_api.delete(f"/api/workflows/{wf['id']}/").status_code == 404
    response = api.delete(f"/api/workflows/{wf['id']}/")
    assert response.status_code == 409, response.content
    body = response.json()
    assert set(body) == {"error", "details"} and "1 live deployment" in body["error"]
    assert [(d["deployment"], d["name"], d["status"]) for d in body["details"]] == [(str(live.pk), "serving",
                                                                                    "running")]
    assert Workflow.objects.filter(pk=wf["id"]).exists()

    Deployment.objects.filter(pk=live.pk).update(status=DeploymentStatus.STOPPED)
    assert api.delete(f"/api/workflows/{wf['id']}/").status_code == 204
    assert not Deployment.objects.filter(pk__in=[live.pk, ended.pk]).exists()


# ----------------------------------------------------------------------------- metrics
TOKEN = "metrics-token-for-the-tests-0123"


@pytest.fixture
def metrics_token(studio_engine: StudioEngine) -> Any:
    app = apps.get_app_config("workflows")
    config = dataclasses.replace(studio_engine.config, metrics_token=TOKEN)
    previous = app.install(dataclasses.replace(studio_engine, config=config))
    yield TOKEN
    app.install(previous)


def test_metrics_need_a_token_or_staff(client: Any, user: Any, staff: Any, api: Any) -> None:
    refused = client.get("/metrics")
    assert refused.status_code == 401 and refused["WWW-Authenticate"].startswith("Bearer")
    assert set(refused.json()) == {"error", "details"}
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer not-the-token").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Basic YTpi").status_code == 401
    assert api.get("/metrics").status_code == 403  # a user's API token is not enough
    client.force_login(user)
    assert client.get("/metrics").status_code == 403
    client.force_login(staff)
    assert client.get("/metrics").status_code == 200
    assert client_for(staff).get("/metrics").status_code == 200


def test_metrics_with_the_operators_token(client: Any, metrics_token: str) -> None:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {metrics_token}")
    assert response.status_code == 200 and b"omniflow_runs_active" in response.content
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {metrics_token}x").status_code == 401
    assert client.get("/metrics").status_code == 401

