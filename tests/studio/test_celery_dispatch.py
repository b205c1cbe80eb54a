"""The distributed seam: with OMNIFLOW_DISPATCH=celery a submitted run is executed by the
`omniflow.execute_run` task (run eagerly here, in-process) through the same store/bus path."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from django.apps import apps
from django.conf import settings

from studio.celery import app as celery_app
from studio.config import Dispatch
from studio.workflows.apps import build_engine
from studio.workflows.models import Run, RunEvent
from studio.workflows.tasks import execute_run
from tests.studio.factories import create_workflow, spec_doc

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def celery_dispatch() -> Iterator[None]:
    config = dataclasses.replace(settings.OMNIFLOW, allow_module_ops=True, dispatch=Dispatch.CELERY)
    app = apps.get_app_config("workflows")
    studio = build_engine(config)
    previous = app.install(studio)
    eager = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    try:
        yield
    finally:
        celery_app.conf.task_always_eager = eager
        studio.runs.stop()
        app.install(previous)


def test_run_executes_in_the_task(celery_dispatch: None, api) -> None:
    wf = create_workflow(api, spec_doc())
    response = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "celery"}}, format="json")
    assert response.status_code == 201
    run = Run.objects.get(pk=response.json()["id"])
    assert run.status == "done" and run.outputs == {"result": "CELERY"}
    seqs = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(run.last_seq + 1))
    # a redelivered task finds the run claimed and does nothing
    assert execute_run.apply(args=[str(run.pk)]).get() is None
    assert RunEvent.objects.filter(run=run).count() == len(seqs)
