"""What the editor checks before a save, over REST: roles' models against the engine's catalogue
and the model roots, ops against the registry; `/api/models/` (what the Model picker offers); and
the README's quick start imported as source and run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from studio.workflows.apps import StudioEngine
from studio.workflows.models import Run
from tests.studio.factories import ROOT, create_workflow, spec_doc
from tests.studio.limits import configured, llm_spec

pytestmark = pytest.mark.django_db


@pytest.fixture
def model_root(tmp_path: Path) -> Path:
    """A model root with a checkpoint `org/ckpt`, a folder that is not one, a hidden checkpoint, and a
    link to a checkpoint outside the root."""
    root = tmp_path / "models"
    for folder in ("org/ckpt", "org/not-a-checkpoint", ".cache/ckpt"):
        (root / folder).mkdir(parents=True)
    for folder in ("org/ckpt", ".cache/ckpt"):
        (root / folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (root / "org" / "linked").symlink_to(outside)
    return root


@pytest.fixture
def rooted_engine(studio_engine: StudioEngine, model_root: Path) -> Iterator[StudioEngine]:
    """A studio as deployed (registered ops only) whose OMNIFLOW_MODEL_DIRS is `model_root`."""
    with configured(allow_module_ops=False, model_dirs=(model_root,)) as studio:
        yield studio


def details(response: Any) -> list[tuple[str, str | None, str | None]]:
    assert response.status_code == 400, response.content
    return [(d["code"], d.get("role") or d.get("node"), d.get("path")) for d in response.json()["details"]]


def test_models_lists_built_in_models_and_checkpoints_by_relative_name(api, rooted_engine, model_root) -> None:
    response = api.get("/api/models/")
    assert response.status_code == 200
    body = response.json()
    models = {m["name"]: m for m in body["models"]}
    assert body["checkpoints_truncated"] is False
    tiny = models["tiny-llama"]
    assert (tiny["source"], tiny["random_weights"], tiny["label"]) == ("builtin", True, "random weights (for testing)")
    assert sorted(tiny["role_kinds"]) == ["diffusion", "llm"]
    real = models["smollm2-135m"]
    assert (real["random_weights"], real["label"]) == (False, "real weights")
    assert models["tiny-vit"]["role_kinds"] == ["vision_encoder"]
    # Per role kind: smollm2-135m is real weights for an llm role, a seeded (random) head for a
    # diffusion one, as the engine's catalogue says of a role of that kind (issue #20).
    assert real["weights_by_kind"] == {"llm": "real", "diffusion": "random"}
    assert real["weights"] == "real"  # what clients read before stays as it was
    assert tiny["weights_by_kind"] == {"diffusion": "random", "llm": "random"}
    assert models["tiny-vit"]["weights_by_kind"] == {"vision_encoder": "random"}
    checkpoints = [m for m in body["models"] if m["source"] == "checkpoint"]
    assert [m["name"] for m in checkpoints] == ["org/ckpt"]  # not the plain folder, the hidden one, the link
    assert sorted(checkpoints[0]["role_kinds"]) == ["diffusion", "llm", "sglang_llm"]
    assert checkpoints[0]["weights_by_kind"] == {"diffusion": "random", "llm": "real", "sglang_llm": "real"}
    assert str(model_root) not in response.content.decode()  # never a server path


def test_a_role_without_a_model_or_with_an_unknown_one_is_an_issue_before_save(api, rooted_engine) -> None:
    missing = api.post("/api/validate/", {"spec": llm_spec(role={"model": None})}, format="json")
    assert details(missing) == [("model_missing", "lm", "model")]
    assert "tiny-llama" in missing.json()["details"][0]["message"]  # it says what would do
    unknown = api.post("/api/validate/", {"spec": llm_spec(role={"model": "org/not-a-checkpoint"})}, format="json")
    assert details(unknown) == [("model_unknown", "lm", "model")]
    linked = api.post("/api/validate/", {"spec": llm_spec(role={"model": "org/linked"})}, format="json")
    assert details(linked) == [("model_unknown", "lm", "model")]
    absolute = api.post("/api/validate/", {"spec": llm_spec(role={"model": "/etc"})}, format="json")
    assert details(absolute) == [("path_refused", "lm", "model")]  # said once
    for good in ("org/ckpt", "tiny-llama", "smollm2-135m"):
        ok = api.post("/api/validate/", {"spec": llm_spec(role={"model": good})}, format="json")
        assert ok.status_code == 200, (good, ok.content)
    # Saved as a draft that says why; a run or a deployment of it is refused before anything starts.
    wf = create_workflow(api, llm_spec(role={"model": None}))
    version = api.get(f"/api/workflows/{wf['id']}/versions/1/").json()
    assert [(i["code"], i["role"]) for i in version["issues"]] == [("model_missing", "lm")]
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"prompt": "x"}}, format="json")
    assert run.status_code == 422 and run.json()["details"][0]["code"] == "model_missing"
    deployment = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json")
    assert deployment.status_code == 422 and deployment.json()["details"][0]["code"] == "model_missing"
    assert not Run.objects.exists()


def test_an_unregistered_op_is_an_issue_on_its_node_and_field(api, rooted_engine) -> None:
    response = api.post("/api/validate/", {"spec": spec_doc(op="hello.greeet")}, format="json")
    assert details(response) == [("op_unknown", "step", "op")]
    assert "did you mean 'hello.greet'" in response.json()["details"][0]["message"]
    save = api.post("/api/workflows/", {"spec": spec_doc(op="hello.greeet")}, format="json")
    assert save.status_code == 201 and save.json()["latest_version"]["valid"] is False


def test_an_llm_node_with_no_prompt_wired_is_an_issue_on_its_node_and_port(api, rooted_engine) -> None:
    spec = llm_spec()  # as the editor draws it: the kind's ports, none wired into it
    spec["nodes"][1]["inputs"] = {"prompt": {"type": "text", "optional": True},
                                  "tokens": {"type": "tokens", "optional": True}}
    spec["edges"] = [e for e in spec["edges"] if e["target"] != "gen"]
    expected = {"code": "missing_input", "node": "gen", "port": "prompt",
                "message": "node 'gen' needs a prompt: connect its input port gen.prompt or gen.tokens"}
    response = api.post("/api/validate/", {"spec": spec}, format="json")
    assert response.status_code == 400 and response.json()["details"] == [expected]
    report = api.post("/api/validate/?report=1", {"spec": spec}, format="json").json()  # what the editor asks
    assert (report["valid"], report["issues"]) == (False, [expected])
    # Saved as a draft that says why (as every issue is); a run of it is refused before anything starts.
    wf = create_workflow(api, spec)
    assert wf["latest_version"]["valid"] is False
    assert api.get(f"/api/workflows/{wf['id']}/versions/1/").json()["issues"] == [expected]
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"prompt": "x"}}, format="json")
    assert run.status_code == 422 and run.json()["details"] == [expected]
    assert not Run.objects.exists()


@pytest.mark.django_db(transaction=True)  # the run starts when its row is committed
def test_the_readme_quick_start_imports_as_source_and_runs(api, rooted_engine) -> None:
    source = (ROOT / "workflows" / "hello.py").read_text()
    readme = (ROOT / "README.md").read_text()
    assert source.split('"""\n\n', 1)[1] in readme  # the README shows this file
    imported = api.post("/api/workflows/import/", source, content_type="text/x-python")
    assert imported.status_code == 201, imported.content
    workflow = imported.json()
    assert workflow["name"] == "hello" and workflow["latest_version"]["valid"] is True
    run = api.post("/api/runs/", {"workflow": workflow["id"], "inputs": {"name": "omni"}}, format="json")
    assert run.status_code == 201, run.content
    rooted_engine.runs.wait(run.json()["id"])
    body = api.get(f"/api/runs/{run.json()['id']}/").json()
    assert (body["status"], body["outputs"]) == ("done", {"greeting": "hello, omni"}), body


