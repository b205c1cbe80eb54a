"""Paths a workflow names stay under the server's roots: `../x`, `/etc/x` and a symbolic link
pointing out are refused on the role or node naming the param; names resolve under the owner's
own folder (0700) or the model directories; run outputs show run files, never server paths."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from engine.flow.validate import parse_spec
from engine.spec.ops import OpRegistry, default_ops, op
from studio.config import load_config
from studio.workflows.apps import engine
from studio.workflows.deployments import records
from studio.workflows.models import Deployment, DeploymentStatus, Run, RunFile
from studio.workflows.paths import (
    PathRefused,
    PathRoots,
    name_problem,
    resolve_spec_paths,
    resolve_under,
    spec_path_issues,
    without_roots,
)
from studio.workflows.runs.namedfiles import NotRead, ReadFile, read_here
from studio.workflows.runs.outputs import NamedFile, ServerPaths
from tests.studio.factories import create_workflow
from tests.studio.limits import configured, llm_spec, python_spec

ATTACKS = ["../x", "/etc/x", "a/../../x", "~/x", "", "a\\..\\x"]


@pytest.mark.parametrize("name", ATTACKS)
def test_names_that_are_not_relative_are_refused(name: str) -> None:
    assert name_problem(name) is not None
    with pytest.raises(ValueError):
        resolve_under(Path("/srv/root"), name)


def test_relative_names_resolve_under_the_root(tmp_path: Path) -> None:
    assert name_problem("kv/tier-1") is None
    assert resolve_under(tmp_path, "kv/./tier-1") == tmp_path / "kv" / "tier-1"


def test_a_symlink_in_any_component_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "out").symlink_to(outside)
    with pytest.raises(ValueError, match="symbolic link"):
        resolve_under(root, "a/out/x")
    with pytest.raises(ValueError, match="symbolic link"):
        resolve_under(root, "a/out")


def roots(tmp_path: Path, *models: Path) -> PathRoots:
    return PathRoots(users=tmp_path / "users", models=models)


REGISTRY = default_ops()


@op("test.export", output_dirs=("folder",))
def export(text: str, folder: str = "exported", note: str = "") -> str:
    """An op writing into a folder it declares under another name than `out_dir`."""
    return text


@op("test.save_outputs")
def save_outputs(text: str, where: str = "anywhere") -> str:
    """Named like the example's output op, declaring no output folder."""
    return text


def test_spec_paths_resolve_under_the_users_own_folder(tmp_path: Path) -> None:
    spec = llm_spec(role={"params": {"disk_path": "kv", "disk_pages": 8}})
    spec["nodes"].append({"id": "save", "kind": "python", "role": "lm", "op": "media.save_outputs"})
    spec["nodes"].append({"id": "module", "kind": "python", "role": "lm", "op": "workflows.ops.common:save_outputs"})
    spec["nodes"].append({"id": "keep", "kind": "python", "role": "lm", "op": "x:save_outputs",
                          "params": {"out_dir": "mine/out"}})
    spec["nodes"].append({"id": "unknown", "kind": "python", "role": "lm", "op": "x:save_outputs"})
    resolved = resolve_spec_paths(spec, 7, roots(tmp_path), REGISTRY)
    home = tmp_path / "users" / "7"
    assert stat.S_IMODE(home.stat().st_mode) == 0o700 and stat.S_IMODE(home.parent.stat().st_mode) == 0o700
    assert resolved["roles"][0]["params"]["disk_path"] == str(home / "kv")
    assert resolved["roles"][0]["model"] == "tiny-llama"  # a built-in name stays one
    params = {n["id"]: n.get("params", {}) for n in resolved["nodes"]}
    assert params["save"] == {"out_dir": str(home / "outputs")}  # the op's own default is the server's cwd
    assert params["module"] == {"out_dir": str(home / "outputs")}  # the same registered function
    assert params["keep"] == {"out_dir": str(home / "mine" / "out")}
    assert params["unknown"] == {}  # not a registered op: no declared folder to give
    assert spec["roles"][0]["params"]["disk_path"] == "kv"  # the document itself is not modified


