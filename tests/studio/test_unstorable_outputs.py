"""Values a node produces that JSON or the database cannot hold end a run clearly, never hang it.

A float past the largest (1e200 squared), NaN or -inf shows as `{"float": "inf"}` in the node's
outputs and the run's; a value the database refuses all the same (text holding NUL, which
PostgreSQL stores in no text or jsonb column) fails the run saying so, where it used to leave the
run "running" until its lease lapsed and it was executed again."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from studio.workflows.apps import engine
from tests.studio.factories import create_workflow
from tests.studio.limits import python_spec

pytestmark = pytest.mark.django_db(transaction=True)


def run_to_end(api: Any, op: str, text: str, output_type: str = "text") -> dict[str, Any]:
    spec = python_spec(op=op)
    spec["nodes"][1]["outputs"]["out"]["type"] = output_type
    spec["nodes"][2]["inputs"]["value"]["type"] = output_type
    wf = create_workflow(api, spec)
    response = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": text}}, format="json")
    assert response.status_code == 201, response.content[:300]
    engine().runs.wait(response.json()["id"], timeout_s=60)
    return api.get(f"/api/runs/{response.json()['id']}/").json()


def test_floats_json_has_no_number_for_are_shown_as_such(api) -> None:
    run = run_to_end(api, "tests.studio.fns:beyond", "1e200", output_type="json")
    assert run["status"] == "done", run["error"]
    expected = {"big": {"float": "inf"}, "nan": {"float": "nan"}, "low": [{"float": "-inf"}, 1.5]}
    assert run["outputs"]["result"] == expected
    step = next(n for n in run["nodes"] if n["node"] == "step")
    assert step["outputs"]["out"] == expected


@pytest.mark.skipif(connection.vendor != "postgresql", reason="SQLite stores NUL in text: nothing is refused there")
def test_a_value_the_database_refuses_fails_the_run_saying_so(api) -> None:
    run = run_to_end(api, "tests.studio.fns:with_nul", "a")
    assert run["status"] == "failed", run
    assert "could not be stored" in run["error"] and "database refused" in run["error"], run["error"]
    assert all(n["state"] in ("done", "cancelled", "failed") for n in run["nodes"]), run["nodes"]
