"""A deployment's worker rows follow its workers as they come up, in both modes: a row is
`starting` (with its host and pid) once the worker's process is spawned, before the worker
registered, and `/api/deployments/<id>/` shows it so; then `ready`; a worker that cannot come
up leaves a `failed` row with its reason.

Real worker processes, Redis and PostgreSQL. Each row's history is taken as the database
commits it (a `post_save` receiver, `on_commit`); the test looks at the API while the studio
is held at the moment a row was committed `starting` (readiness, no sleep).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from django.apps import apps
from django.conf import settings
from django.db import transaction
from django.db.models.signals import post_save

from engine.client.workers import LaunchError
from studio.workflows.apps import StudioEngine, build_engine
from studio.workflows.deployments import records
from studio.workflows.deployments.node import NodeAgent
from studio.workflows.models import Deployment, Worker, WorkflowVersion, deployment_namespace
from tests.studio.factories import create_workflow
from tests.studio.test_deployments import settle, whoami_spec

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis,
              pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")]

WAIT_S = 60.0
BAD_LISTEN = "tcp://192.0.2.1:0"
"""An address this machine does not have: a worker told to listen there exits at once."""


@dataclasses.dataclass(frozen=True)
class Change:
    worker_id: str
    status: str
    host: str
    pid: int | None
    error: str


class RowHistory:
    """Every committed save of a Worker row, in order; `on_starting(change)` runs once, on the
    committing thread, after the first row committed `starting`."""

    def __init__(self, on_starting: Callable[[Change], None]) -> None:
        self.changes: list[Change] = []
        self._on_starting: Callable[[Change], None] | None = on_starting

    def __call__(self, sender: Any, instance: Worker, **kwargs: Any) -> None:
        change = Change(instance.worker_id, instance.status, instance.host, instance.pid, instance.error)
        transaction.on_commit(lambda: self._committed(change))

    def _committed(self, change: Change) -> None:
        self.changes.append(change)
        if change.status == "starting" and self._on_starting is not None:
            hook, self._on_starting = self._on_starting, None
            hook(change)

    def of(self, worker_id: str) -> list[str]:
        return [c.status for c in self.changes if c.worker_id == worker_id]


@pytest.fixture
def history() -> Iterator[Callable[[Callable[[Change], None]], RowHistory]]:
    made: list[RowHistory] = []

    def make(on_starting: Callable[[Change], None]) -> RowHistory:
        made.append(RowHistory(on_starting))
        post_save.connect(made[-1], sender=Worker, dispatch_uid=f"row-history-{len(made)}")
        return made[-1]

    yield make
    for i in range(1, len(made) + 1):
        post_save.disconnect(sender=Worker, dispatch_uid=f"row-history-{i}")


def api_row(api: Any, deployment_id: str, worker_id: str) -> dict[str, Any]:
    (row,) = [w for w in api.get(f"/api/deployments/{deployment_id}/").json()["workers"] if w["worker_id"] == worker_id]
    return row


# ----------------------------------------------------------------------- embedded
def test_embedded_rows_go_starting_then_ready_and_the_api_shows_starting(
        api: Any, studio_engine: StudioEngine, history: Any) -> None:
    committed, release = threading.Event(), threading.Event()
    seen: list[Change] = []

    def hold(change: Change) -> None:  # on the studio's database thread: the launch waits here
        seen.append(change)
        committed.set()
        assert release.wait(WAIT_S), "the test never released the start"

    rows = history(hold)
    wf = create_workflow(api, whoami_spec())
    response = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json")
    assert response.status_code == 201, response.content
    d = response.json()
    try:
        assert committed.wait(WAIT_S), "no worker row was written starting"
        (starting,) = seen
        shown = api_row(api, d["id"], starting.worker_id)
        assert (shown["role"], shown["status"], shown["host"], shown["replica"], shown["error"]) == (
            "py", "starting", "127.0.0.1", 0, "")
        assert shown["pid"] == starting.pid and psutil.pid_exists(starting.pid)
        assert api.get(f"/api/deployments/{d['id']}/").json()["status"] == "starting"
    finally:
        release.set()
    settle(studio_engine, d["id"])
    shown = api_row(api, d["id"], starting.worker_id)
    assert (shown["status"], shown["pid"], shown["live"] is not None) == ("ready", starting.pid, True)
    assert rows.of(starting.worker_id) == ["starting", "ready"]
    api.post(f"/api/deployments/{d['id']}/stop/")
    settle(studio_engine, d["id"])
    assert rows.of(starting.worker_id) == ["starting", "ready"]  # stopping is an update(), not a save


def test_a_stop_while_the_workers_start_abandons_them_and_their_rows_say_stopped(
        api: Any, studio_engine: StudioEngine, history: Any) -> None:
    committed, release = threading.Event(), threading.Event()
    seen: list[Change] = []

    def hold(change: Change) -> None:
        seen.append(change)
        committed.set()
        assert release.wait(WAIT_S), "the test never released the start"

    rows = history(hold)
    wf = create_workflow(api, whoami_spec())
    d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
    try:
        assert committed.wait(WAIT_S), "no worker row was written starting"
        # Stopped while its worker starts (the launch is held where it reports the worker starting).
        assert api.post(f"/api/deployments/{d['id']}/stop/").json()["status"] == "stopping"
    finally:
        release.set()
    settle(studio_engine, d["id"])
    final = api.get(f"/api/deployments/{d['id']}/").json()
    (starting,) = seen
    assert final["status"] == "stopped", final
    assert [(w["worker_id"], w["status"], w["error"]) for w in final["workers"]] == [
        (starting.worker_id, "stopped", "")]
    assert rows.of(starting.worker_id) == ["starting"]  # never ready
    assert starting.pid is not None and (not psutil.pid_exists(starting.pid)
                                         or psutil.Process(starting.pid).status() == psutil.STATUS_ZOMBIE)


def test_embedded_worker_that_cannot_start_leaves_a_failed_row_with_its_reason(api: Any, history: Any) -> None:
    rows = history(lambda change: None)
    studio = build_engine(dataclasses.replace(settings.OMNIFLOW, allow_module_ops=True, worker_listen=BAD_LISTEN))
    app = apps.get_app_config("workflows")
    previous = app.install(studio)
    try:
        wf = create_workflow(api, whoami_spec())
        response = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json")
        assert response.status_code == 201, response.content
        settle(studio, response.json()["id"])
        d = api.get(f"/api/deployments/{response.json()['id']}/").json()
    finally:
        studio.runs.stop()
        app.install(previous)
    assert d["status"] == "failed", d
    (row,) = d["workers"]
    assert (row["role"], row["status"], row["host"], row["replica"]) == ("py", "failed", "192.0.2.1", None)
    assert "exited with status" in row["error"] and row["worker_id"] in row["error"], row
    # The reason as the worker said it, on the first line (what the deployment view shows).
    assert "before it was ready: ZMQError: Cannot assign requested address" in row["error"].splitlines()[0], row
    assert row["pid"] is not None
    assert rows.of(row["worker_id"]) == ["starting", "failed"]


# ----------------------------------------------------------------------- node agent
@pytest.fixture
def node_deployment(api: Any, user: Any) -> Deployment:
    wf = create_workflow(api, whoami_spec())
    deployment = Deployment.objects.create(owner=user, node="node-rows", status="starting", name="rows",
                                           version=WorkflowVersion.objects.get(workflow_id=wf["id"], number=1))
    deployment.namespace = deployment_namespace(settings.OMNIFLOW.redis_prefix, deployment.pk)
    deployment.save(update_fields=["namespace"])
    return deployment


def agent_of(tmp_path: Path, **changes: Any) -> NodeAgent:
    return NodeAgent(dataclasses.replace(settings.OMNIFLOW, node_name="node-rows", data_dir=tmp_path,
                                         allow_module_ops=True, **changes))


def test_node_agent_rows_go_starting_then_ready_and_the_api_shows_starting(
        api: Any, node_deployment: Deployment, history: Any, tmp_path: Path) -> None:
    deployment_id = str(node_deployment.pk)
    shown: list[dict[str, Any]] = []
    # The agent runs on this thread: the hook reads the API between the spawn and the registration.
    rows = history(lambda change: shown.append(api_row(api, deployment_id, change.worker_id)))
    agent = agent_of(tmp_path)
    ticket = records.ticket(deployment_id)
    assert ticket is not None
    try:
        result = agent.reconcile(ticket)
        (worker_id,) = result.started
        (starting,) = shown
        assert (starting["worker_id"], starting["status"], starting["host"], starting["replica"]) == (
            worker_id, "starting", "node-rows", 0)
        assert starting["pid"] is not None and starting["address"] == ""
        ready = api_row(api, deployment_id, worker_id)
        assert (ready["status"], ready["pid"]) == ("ready", starting["pid"])
        assert ready["address"].startswith("tcp://")
        assert rows.of(worker_id) == ["starting", "ready"]
    finally:
        agent.stop(deployment_id)


def test_node_agent_worker_that_cannot_start_leaves_a_failed_row_with_its_reason(
        api: Any, node_deployment: Deployment, history: Any, tmp_path: Path) -> None:
    deployment_id = str(node_deployment.pk)
    rows = history(lambda change: None)
    agent = agent_of(tmp_path, worker_listen=BAD_LISTEN)
    ticket = records.ticket(deployment_id)
    assert ticket is not None
    with pytest.raises(LaunchError, match="before it registered") as failed:
        agent.reconcile(ticket)
    (row,) = api.get(f"/api/deployments/{deployment_id}/").json()["workers"]
    assert (row["role"], row["status"], row["host"], row["replica"]) == ("py", "failed", "node-rows", None)
    assert row["error"] == str(failed.value) and row["worker_id"] in row["error"]
    # The reason as the worker said it first, then the end of its log (its traceback).
    first, *rest = row["error"].splitlines()
    assert "before it registered: ZMQError: Cannot assign requested address" in first, row
    assert rest and "ZMQError: Cannot assign requested address" in rest[-1], row  # the traceback's last line
    assert row["pid"] is not None
    assert rows.of(row["worker_id"]) == ["starting", "failed"]
