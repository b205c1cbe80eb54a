"""Deleting runs removes what their ops wrote on the nodes that ran them (`studio.workflows.runs.folders`):
through a real Celery node agent whose role worker wrote the run's folder under the node's own data
dir (a live node is told at once; one away at the deletion removes it when it is back), and a
node's removal builds its paths itself, refusing a forged run id. A node whose data dir is not the
run worker's writes under its own (the run's folder names travel as names, `engine.spec.userfiles`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.apps import apps

from studio.workflows.apps import StudioEngine, engine
from studio.workflows.deployments import placing
from studio.workflows.models import Deployment, Run, RunFile, RunFolderRemoval
from studio.workflows.runs.folders import BadRunIds, parse_run_ids
from studio.workflows.tasks import remove_run_folders
from tests.studio.factories import create_workflow
from tests.studio.limits import python_spec
from tests.studio.test_celery_deploy import (
    CeleryNode,
    leftover_workers,
    running_node,
    started_node,
    wait_ready,
)
from tests.studio.test_run_leases import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def saving_spec() -> dict[str, Any]:
    """input `text` -> `media.save_outputs` on role `py` (writes `outputs/<run id>/reply.txt`) -> output."""
    spec = python_spec()
    spec["nodes"][1].update(op="media.save_outputs", outputs={"out": {"type": "json"}})
    spec["nodes"][2]["inputs"]["value"]["type"] = "json"
    return spec


# ------------------------------------------------------------------- a node's own removal
@pytest.fixture
def node_engine(studio_engine: StudioEngine, tmp_path: Path) -> Any:
    """This process as node `n1`, its data dir under `tmp_path/node`."""
    app = apps.get_app_config("workflows")
    config = dataclasses.replace(studio_engine.config, node_name="n1", data_dir=tmp_path / "node")
    previous = app.install(dataclasses.replace(studio_engine, config=config))
    yield config
    app.install(previous)


def test_a_node_removes_only_what_it_owes_under_its_own_root(node_engine: Any, user: Any, tmp_path: Path) -> None:
    run_id, other_run = str(uuid.uuid4()), str(uuid.uuid4())
    home = node_engine.users_root / str(user.pk)
    mine = home / "outputs" / run_id
    mine.mkdir(parents=True)
    (mine / "reply.txt").write_text("bye")
    kept = [home / "outputs" / other_run / "reply.txt", home / "x" / "keep.txt",
            tmp_path / "node" / "victim" / run_id / "keep.txt", tmp_path / "elsewhere" / run_id / "keep.txt"]
    for path in kept:
        path.parent.mkdir(parents=True)
        path.write_text("mine")
    (home / "linked").symlink_to(tmp_path / "elsewhere")
    # What the deletion recorded; names that climb out or go through a link are refused here too.
    RunFolderRemoval.objects.create(node="n1", run_id=run_id, owner_id=user.pk,
                                    folders=["outputs", "../../victim", "linked", "/abs"])
    RunFolderRemoval.objects.create(node="n2", run_id=run_id, owner_id=user.pk, folders=["outputs"])

    for forged in (["../x", run_id], [run_id.upper()], [f"{run_id}/.."], [7], "not-a-list"):
        with pytest.raises(BadRunIds, match="not a run id|come as a list"):
            remove_run_folders(node="n1", run_ids=forged)
    with pytest.raises(BadRunIds, match=r"'\.\./x' is not a run id"):
        parse_run_ids(["../x"])
    assert mine.is_dir() and RunFolderRemoval.objects.filter(node="n1").exists()  # a refused message does nothing

    assert remove_run_folders(node="n2", run_ids=[run_id]) == []  # another node's message: not ours
    assert mine.is_dir()

    assert remove_run_folders(node="n1", run_ids=[run_id]) == [run_id]
    assert not mine.exists()
    assert all(path.read_text() == "mine" for path in kept)
    assert list(RunFolderRemoval.objects.values_list("node", flat=True)) == ["n2"]
    assert remove_run_folders(node="n1", run_ids=[run_id]) == []  # done once


# ------------------------------------------------------------------ a real node agent
def run_to_end(api: Any, node: CeleryNode, deployment_id: str, text: str) -> str:
    run = api.post("/api/runs/", {"deployment": deployment_id, "inputs": {"text": text}}, format="json").json()
    node.wait_for(f"run {text!r}", lambda: Run.objects.get(pk=run["id"]).finished)
    done = Run.objects.get(pk=run["id"])
    assert done.status == "done", done.error
    return run["id"]


def node_live(name: str) -> bool:
    directory = placing.directory(engine().config)
    try:
        return any(state.record.name == name and state.live for state in directory.known())
    finally:
        directory.close()


@pytest.mark.redis
@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL (the Celery broker)")
def test_deleting_runs_removes_their_folders_on_the_node_that_ran_them(tmp_path: Path, api: Any, user: Any) -> None:
    """The run's `media.save_outputs` node runs on the deployment's role worker on the node and
    writes under the node's data dir; deleting the run has the node remove it (told at once); a
    run deleted while the node is away is owed, and removed once its agent is back; deleting the
    workflow removes its last run's too."""
    with running_node(tmp_path, {"OMNIFLOW_NODE_TTL_S": "2"}) as node:
        wf = create_workflow(api, saving_spec())
        d = api.post("/api/deployments/", {"workflow": wf["id"]}, format="json").json()
        node.wait_for("running", lambda: Deployment.objects.get(pk=d["id"]).status == "running")
        runs = [run_to_end(api, node, d["id"], text) for text in ("first", "second", "third")]
        home = tmp_path / "data" / "users" / str(user.pk) / "outputs"
        assert [(home / run / "reply.txt").read_text() for run in runs] == ["first", "second", "third"]

        assert api.delete(f"/api/runs/{runs[0]}/").status_code == 204
        node.wait_for("the node removed the first run's folder", lambda: not (home / runs[0]).exists())
        node.wait_for("nothing owed", lambda: not RunFolderRemoval.objects.exists())
        assert (home / runs[1] / "reply.txt").is_file() and (home / runs[2] / "reply.txt").is_file()

        node.stop()  # its role worker keeps running; the node is lost once its lease lapses
        wait_until("the node lost", lambda: not node_live(node.node))
        assert api.delete(f"/api/runs/{runs[1]}/").status_code == 204
        (owed,) = RunFolderRemoval.objects.all()
        assert (owed.node, str(owed.run_id), owed.owner_id, owed.folders) == (node.node, runs[1], user.pk, ["outputs"])
        assert (home / runs[1] / "reply.txt").is_file()  # nobody there to remove it yet

        node.restart()
        node.wait_for("the node back removed what it owed", lambda: not (home / runs[1]).exists())
        node.wait_for("nothing owed", lambda: not RunFolderRemoval.objects.exists())
        assert (home / runs[2] / "reply.txt").read_text() == "third"

        api.post(f"/api/deployments/{d['id']}/stop/")
        node.wait_for("stopped", lambda: Deployment.objects.get(pk=d["id"]).status == "stopped")
        assert api.delete(f"/api/workflows/{wf['id']}/").status_code == 204
        node.wait_for("the workflow's last run's folder removed", lambda: not (home / runs[2]).exists())
        assert home.is_dir()