def retyped(spec: dict[str, Any], input_type: str, target_port: str = "prompt") -> dict[str, Any]:
    """`spec` (llm_spec) with its input `prompt` of `input_type`, wired into the llm's `target_port`."""
    nodes = [{**n, "outputs": {"value": {"type": input_type}}} if n["id"] == "prompt" else n for n in spec["nodes"]]
    if target_port != "prompt":
        nodes = [{**n, "inputs": {target_port: {"type": "tokens"}}} if n["id"] == "gen" else n for n in nodes]
    edges = [{**e, "target_port": target_port} if e["source"] == "prompt" else e for e in spec["edges"]]
    return {**spec, "nodes": nodes, "edges": edges}


@pytest.mark.parametrize(("input_type", "target_port", "expects"), [
    ("image", "prompt", "text"), ("json", "prompt", "text"), ("json", "tokens", "tokens"), ("text", "tokens", "tokens"),
])
def test_an_input_retyped_to_what_its_port_does_not_take_is_a_type_mismatch_before_save(
        api, rooted_engine, input_type: str, target_port: str, expects: str) -> None:
    """Issue #20: an input node's type changed in the editor while it feeds an llm port that takes
    another type; /api/validate/ (as the editor asks it, `?report=1`, and plainly) names the edge,
    the port it feeds and both types."""
    spec = retyped(llm_spec(), input_type, target_port)
    edge = f"prompt.value->gen.{target_port}"
    plain = api.post("/api/validate/", {"spec": spec}, format="json")
    assert plain.status_code == 400, plain.content
    [issue] = [d for d in plain.json()["details"] if d["code"] == "type_mismatch"]
    assert (issue["edge"], issue["node"], issue["port"]) == (edge, "gen", target_port)
    assert issue["message"] == (f"edge {edge}: output prompt.value is {input_type} but input gen.{target_port}"
                                f" expects {expects}")
    report = api.post("/api/validate/?report=1", {"spec": spec}, format="json")
    assert report.status_code == 200 and report.json()["valid"] is False
    assert [i["code"] for i in report.json()["issues"]] == ["type_mismatch"]


@pytest.mark.parametrize(("input_type", "target_port"), [("any", "prompt"), ("any", "tokens"), ("text", "prompt"),
                                                         ("tokens", "tokens")])
def test_an_input_of_a_type_its_port_takes_passes(api, rooted_engine, input_type: str, target_port: str) -> None:
    response = api.post("/api/validate/", {"spec": retyped(llm_spec(), input_type, target_port)}, format="json")
    assert response.status_code == 200, response.content