def test_output_folders_are_what_the_op_declares_not_its_functions_name(tmp_path: Path) -> None:
    """`output_dirs` on `@op`, read from the registry: a folder param of another name is given a
    default and confined; a function merely named `save_outputs` gets nothing."""
    registry = OpRegistry([export, save_outputs])
    spec = python_spec()
    spec["nodes"][1].update(op="test.export")
    spec["nodes"].append({"id": "named", "kind": "python", "role": spec["nodes"][1]["role"], "op": "test.save_outputs"})
    resolved = resolve_spec_paths(spec, 4, roots(tmp_path), registry)
    params = {n["id"]: n.get("params", {}) for n in resolved["nodes"]}
    assert params["step"] == {"folder": str(tmp_path / "users" / "4" / "outputs")}
    assert params["named"] == {}
    spec["nodes"][1]["params"] = {"folder": "../../etc", "note": "../free text"}
    with pytest.raises(PathRefused) as refused:
        resolve_spec_paths(spec, 4, roots(tmp_path), registry)
    [issue] = refused.value.issues
    assert (issue.node, issue.path) == ("step", "params.folder")
    [issue] = spec_path_issues(parse_spec(spec), registry)
    assert (issue.node, issue.path) == ("step", "params.folder") and "'..'" in issue.message


def test_a_symlink_pointing_out_of_the_users_folder_is_refused(tmp_path: Path) -> None:
    home = roots(tmp_path).user_root(3)
    (home / "escape").symlink_to("/etc")
    spec = llm_spec(role={"params": {"disk_path": "escape/kv", "disk_pages": 8}})
    with pytest.raises(PathRefused) as refused:
        resolve_spec_paths(spec, 3, roots(tmp_path), REGISTRY)
    [issue] = refused.value.issues
    assert (issue.code, issue.role, issue.path) == ("path_refused", "lm", "params.disk_path")
    assert "symbolic link" in issue.message and str(tmp_path) not in issue.message


def test_checkpoints_come_from_the_model_directories(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "org" / "ckpt").mkdir(parents=True)
    (models / "org" / "ckpt" / "config.json").write_text("{}")  # what makes a folder a checkpoint
    (models / "org" / "empty").mkdir()
    resolved = resolve_spec_paths(llm_spec(role={"model": "org/ckpt"}), 1, roots(tmp_path, models), REGISTRY)
    assert resolved["roles"][0]["model"] == str(models / "org" / "ckpt")
    for name, why in [("nope", "neither a built-in"), ("org/empty", "neither a built-in"), ("../models/org/ckpt", "'..'"),
                      (str(models / "org" / "ckpt"), "absolute")]:
        with pytest.raises(PathRefused, match=why) as refused:
            resolve_spec_paths(llm_spec(role={"model": name}), 1, roots(tmp_path, models), REGISTRY)
        assert refused.value.issues[0].role == "lm" and refused.value.issues[0].path == "model"


# ------------------------------------------------------------------------------ REST
@pytest.mark.django_db
@pytest.mark.parametrize("name", ["../x", "/etc/x"])
def test_validation_reports_paths_on_the_role_or_node(api, name: str) -> None:
    role = llm_spec(role={"params": {"disk_path": name, "disk_pages": 8}})
    response = api.post("/api/validate/", {"spec": role}, format="json")
    assert response.status_code == 400
    [issue] = [d for d in response.json()["details"] if d["code"] == "path_refused"]
    assert (issue["role"], issue["path"]) == ("lm", "params.disk_path")

    node = python_spec(params={"out_dir": name})
    response = api.post("/api/validate/", {"spec": node}, format="json")
    [issue] = [d for d in response.json()["details"] if d["code"] == "path_refused"]
    assert (issue["node"], issue["path"]) == ("step", "params.out_dir")

    model = llm_spec(role={"model": name})
    response = api.post("/api/validate/", {"spec": model}, format="json")
    [issue] = [d for d in response.json()["details"] if d["code"] == "path_refused"]
    assert (issue["role"], issue["path"]) == ("lm", "model")