# ---------------------------------------------- a node whose data dir is not the run worker's
@pytest.mark.redis
@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL (the Celery broker)")
def test_a_role_worker_writes_under_its_own_nodes_root_not_the_run_workers(tmp_path: Path, api: Any,
                                                                            user: Any) -> None:
    """Two nodes with data dirs of their own: `runner` claims the runs (its queue), `host` runs the
    deployments' python role, whose `media.save_outputs` writes the run's folder under the host's
    users root (the run worker sends the folder's name, never its path there); a name that goes
    through a link in the owner's folder on the host is refused by the host's worker (the studio
    cannot see that link: it is not in its data dir); the file the host wrote downloads as a run
    file, read by the host's agent; and deleting the run has the host remove what it wrote."""
    (tmp_path / "runner").mkdir()
    (tmp_path / "host").mkdir()
    host = started_node(tmp_path / "host", {"OMNIFLOW_NODE_TTL_S": "2"})
    try:
        wait_ready(host)
        with running_node(tmp_path / "runner", {"OMNIFLOW_NODE_TTL_S": "2"}) as runner:
            wait_until("both nodes live", lambda: node_live(host.node) and node_live(runner.node))
            homes = {node: tmp_path / node / "data" / "users" / str(user.pk) for node in ("runner", "host")}
            saving = create_workflow(api, saving_spec())
            deployments = [api.post("/api/deployments/", {"workflow": saving["id"], "node": host.node},
                                    format="json").json()]
            host.wait_for("running", lambda: Deployment.objects.get(pk=deployments[0]["id"]).status == "running")
            run_id = run_to_end(api, runner, deployments[0]["id"], "hello")
            run = Run.objects.get(pk=run_id)
            assert run.executed_on == [runner.node]
            assert (homes["host"] / "outputs" / run_id / "reply.txt").read_text() == "hello"
            # What the host wrote is a run file the host itself read (`runs.nodefiles`), named in the
            # owner's folder; its folder a name; never the host's server paths.
            shown = [api.get(f"/api/runs/{run_id}/").json(), api.get(f"/api/runs/{run_id}/events/").json()]
            assert str(tmp_path) not in json.dumps(shown)
            result = shown[0]["outputs"]["result"]
            assert result["dir"] == f"outputs/{run_id}"
            text = result["files"]["text"]
            assert text["name"] == f"outputs/{run_id}/reply.txt" and set(text) == {"$file", "url", "name"}
            stored = RunFile.objects.get(pk=text["$file"])
            assert (stored.size, stored.sha256) == (5, hashlib.sha256(b"hello").hexdigest())
            # in the runner's storage (its data dir is not this process's: the API here cannot serve it)
            assert (tmp_path / "runner" / "data" / "files" / stored.file.name).read_bytes() == b"hello"
            missing = api.get(text["url"])
            assert missing.status_code == 404 and "not in this server's storage" in missing.json()["error"]
            assert not (homes["runner"] / "outputs").exists()
            assert not list((tmp_path / "runner").rglob(run_id))

            victim = tmp_path / "victim"
            victim.mkdir()
            (homes["host"] / "linked").symlink_to(victim)
            linked = saving_spec()
            linked["name"] = "through-a-link"
            linked["nodes"][1]["params"] = {"out_dir": "linked"}
            escaping = create_workflow(api, linked)
            deployments.append(api.post("/api/deployments/", {"workflow": escaping["id"], "node": host.node},
                                        format="json").json())
            host.wait_for("running", lambda: Deployment.objects.get(pk=deployments[1]["id"]).status == "running")
            refused = api.post("/api/runs/", {"deployment": deployments[1]["id"], "inputs": {"text": "x"}},
                               format="json").json()
            runner.wait_for("the run through a link", lambda: Run.objects.get(pk=refused["id"]).finished)
            failed = Run.objects.get(pk=refused["id"])
            assert failed.status == "failed" and "'linked' is a symbolic link" in failed.error, failed.error
            assert str(tmp_path) not in failed.error
            assert list(victim.iterdir()) == []

            assert api.delete(f"/api/runs/{run_id}/").status_code == 204
            host.wait_for("the host removed the run's folder", lambda: not (homes["host"] / "outputs" / run_id).exists())
            runner.wait_for("nothing owed", lambda: not RunFolderRemoval.objects.exists())
            assert (homes["host"] / "outputs").is_dir() and (homes["host"] / "linked").is_symlink()

            for d in deployments:
                api.post(f"/api/deployments/{d['id']}/stop/")
                host.wait_for("stopped", lambda d=d: Deployment.objects.get(pk=d["id"]).status == "stopped")
    finally:
        if host.proc.poll() is None:
            host.stop()
        for process in leftover_workers(host.node):
            process.kill()
