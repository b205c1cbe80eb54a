"""The studio's engine thread moves what the process has loaded by the time its executor is built
(Django, torch, the ops' modules) out of the garbage collector's full passes (`gc.freeze`): a full
pass over torch's objects takes about 150 ms on a 2-core machine, and landed inside one run's
first-event latency in each `omniflow bench studio` (its p99)."""

from __future__ import annotations

import gc
import sys

import pytest

from studio.workflows.apps import engine
from tests.studio.factories import create_workflow, spec_doc

pytestmark = pytest.mark.django_db(transaction=True)


def test_what_the_engine_thread_loaded_is_frozen_before_runs_execute(api) -> None:
    wf = create_workflow(api, spec_doc())
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}}, format="json").json()
    engine().runs.wait(run["id"])
    assert api.get(f"/api/runs/{run['id']}/").json()["status"] == "done"
    assert "torch" in sys.modules and gc.get_freeze_count() > len(sys.modules)