@pytest.mark.django_db
def test_a_run_or_deployment_through_a_symlink_is_refused(api, user) -> None:
    home = PathRoots.of(engine().config).user_root(user.pk)
    (home / "out").symlink_to("/tmp")
    wf = create_workflow(api, llm_spec(role={"params": {"disk_path": "out/kv", "disk_pages": 8}}))
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"prompt": "x"}}, format="json")
    assert run.status_code == 422, run.content
    [issue] = run.json()["details"]
    assert (issue["code"], issue["role"], issue["path"]) == ("path_refused", "lm", "params.disk_path")
    deployment = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json")
    assert deployment.status_code == 422 and deployment.json()["details"][0]["path"] == "params.disk_path"
    assert not Run.objects.exists()


# --------------------------------------------------------------------------- outputs
def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


@pytest.mark.django_db(transaction=True)
def test_outputs_reach_the_user_as_run_files_not_server_paths(api, other_api, user) -> None:
    spec = python_spec()
    spec["nodes"][1].update(op="workflows.ops.common:save_outputs", outputs={"out": {"type": "json"}})
    spec["nodes"][2]["inputs"]["value"]["type"] = "json"
    with configured(allow_module_ops=True):
        wf = create_workflow(api, spec)
        run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "hello"}}, format="json").json()
        engine().runs.wait(run["id"])
    detail = api.get(f"/api/runs/{run['id']}/").json()
    assert detail["status"] == "done", detail
    events = api.get(f"/api/runs/{run['id']}/events/").json()
    server = str(engine().config.data_dir)
    links = ("/api/", "/ws/")
    leaked = [s for s in _strings([detail, events]) if server in s or (s.startswith("/") and not s.startswith(links))]
    assert leaked == []
    result = detail["outputs"]["result"]
    assert result["dir"] == f"outputs/{run['id']}"
    text = result["files"]["text"]
    assert text["name"] == f"outputs/{run['id']}/reply.txt" and set(text) == {"$file", "url", "name"}
    download = api.get(text["url"])
    assert download.status_code == 200 and b"".join(download.streaming_content) == b"hello"
    assert other_api.get(text["url"]).status_code == 404
    assert RunFile.objects.filter(run_id=run["id"], role="output").count() == 1
    written = engine().config.users_root / str(user.pk) / "outputs" / run["id"] / "reply.txt"
    assert written.read_text() == "hello"
    assert json.dumps(detail).count(text["$file"]) >= 1
    assert not os.path.exists(Path.cwd() / "omniflow-out" / run["id"])


@pytest.mark.django_db(transaction=True)
def test_an_output_naming_another_users_file_through_dotdot_is_not_read(api, user, other_user) -> None:
    """An output string is read as a file only where it names one in its owner's folder the way a
    name resolves there (`resolve_under`): `<own folder>/../<other's id>/secret.txt`, passed from
    the user's own input to the workflow's output, begins with the owner's folder but is not stored as a run
    file, and the other user's bytes never reach the run."""
    users = engine().config.users_root
    (users / str(other_user.pk)).mkdir(parents=True, exist_ok=True)
    (users / str(other_user.pk) / "secret.txt").write_text("bob's secret")
    (users / str(user.pk)).mkdir(parents=True, exist_ok=True)
    attack = f"{users}/{user.pk}/../{other_user.pk}/secret.txt"
    spec = python_spec()
    spec["nodes"] = [spec["nodes"][0], spec["nodes"][2]]
    spec["roles"], spec["edges"] = [], [{"source": "text", "source_port": "value", "target": "result", "target_port": "value"}]
    wf = create_workflow(api, spec)
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": attack}}, format="json").json()
    engine().runs.wait(run["id"])
    detail = api.get(f"/api/runs/{run['id']}/").json()
    assert detail["status"] == "done", detail
    assert not RunFile.objects.filter(run_id=run["id"], role="output").exists()
    assert detail["outputs"]["result"] == f"../{other_user.pk}/secret.txt"
    assert "bob's secret" not in json.dumps([detail, api.get(f"/api/runs/{run['id']}/events/").json()])


