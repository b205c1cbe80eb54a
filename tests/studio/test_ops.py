"""Registered ops at the studio's edge: a spec names an op, never code to import.

Each attack here passed on a studio that checked only an op's module prefix: an attribute path
through something an allowed module imported (`workflows.ops.common:Path.write_text`) reached the
file system, and from there anything.
"""

from __future__ import annotations

import sys

import pytest

from studio.workflows.models import Run
from tests.studio.factories import create_workflow, example_spec, spec_doc

pytestmark = pytest.mark.django_db

ATTACKS = ["workflows.ops.common:Path.write_text", "workflows.ops.common:json.loads", "os:system",
           "workflows.ops.common:save_outputs", "builtins:eval"]


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error", "details"}, body
    return body


@pytest.mark.parametrize("op", ATTACKS)
def test_module_ops_are_refused_on_validate_save_and_run(api, strict_engine, op: str) -> None:
    response = api.post("/api/validate/", {"spec": spec_doc(op=op)}, format="json")
    assert response.status_code == 400
    details = error_of(response)["details"]
    assert [(d["code"], d["node"]) for d in details] == [("op_not_allowed", "step")]
    assert op in details[0]["message"]
    # Saved as a draft with its issue; a run of it is refused before anything executes.
    wf = create_workflow(api, spec_doc(op=op))
    assert wf["latest_version"]["valid"] is False
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "id"}}, format="json")
    assert run.status_code == 422
    assert error_of(run)["details"][0]["code"] == "op_not_allowed"
    assert Run.objects.count() == 0


def test_unknown_op_is_reported_on_its_node_with_close_names(api, strict_engine) -> None:
    response = api.post("/api/validate/", {"spec": spec_doc(op="router.ecko")}, format="json")
    assert response.status_code == 400
    (detail,) = error_of(response)["details"]
    assert (detail["code"], detail["node"]) == ("op_unknown", "step")
    assert "'router.ecko'" in detail["message"] and "did you mean 'router.echo'" in detail["message"]


def test_checking_an_op_imports_nothing(api, strict_engine) -> None:
    before = set(sys.modules)
    for op in ("omniflow_never_imported.evil", "omniflow_never_imported:run", "omniflow_never_imported.x:y.z"):
        response = api.post("/api/validate/", {"spec": spec_doc(op=op)}, format="json")
        assert response.status_code == 400
        assert error_of(response)["details"][0]["code"] in ("op_unknown", "op_not_allowed")
    assert not {m for m in set(sys.modules) - before if "omniflow_never_imported" in m}


@pytest.mark.django_db(transaction=True)  # the run starts when its row is committed
def test_registered_ops_run_in_a_strict_studio(api, strict_engine) -> None:
    wf = create_workflow(api, spec_doc(op="router.echo"))
    assert wf["latest_version"]["valid"] is True, wf["latest_version"]["issues"]
    for name in ("diamond", "loop", "router", "stream"):
        ok = api.post("/api/validate/", {"spec": example_spec(name)}, format="json")
        assert ok.status_code == 200 and ok.json()["valid"] is True, (name, ok.content)
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "hi"}}, format="json")
    assert run.status_code == 201, run.content
    strict_engine.runs.wait(run.json()["id"])
    body = api.get(f"/api/runs/{run.json()['id']}/").json()
    assert body["status"] == "done", body
    assert body["outputs"] == {"result": "HI"}


def test_params_are_checked_against_the_op_schema(api, strict_engine) -> None:
    spec = example_spec("image_generation")
    save = next(n for n in spec["nodes"] if n["id"] == "save_outputs")
    save["params"] = {"out_dir": 7}
    response = api.post("/api/validate/", {"spec": spec}, format="json")
    assert response.status_code == 400
    # The op's schema reports the type; the path check refuses a non-name too.
    assert {(d["code"], d["node"]) for d in error_of(response)["details"]} == {
        ("bad_param", "save_outputs"), ("path_refused", "save_outputs")}


def test_ops_catalogue(api) -> None:
    ops = {o["name"]: o for o in api.get("/api/ops/").json()}
    assert {"diamond.square", "chat.join_text", "media.save_outputs", "stream.words"} <= set(ops)
    assert ops["diamond.square"] == {
        "name": "diamond.square", "description": "x squared.",
        "inputs": {"x": {"type": "json", "optional": False}}, "outputs": {"out": {"type": "json", "optional": False}},
        "params_schema": {"type": "object", "properties": {}}, "stream": False, "output_dirs": [],
    }
    assert ops["chat.join_text"]["inputs"] == {"parts": {"type": "text", "optional": False, "join": "ordered"}}
    assert ops["media.save_outputs"]["params_schema"]["properties"]["out_dir"] == {"type": "string",
                                                                                   "default": "omniflow-out"}
    assert ops["stream.words"]["stream"] is True
    assert ops["media.save_outputs"]["output_dirs"] == ["out_dir"]
