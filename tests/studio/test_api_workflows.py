"""Workflows, versions, validation, import/export and the catalogue over REST."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from engine.flow.pysrc import to_python
from engine.flow.validate import parse_spec
from engine.spec.graph import encode_spec
from tests.studio.factories import create_workflow, example_spec, spec_doc

pytestmark = pytest.mark.django_db


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error", "details"}, body
    return body


def test_create_list_get_update_delete(api, other_api) -> None:
    wf = create_workflow(api, example_spec("diamond"))
    assert wf["name"] == "diamond" and wf["owner"] == "alice"
    assert wf["latest_version"]["number"] == 1 and wf["latest_version"]["valid"] is True
    assert wf["version_count"] == 1
    listed = api.get("/api/workflows/").json()
    assert [w["id"] for w in listed["results"]] == [wf["id"]]
    assert other_api.get("/api/workflows/").json()["results"] == []
    assert other_api.get(f"/api/workflows/{wf['id']}/").status_code == 404
    renamed = api.patch(f"/api/workflows/{wf['id']}/", {"name": "diamond2", "description": "d"}, format="json")
    assert renamed.status_code == 200 and renamed.json()["name"] == "diamond2"
    assert other_api.delete(f"/api/workflows/{wf['id']}/").status_code == 404
    assert api.delete(f"/api/workflows/{wf['id']}/").status_code == 204
    assert api.get(f"/api/workflows/{wf['id']}/").status_code == 404


def test_the_list_is_most_recently_updated_first_ties_by_name(api) -> None:
    """Workflows updated in the same instant (the examples, loaded together) list by name; a saved
    version or a rename moves a workflow to the top."""
    from datetime import timedelta

    from django.utils import timezone

    from studio.workflows.models import Workflow

    made = {name: create_workflow(api, spec_doc(), name=name)["id"] for name in ("a", "b", "d", "c")}
    start = timezone.now() - timedelta(hours=1)
    for name, seconds in (("a", 0), ("b", 2), ("c", 1), ("d", 1)):
        Workflow.objects.filter(pk=made[name]).update(updated_at=start + timedelta(seconds=seconds))

    def names() -> list[str]:
        return [w["name"] for w in api.get("/api/workflows/").json()["results"]]

    assert names() == ["b", "c", "d", "a"]
    saved = api.post(f"/api/workflows/{made['a']}/versions/",
                     {"spec": spec_doc(op="tests.studio.fns:fail"), "base": 1}, format="json")
    assert saved.status_code == 201, saved.content
    assert names() == ["a", "b", "c", "d"]
    assert api.patch(f"/api/workflows/{made['d']}/", {"description": "now"}, format="json").status_code == 200
    assert names() == ["d", "a", "b", "c"]


def test_a_version_says_whether_it_is_a_chat_model(api) -> None:
    """The editor's deploy dialog calls a deployment's name an OpenAI model only where it is one."""
    for name, chat in (("chat", True), ("vision_chat", True), ("diamond", False), ("image_generation", False)):
        wf = create_workflow(api, example_spec(name, tiny=True))
        version = api.get(f"/api/workflows/{wf['id']}/versions/1/")
        assert version.status_code == 200 and version.json()["chat"] is chat, (name, version.json().get("chat"))


def test_staff_see_everything(api, staff) -> None:
    from tests.studio.conftest import client_for

    wf = create_workflow(api, spec_doc())
    assert client_for(staff).get(f"/api/workflows/{wf['id']}/").status_code == 200


def test_empty_workflow_and_duplicate_name(api) -> None:
    response = api.post("/api/workflows/", {"name": "draft"}, format="json")
    assert response.status_code == 201 and response.json()["latest_version"] is None
    again = api.post("/api/workflows/", {"name": "draft"}, format="json")
    assert again.status_code == 409 and "already have" in error_of(again)["error"]


def test_versions_save_list_get_diff(api) -> None:
    wf = create_workflow(api, spec_doc())
    url = f"/api/workflows/{wf['id']}/versions/"
    changed = spec_doc(op="tests.studio.fns:fail")
    saved = api.post(url, {"spec": changed, "layout": {"step": {"x": 1, "y": 2}}, "message": "m", "base": 1},
                     format="json")
    assert saved.status_code == 201, saved.content
    assert saved.json()["number"] == 2 and saved.json()["author"] == "alice"
    # saving what the latest holds creates nothing
    same = api.post(url, {"spec": changed, "layout": {"step": {"x": 1, "y": 2}}}, format="json")
    assert same.status_code == 200 and same.json()["number"] == 2
    # an edit based on an old version conflicts
    stale = api.post(url, {"spec": spec_doc(), "base": 1}, format="json")
    assert stale.status_code == 409 and error_of(stale)["details"] == [{"latest": 2}]
    assert [v["number"] for v in api.get(url).json()["results"]] == [2, 1]
    one = api.get(f"{url}1/").json()
    assert one["spec"] == json.loads(encode_spec(parse_spec(spec_doc())))
    assert one["layout"] == {} and one["valid"] is True
    diff = api.get(f"{url}2/diff/").json()
    assert diff["from_version"] == 1 and diff["to_version"] == 2
    assert diff["nodes"]["changed"][0]["fields"]["op"] == {"from": "tests.studio.fns:echo",
                                                           "to": "tests.studio.fns:fail", "change": "changed"}
    assert api.get(f"{url}2/diff/?against=x").status_code == 400
    assert api.get(f"{url}9/").status_code == 404
    assert api.get(f"{url}2/diff/?against=7").status_code == 404


def test_a_diff_says_whether_each_field_was_added_removed_or_changed(api) -> None:
    first = {**spec_doc(), "description": "one"}
    wf = create_workflow(api, first)
    url = f"/api/workflows/{wf['id']}/versions/"
    second = {**spec_doc(), "description": "two", "meta": {"k": 1}}
    assert api.post(url, {"spec": second}, format="json").status_code == 201

    def changes(section: dict) -> dict[str, str]:
        return {name: field["change"] for name, field in section.items()}

    # The first version against nothing: everything it has is added, nothing "changed".
    v1 = api.get(f"{url}1/diff/").json()
    assert v1["from_version"] == 0
    assert changes(v1["fields"]) == {"description": "added", "name": "added", "version": "added"}
    assert v1["fields"]["name"] == {"from": None, "to": first["name"], "change": "added"}
    assert sorted(v1["nodes"]["added"]) == sorted(n["id"] for n in first["nodes"]) and not v1["nodes"]["changed"]
    body = v1["unified"].splitlines()[2:]  # after the ---/+++ header: every line added, none removed
    assert body[0].startswith("@@ -0,0 ") and all(line.startswith("+") for line in body[1:])
    v2 = api.get(f"{url}2/diff/").json()
    assert changes(v2["fields"]) == {"description": "changed", "meta": "added"}
    back = api.get(f"{url}1/diff/?against=2").json()
    assert changes(back["fields"]) == {"description": "changed", "meta": "removed"}
    assert back["fields"]["meta"] == {"from": {"k": 1}, "to": None, "change": "removed"}


def test_invalid_drafts_are_saved_with_their_issues(api, strict_engine) -> None:
    wf = create_workflow(api, spec_doc())
    bad = spec_doc(op="os:system")
    bad["edges"].append({"source": "nope", "source_port": "x", "target": "result", "target_port": "value"})
    saved = api.post(f"/api/workflows/{wf['id']}/versions/", {"spec": bad}, format="json")
    assert saved.status_code == 201
    body = saved.json()
    assert body["valid"] is False
    assert {(i["code"], i.get("node")) for i in body["issues"]} == {("op_not_allowed", "step"),
                                                                     ("unknown_node", "nope")}


def test_validate_reports_every_issue_with_ids(api) -> None:
    ok = api.post("/api/validate/", {"spec": example_spec("loop")}, format="json")
    assert ok.status_code == 200 and ok.json()["valid"] is True
    bare = api.post("/api/validate/", example_spec("router"), format="json")
    assert bare.status_code == 200
    bad = spec_doc()
    bad["nodes"][1]["role"] = "ghost"
    bad["nodes"].append({"id": "lonely", "kind": "python", "role": "py", "op": "diamond.square",
                         "inputs": {"x": {"type": "json"}}, "outputs": {"out": {"type": "json"}}})
    bad["edges"].append({"source": "step", "source_port": "out", "target": "result", "target_port": "nope"})
    response = api.post("/api/validate/", {"spec": bad}, format="json")
    assert response.status_code == 400
    body = error_of(response)
    assert body["error"] == "invalid workflow: 3 problems"
    assert {(d["code"], d.get("node"), d.get("port")) for d in body["details"]} == {
        ("unknown_role", "step", None),
        ("unknown_port", "result", "nope"),
        ("dangling_port", "lonely", "x"),
    }


def test_validate_report_answers_an_invalid_workflow_with_200_and_its_issues(api) -> None:
    """`?report=1` (what the editor sends as it checks each edit): the same issues as the 400, as data."""
    bad = spec_doc()
    bad["nodes"][1]["role"] = "ghost"
    refused = api.post("/api/validate/", {"spec": bad}, format="json")
    assert refused.status_code == 400  # the default is unchanged
    reported = api.post("/api/validate/?report=1", {"spec": bad}, format="json")
    assert reported.status_code == 200
    body = reported.json()
    assert body["valid"] is False
    assert body["issues"] == error_of(refused)["details"]
    assert body["spec"]["name"] == bad["name"]
    ok = api.post("/api/validate/?report=true", {"spec": example_spec("loop")}, format="json")
    assert ok.status_code == 200 and ok.json()["valid"] is True and ok.json()["issues"] == []
    schema = api.post("/api/validate/?report=1", {"spec": {"version": 1, "name": "x", "roles": [], "nodes": [{"id": 3}],
                                                           "edges": "no"}}, format="json")
    assert schema.status_code == 200 and schema.json()["valid"] is False and schema.json()["spec"] is None
    assert {"$.edges", "$.nodes[0].id", "$.nodes[0]"} <= {i.get("path") for i in schema.json()["issues"]}
    malformed = api.post("/api/validate/?report=1", b'{"spec": {', content_type="application/json")
    assert malformed.status_code == 400  # a request that is not one stays an error
    unknown = api.post("/api/validate/?report=yes", {"spec": bad}, format="json")
    assert unknown.status_code == 400 and "report must be" in error_of(unknown)["error"]


def test_validate_schema_errors_and_malformed_json(api) -> None:
    schema = api.post("/api/validate/", {"spec": {"version": 1, "name": "x", "roles": [], "nodes": [{"id": 3}],
                                                  "edges": "no"}}, format="json")
    assert schema.status_code == 400
    paths = {d.get("path") for d in error_of(schema)["details"]}
    assert {"$.edges", "$.nodes[0].id", "$.nodes[0]"} <= paths
    malformed = api.post("/api/validate/", b'{"spec": {', content_type="application/json")
    assert malformed.status_code == 400 and "JSON parse error" in error_of(malformed)["error"]
    both = api.post("/api/validate/", {"spec": {}, "source": "x"}, format="json")
    assert both.status_code == 400 and error_of(both)["details"][0]["message"].startswith("give exactly one")
    text = api.post("/api/validate/", to_python(parse_spec(example_spec("stream"))), content_type="text/x-python")
    assert text.status_code == 200


def test_export_and_import_json_and_python(api) -> None:
    wf = create_workflow(api, example_spec("diamond"))
    exported = api.get(f"/api/workflows/{wf['id']}/export/?format=json")
    assert exported.status_code == 200 and exported["Content-Type"] == "application/json"
    assert json.loads(exported.content) == example_spec("diamond")
    source = api.get(f"/api/workflows/{wf['id']}/export/?format=python&version=1")
    assert source.status_code == 200 and source["Content-Type"].startswith("text/x-python")
    assert source.content.decode() == to_python(parse_spec(example_spec("diamond")))

    from_json = api.post("/api/workflows/import/?name=copy-json", exported.content, content_type="application/json")
    assert from_json.status_code == 201, from_json.content
    from_py = api.post("/api/workflows/import/?name=copy-py", source.content, content_type="text/x-python")
    assert from_py.status_code == 201, from_py.content
    from_file = api.post("/api/workflows/import/?name=copy-file",
                         {"file": _upload("d.py", source.content)}, format="multipart")
    assert from_file.status_code == 201, from_file.content
    for created in (from_json, from_py, from_file):
        again = api.get(f"/api/workflows/{created.json()['id']}/export/").content
        assert json.loads(again) == example_spec("diamond")
    assert api.get(f"/api/workflows/{wf['id']}/export/?format=yaml").status_code == 400
    assert api.get(f"/api/workflows/{wf['id']}/export/?version=5").status_code == 404
    dup = api.post("/api/workflows/import/", exported.content, content_type="application/json")
    assert dup.status_code == 409


def test_import_refuses_code(api) -> None:
    response = api.post("/api/workflows/import/", "import os\nos.system('touch /tmp/pwned')\n",
                        content_type="text/x-python")
    assert response.status_code == 400
    assert error_of(response)["details"][0]["code"] == "python_source"


def test_catalogue(api) -> None:
    kinds = api.get("/api/node-kinds/").json()
    by_name = {k["name"]: k for k in kinds}
    assert {"input", "output", "python"} <= set(by_name)
    assert by_name["input"]["outputs"] == {"value": {"type": "any", "optional": False}}
    assert by_name["python"]["op"] == "required" and by_name["python"]["inputs"] is None
    assert by_name["input"]["params_schema"]["properties"]["default"]
    role_kinds = {k["name"]: k for k in api.get("/api/role-kinds/").json()}
    assert "python" in role_kinds
    # Which role kinds may set tp_size > 1 (the editor's tensor-parallel field follows it).
    assert role_kinds["llm"]["tensor_parallel"] is True and role_kinds["python"]["tensor_parallel"] is False
    assert api.get("/api/graphspec/schema/").json()["title"] == "Omni-Flow GraphSpec"
    # The built-in models a role may name, with what their weights are (the editor's model field).
    models = {m["name"]: m for m in api.get("/api/models/").json()["models"]}
    assert (models["smollm2-135m"]["weights"], models["smollm2-135m"]["weights_label"]) == ("real", "real weights")
    assert {"llm", "diffusion"} <= set(models["smollm2-135m"]["role_kinds"]) and models["smollm2-135m"]["hidden"] == 576
    for name, kind in (("tiny-llama", "llm"), ("tiny-vit", "vision_encoder"), ("tiny-audio-encoder", "audio_encoder"),
                       ("tiny-vae", "vae_decoder"), ("tiny-audio-decoder", "audio_decoder")):
        assert models[name]["weights_label"] == "random weights (for testing)" and kind in models[name]["role_kinds"]


def test_auth_required_everywhere() -> None:
    anonymous = APIClient()
    for url in ("/api/workflows/", "/api/runs/", "/api/node-kinds/", "/api/tokens/"):
        response = anonymous.get(url)
        assert response.status_code == 401, url
        assert response["WWW-Authenticate"] == "Bearer"
        assert error_of(response)["error"].startswith("Authentication credentials")
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Bearer of_nope")
    response = bad.get("/api/workflows/")
    assert response.status_code == 401 and error_of(response)["error"] == "invalid or revoked API token"


def test_unknown_ids_and_urls(api) -> None:
    assert api.get("/api/workflows/00000000-0000-0000-0000-000000000000/").status_code == 404
    missing = api.get("/api/nothing-here/")
    assert missing.status_code == 404 and error_of(missing)["error"] == "not found: /api/nothing-here/"


def _upload(name: str, data: bytes):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile(name, data, content_type="application/octet-stream")