@pytest.mark.django_db(transaction=True)
def test_a_file_over_the_run_file_limit_is_named_and_not_read_into_the_studio(api, user) -> None:
    """A run may name (or write) a file of any size in its owner's folder; reading it whole into the
    web process and the database would let one run exhaust both. Past `max_run_file_bytes` it is
    shown by name, nothing stored; a file within the limit in the same run is still a run file."""
    folder = engine().config.users_root / str(user.pk)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "big.bin").write_bytes(b"x" * 4096)
    (folder / "small.txt").write_bytes(b"y" * 1024)
    spec = python_spec()
    spec["nodes"] = [spec["nodes"][0], spec["nodes"][2]]
    spec["nodes"][0]["outputs"]["value"]["type"] = "json"
    spec["nodes"][1]["inputs"]["value"]["type"] = "json"
    spec["roles"], spec["edges"] = [], [{"source": "text", "source_port": "value", "target": "result", "target_port": "value"}]
    with configured(max_run_file_bytes=2048):
        wf = create_workflow(api, spec)
        inputs = {"text": [f"{folder}/big.bin", f"{folder}/small.txt"]}
        run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": inputs}, format="json").json()
        engine().runs.wait(run["id"])
    detail = api.get(f"/api/runs/{run['id']}/").json()
    assert detail["status"] == "done", detail
    big, small = detail["outputs"]["result"]
    assert big == "big.bin (not stored as a run file: larger than 2048 bytes, OMNIFLOW_MAX_RUN_FILE_BYTES)"
    assert small["name"] == "small.txt"
    assert list(RunFile.objects.filter(run_id=run["id"], role="output").values_list("size", flat=True)) == [1024]


@pytest.mark.django_db(transaction=True)
def test_a_progress_message_naming_a_server_path_reaches_the_user_as_a_name(api, user) -> None:
    spec = python_spec()
    spec["nodes"][1]["op"] = "tests.studio.fns:announce"
    folder = engine().config.users_root / str(user.pk)
    with configured(allow_module_ops=True):
        wf = create_workflow(api, spec)
        run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": f"{folder}/outputs/big.bin"}},
                       format="json").json()
        engine().runs.wait(run["id"])
    events = api.get(f"/api/runs/{run['id']}/events/").json()
    messages = [e["data"]["message"] for e in events if e["type"] == "node_progress"]
    assert messages == ["writing outputs/big.bin"], events
    nodes = api.get(f"/api/runs/{run['id']}/").json()["nodes"]  # the run's inputs show what the user gave
    assert str(engine().config.data_dir) not in json.dumps([[e for e in events if e["type"] != "run_started"], nodes])


def test_server_paths_store_only_regular_files_that_resolve_in_the_owners_folder(tmp_path: Path) -> None:
    """A path beginning with the owner's folder names a place there (`ServerPaths.named`); it is read
    (`namedfiles.read_here`) only through the owner's folder: not through `..`, not through a link in
    it (to another user's folder or out of the root), not a link itself, not past the size limit."""
    root = tmp_path / "users"
    mine, theirs = root / "7", root / "8"
    (mine / "out").mkdir(parents=True)
    theirs.mkdir()
    (mine / "out" / "reply.txt").write_text("mine")
    (mine / "out" / "big.bin").write_bytes(b"x" * 1025)
    (theirs / "secret.txt").write_text("theirs")
    (mine / "linked").symlink_to(theirs)
    (mine / "out" / "alias.txt").symlink_to(theirs / "secret.txt")
    paths = ServerPaths(mine)
    values = [f"{mine}/out/reply.txt", {"up": f"{mine}/../8/secret.txt", "link": f"{mine}/linked/secret.txt"},
              [f"{mine}/out/alias.txt", f"{mine}/out", f"{mine}/out/big.bin", f"{mine}/out/reply.txt"]]
    named = paths.named(values)
    assert named == [NamedFile("out/reply.txt"), NamedFile("../8/secret.txt"), NamedFile("linked/secret.txt"),
                     NamedFile("out/alias.txt"), NamedFile("out"), NamedFile("out/big.bin")]
    found = {file: read_here(mine, file.name, 1024) for file in named}
    assert found == {
        NamedFile("out/reply.txt"): ReadFile(b"mine", "reply.txt", "", hashlib.sha256(b"mine").hexdigest()),
        NamedFile("../8/secret.txt"): NotRead("../8/secret.txt"),
        NamedFile("linked/secret.txt"): NotRead("linked/secret.txt"),
        NamedFile("out/alias.txt"): NotRead("out/alias.txt"),
        NamedFile("out"): NotRead("out"),
        NamedFile("out/big.bin"): NotRead(
            "out/big.bin (not stored as a run file: larger than 1024 bytes, OMNIFLOW_MAX_RUN_FILE_BYTES)"),
    }

    def show(file: NamedFile) -> Any:
        read = found[file]
        return {"$file": file.name} if isinstance(read, ReadFile) else read.shown

    assert paths.hide(values, show) == [
        {"$file": "out/reply.txt"}, {"up": "../8/secret.txt", "link": "linked/secret.txt"},
        ["out/alias.txt", "out",
         "out/big.bin (not stored as a run file: larger than 1024 bytes, OMNIFLOW_MAX_RUN_FILE_BYTES)",
         {"$file": "out/reply.txt"}]]


