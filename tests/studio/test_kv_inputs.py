"""A run's inputs never carry a KV reference.

A `KVRef` names the worker its pages are pulled from (`holder.address`): a decode or diffusion
role worker connects there. Written by a user, as a run input or an input node's default, it would
point a role worker at any address the worker can reach (the operator's Redis, another host's
services). Only an llm node of the same run makes one, so the studio refuses the shape itself,
wherever it sits in an input's JSON.
"""

from __future__ import annotations

import copy

import pytest

from studio.workflows.models import Run
from tests.studio.factories import create_workflow, spec_doc

pytestmark = pytest.mark.django_db(transaction=True)

FORGED = {"type": "kv", "model_id": "tiny-llama", "page_size": 16, "num_tokens": 32,
          "holder": {"address": "tcp://127.0.0.1:6379", "worker_id": "w-forged"}}


def json_input_spec(default: object = None) -> dict:
    spec = spec_doc()
    spec["nodes"][0]["outputs"]["value"]["type"] = "json"
    spec["nodes"][1]["inputs"]["text"]["type"] = "json"
    if default is not None:
        spec["nodes"][0]["params"] = {"default": default}
    return spec


def test_an_input_value_shaped_as_a_kv_reference_is_refused_wherever_it_nests(api) -> None:
    wf = create_workflow(api, json_input_spec())
    for value, where in [(FORGED, "inputs.text"),
                         ({"context": [1, {"cached": copy.deepcopy(FORGED)}]}, "inputs.text.context[1].cached")]:
        response = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": value}}, format="json")
        assert response.status_code == 422, response.content
        body = response.json()
        assert "cannot carry a KV reference" in body["error"] and body["details"] == [where]
    assert Run.objects.count() == 0
    ok = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": {"type": "text", "kv": 1}}}, format="json")
    assert ok.status_code == 201, ok.content


def test_an_input_node_of_type_kv_or_with_a_kv_shaped_default_is_an_issue_on_the_node(api) -> None:
    typed = spec_doc()
    typed["nodes"][0]["outputs"]["value"]["type"] = "kv"
    typed["nodes"][1]["inputs"]["text"]["type"] = "kv"
    for name, (spec, issue) in enumerate([(typed, {"code": "kv_input", "node": "text", "port": "value"}),
                        (json_input_spec(default={"a": FORGED}),
                         {"code": "kv_input", "node": "text", "path": "params.default.a"}),
                        (json_input_spec(default={"a.b": [FORGED]}),
                         {"code": "kv_input", "node": "text", "path": 'params.default["a.b"][0]'})]):
        report = api.post("/api/validate/?report=1", {"spec": spec}, format="json").json()
        found = [i for i in report["issues"] if i["code"] == "kv_input"]
        assert [{k: i[k] for k in issue} for i in found] == [issue], report
        wf = create_workflow(api, spec, name=f"kv-{name}")
        response = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {}}, format="json")
        assert response.status_code == 422, response.content
        assert any(d.get("code") == "kv_input" for d in response.json()["details"]), response.json()
    assert Run.objects.count() == 0