def test_paths_a_run_wrote_on_another_nodes_root_name_places_on_that_node(tmp_path: Path) -> None:
    """A role worker on another node writes under that node's users root: its paths in the run's
    values name places in the owner's folder on that node (read there, by its agent: `runs.nodefiles`),
    never on this machine, whatever this machine holds at that path."""
    here, there = tmp_path / "here" / "7", tmp_path / "there" / "7"
    (there / "out").mkdir(parents=True)
    (there / "out" / "reply.txt").write_text("on the other node")
    paths = ServerPaths(here, elsewhere={"b": there, "a": here})
    value = {"dir": f"{there}/out", "files": [f"{there}/out/reply.txt"], "other": f"{tmp_path}/there/8/secret.txt"}
    assert paths.named([value]) == [NamedFile("out", "b"), NamedFile("out/reply.txt", "b")]
    assert paths.hide(value, lambda file: f"{file.node}:{file.name}") == {
        "dir": "b:out", "files": ["b:out/reply.txt"], "other": f"{tmp_path}/there/8/secret.txt"}
    assert paths.hide_in_text(f"cannot write {there}/out/x and {here}/y") == "cannot write out/x and y"


@pytest.mark.django_db
def test_a_deployment_whose_path_became_a_link_fails_instead_of_starting(api, user) -> None:
    wf = create_workflow(api, llm_spec(role={"params": {"disk_path": "kv", "disk_pages": 8}}))
    created = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json")
    assert created.status_code == 201, created.content
    (PathRoots.of(engine().config).user_root(user.pk) / "kv").symlink_to("/tmp")
    ticket = records.ticket(created.json()["id"])
    assert ticket is not None and ticket.status == DeploymentStatus.FAILED
    deployment = Deployment.objects.get()
    assert deployment.status == DeploymentStatus.FAILED and "symbolic link" in deployment.error
    assert str(engine().config.data_dir) not in deployment.error


def test_error_messages_name_models_and_files_not_server_paths(tmp_path: Path) -> None:
    models = tmp_path / "models"
    r = roots(tmp_path, models)
    text = (f"cannot load {models}/org/tiny-ckpt: no model.safetensors in {models}/org/tiny-ckpt;"
            f" {r.users}/12/kv is a symbolic link; {r.users}/12")
    assert without_roots(text, r) == ("cannot load org/tiny-ckpt: no model.safetensors in org/tiny-ckpt;"
                                      " kv is a symbolic link; ")
    assert without_roots("", r) == ""
    cache = tmp_path / "cache"
    cached = PathRoots(users=r.users, models=r.models, hidden=(cache,))
    assert without_roots(f"CorruptCacheError: cache {cache}/smollm2-135m-1a2b: bad manifest", cached) == (
        "CorruptCacheError: cache smollm2-135m-1a2b: bad manifest")


def test_the_studios_roots_hide_this_processs_model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIFLOW_CACHE_DIR", str(tmp_path / "built"))
    config = load_config(os.environ)
    assert PathRoots.of(config).hidden == ((tmp_path / "built").resolve(),)


def test_a_failed_workers_reason_reaches_the_api_without_the_servers_roots(api, user, tmp_path: Path) -> None:
    models = tmp_path / "models"
    with configured(model_dirs=(models,)):
        wf = create_workflow(api, python_spec())
        created = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json")
        assert created.status_code == 201, created.content
        deployment_id = created.json()["id"]
        reason = f"worker py-x exited: ModelLoadError: no model.safetensors in {models}/org/tiny-ckpt"
        records.fail_starts(deployment_id, "node-a", [records.FailedStart("py", "py-x", reason)])
        records.set_status(deployment_id, DeploymentStatus.FAILED, reason)
        shown = api.get(f"/api/deployments/{deployment_id}/").json()
    row = next(w for w in shown["workers"] if w["worker_id"] == "py-x")
    assert row["error"] == shown["error"] == "worker py-x exited: ModelLoadError: no model.safetensors in org/tiny-ckpt"
    assert str(tmp_path) not in str(shown)


@pytest.mark.django_db(transaction=True)
def test_deleting_runs_and_workflows_removes_what_their_ops_wrote(api, user) -> None:
    """`media.save_outputs` writes under `<out_dir>/<run id>/` in the owner's folder (the default
    and a folder the node names); deleting the run removes that folder, deleting the workflow
    those of its other runs, and nothing else of the user's goes."""
    spec = python_spec()
    spec["nodes"][1].update(op="media.save_outputs", outputs={"out": {"type": "json"}})
    spec["nodes"][2]["inputs"]["value"]["type"] = "json"
    spec["nodes"].append({"id": "mine", "kind": "python", "role": "py", "op": "media.save_outputs",
                          "params": {"out_dir": "mine/out"}, "inputs": {"text": {"type": "text"}},
                          "outputs": {"out": {"type": "json"}}})
    spec["edges"].append({"source": "text", "source_port": "value", "target": "mine", "target_port": "text"})
    wf = create_workflow(api, spec)
    runs = []
    for text in ("first", "second"):
        run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": text}}, format="json").json()
        assert engine().runs.wait(run["id"]) == "done", api.get(f"/api/runs/{run['id']}/").json()
        runs.append(run["id"])
    home = engine().config.users_root / str(user.pk)
    written = {run: [home / "outputs" / run / "reply.txt", home / "mine" / "out" / run / "reply.txt"] for run in runs}
    assert all(path.read_text() in ("first", "second") for paths in written.values() for path in paths)
    kept = home / "outputs" / "notes.txt"
    kept.write_text("the user's own")

    assert api.delete(f"/api/runs/{runs[0]}/").status_code == 204
    assert not (home / "outputs" / runs[0]).exists() and not (home / "mine" / "out" / runs[0]).exists()
    assert all(path.is_file() for path in written[runs[1]])

    assert api.delete(f"/api/workflows/{wf['id']}/").status_code == 204
    assert not (home / "outputs" / runs[1]).exists() and not (home / "mine" / "out" / runs[1]).exists()
    assert kept.read_text() == "the user's own" and (home / "mine" / "out").is_dir()


@pytest.mark.django_db(transaction=True)
def test_a_runs_error_names_the_model_not_the_model_directory(api, tmp_path: Path) -> None:
    """A checkpoint under a model root that does not load: the run's error, its node's and its
    events name it as the role does (`org/broken/...`), never by the server's path."""
    models = tmp_path / "models"
    (models / "org" / "broken").mkdir(parents=True)
    (models / "org" / "broken" / "config.json").write_text("not json")
    with configured(model_dirs=(models,)):
        wf = create_workflow(api, llm_spec(role={"model": "org/broken"}))
        run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"prompt": "hi"}}, format="json").json()
        engine().runs.wait(run["id"])
        detail = api.get(f"/api/runs/{run['id']}/").json()
        events = api.get(f"/api/runs/{run['id']}/events/").json()
    assert detail["status"] == "failed" and detail["failed_node"] == "gen"
    assert "ModelLoadError: org/broken/config.json: unreadable config" in detail["error"]
    assert "org/broken/config.json" in next(n for n in detail["nodes"] if n["node"] == "gen")["error"]
    assert str(tmp_path) not in json.dumps([detail, events])


def test_server_paths_cut_the_model_roots_out_of_messages(tmp_path: Path) -> None:
    mine, models = tmp_path / "users" / "7", (tmp_path / "a", tmp_path / "b")
    paths = ServerPaths(mine, models=models)
    assert paths.hide_in_text(f"cannot load {models[1]}/org/m: no weights in {models[0]}/x; {mine}/kv") == (
        "cannot load org/m: no weights in x; kv")
    nested = ServerPaths(mine, models=(tmp_path,))  # a root above the user's
    assert nested.hide_in_text(f"{mine}/kv and {tmp_path}/m") == "kv and m"
