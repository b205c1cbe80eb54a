"""Runs over REST: submit (JSON and multipart), execution through the engine, per-node state,
files, cancel, filters, limits, metrics and health."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

import pytest
from django.apps import apps
from django.conf import settings as django_settings
from django.core.files.uploadedfile import SimpleUploadedFile

from studio.workflows.apps import build_engine, engine
from studio.workflows.models import Deployment, DeploymentStatus, Run, RunEvent, WorkflowVersion
from tests.pictures import claimed_png
from tests.studio import fns
from tests.studio.factories import create_workflow, example_spec, spec_doc

pytestmark = pytest.mark.django_db(transaction=True)


def submit(api, workflow_id: str, inputs: dict | None = None, **extra) -> dict:
    response = api.post("/api/runs/", {"workflow": workflow_id, "inputs": inputs or {}, **extra}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def finished(api, run: dict) -> dict:
    engine().runs.wait(run["id"])
    return api.get(f"/api/runs/{run['id']}/").json()


def wait_until(ready: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def image_spec() -> dict:
    spec = spec_doc(op="tests.studio.fns:digest")
    spec["nodes"][0]["outputs"]["value"]["type"] = "image"
    spec["nodes"][1]["inputs"] = {"image": {"type": "image"}}
    spec["edges"][0]["target_port"] = "image"
    return spec


def test_example_runs_to_completion_with_node_states(api) -> None:
    wf = create_workflow(api, example_spec("diamond"))
    run = submit(api, wf["id"], {"n": 2})
    assert run["status"] == "pending" and run["version"] == 1
    assert [n["node"] for n in run["nodes"]] == ["n", "square", "cube", "memo", "total", "sum"]
    done = finished(api, run)
    assert done["status"] == "done" and done["outputs"] == {"sum": 12}
    assert done["started_at"] and done["finished_at"] and done["duration_ms"] > 0
    states = {n["node"]: n["state"] for n in done["nodes"]}
    assert states == {"n": "done", "square": "done", "cube": "done", "memo": "done", "total": "done", "sum": "done"}
    square = next(n for n in done["nodes"] if n["node"] == "square")
    assert square["outputs"] == {"out": 4} and square["attempts"] == 1 and square["duration_ms"] >= 0
    seqs = list(RunEvent.objects.filter(run_id=run["id"]).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(len(seqs))) and done["last_seq"] == seqs[-1]
    events = api.get(f"/api/runs/{run['id']}/events/?since=3&limit=2").json()
    assert [e["seq"] for e in events] == [3, 4]
    assert api.get(f"/api/runs/{run['id']}/events/").json()[-1]["type"] == "run_finished"


def test_failing_node_fails_the_run(api) -> None:
    wf = create_workflow(api, spec_doc(op="tests.studio.fns:fail"))
    done = finished(api, submit(api, wf["id"], {"text": "x"}))
    assert done["status"] == "failed" and done["failed_node"] == "step"
    assert "refusing 'x'" in done["error"]
    assert {n["node"]: n["state"] for n in done["nodes"]}["step"] == "failed"


def test_bad_submissions(api, other_api) -> None:
    wf = create_workflow(api, spec_doc())
    cases = [
        ({"workflow": wf["id"], "inputs": {"text": "x", "nope": 1}}, 422, "inputs do not match"),
        ({"workflow": wf["id"], "inputs": {}}, 422, "inputs do not match"),
        ({"workflow": wf["id"], "inputs": {"text": 42}}, 422, "inputs do not match"),
        ({"workflow": wf["id"], "inputs": [1]}, 400, "invalid request"),
        ({"workflow": wf["id"], "version": 7}, 404, "has no version 7"),
        ({"inputs": {}}, 400, "invalid request"),
        ({"workflow": "00000000-0000-0000-0000-000000000000"}, 404, "Not found"),
    ]
    for body, status, message in cases:
        response = api.post("/api/runs/", body, format="json")
        assert response.status_code == status, (body, response.content)
        assert message in response.json()["error"], response.json()
    typed = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": 42}}, format="json").json()
    assert typed["details"] == ["input 'text' is text: give it a string, not a number"], typed
    assert other_api.post("/api/runs/", {"workflow": wf["id"]}, format="json").status_code == 404
    empty = api.post("/api/workflows/", {"name": "empty"}, format="json").json()
    assert api.post("/api/runs/", {"workflow": empty["id"]}, format="json").status_code == 409
    assert Run.objects.count() == 0


def test_invalid_or_forbidden_versions_do_not_run(api, strict_engine) -> None:
    wf = create_workflow(api, spec_doc(op="os:system"))
    response = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "ls"}}, format="json")
    assert response.status_code == 422
    assert response.json()["details"][0]["code"] == "op_not_allowed"


def test_multipart_image_input_and_png_output_file(api, other_api) -> None:
    wf = create_workflow(api, image_spec())
    data = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
    response = api.post("/api/runs/", {"workflow": wf["id"], "inputs": "{}",
                                       "text": SimpleUploadedFile("in.png", data, content_type="image/png")},
                        format="multipart")
    assert response.status_code == 201, response.content
    run = response.json()
    assert set(run["inputs"]["text"]) == {"$file"}
    done = finished(api, run)
    import hashlib

    assert done["status"] == "done" and done["outputs"] == {"result": hashlib.sha256(data).hexdigest()}
    [upload] = done["files"]
    assert upload["role"] == "input" and upload["size"] == len(data)
    download = api.get(upload["url"])
    assert download.status_code == 200 and b"".join(download.streaming_content) == data
    assert other_api.get(upload["url"]).status_code == 404

    png = create_workflow(api, spec_doc(op="tests.studio.fns:png"), name="png")
    done = finished(api, submit(api, png["id"], {"text": "pixels"}))
    url = done["output_links"]["result"]
    output = api.get(url)
    assert output["Content-Type"] == "image/png"
    assert b"".join(output.streaming_content) == fns.png("pixels")
    assert other_api.get(url).status_code == 404


def test_bad_uploads(api, settings) -> None:
    wf = create_workflow(api, spec_doc())
    text_file = api.post("/api/runs/", {"workflow": wf["id"], "text": SimpleUploadedFile("a.txt", b"x")},
                         format="multipart")
    assert text_file.status_code == 400 and "files go to inputs of type" in text_file.json()["details"][0]["message"]
    bad_json = api.post("/api/runs/", {"workflow": wf["id"], "inputs": "{nope"}, format="multipart")
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]
    img = create_workflow(api, image_spec(), name="img")
    limit = settings.OMNIFLOW.max_upload_bytes
    big = api.post("/api/runs/", {"workflow": img["id"], "text": SimpleUploadedFile("big.png", b"x" * (limit + 1))},
                   format="multipart")
    assert big.status_code == 413 and "upload limit" in big.json()["error"]
    bomb = api.post("/api/runs/", {"workflow": img["id"], "text": SimpleUploadedFile("bomb.png", claimed_png(5000, 4000))},
                    format="multipart")
    assert bomb.status_code == 400 and bomb.json()["details"] == [
        {"field": "text", "message": "the image is 5000x4000 pixels, over the limit of 16777216 pixels (width times height)"}]
    pillows_bomb = api.post("/api/runs/", {"workflow": img["id"], "text": SimpleUploadedFile(
        "bomb.png", claimed_png(20000, 20000))}, format="multipart")
    assert pillows_bomb.status_code == 400 and "too large" in pillows_bomb.json()["details"][0]["message"]
    big_json = api.post("/api/validate/", {"spec": {"description": "x" * limit}}, format="json")
    assert big_json.status_code == 413
    assert Run.objects.count() == 0


def test_cancel(api, other_api) -> None:
    wf = create_workflow(api, spec_doc(op="tests.studio.fns:wait_forever"))
    run = submit(api, wf["id"], {"text": "x"})
    assert other_api.post(f"/api/runs/{run['id']}/cancel/").status_code == 404
    response = api.post(f"/api/runs/{run['id']}/cancel/")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "cancelled" and body["error"] == "cancelled by request"
    assert {n["node"]: n["state"] for n in body["nodes"]}["step"] == "cancelled"
    again = api.post(f"/api/runs/{run['id']}/cancel/")
    assert again.status_code == 409 and "already finished" in again.json()["error"]
    last = api.get(f"/api/runs/{run['id']}/events/").json()[-1]
    assert last["type"] == "run_finished" and last["data"]["status"] == "cancelled"


def test_list_filters_and_isolation(api, other_api) -> None:
    ok = create_workflow(api, spec_doc())
    bad = create_workflow(api, spec_doc(op="tests.studio.fns:fail"), name="bad")
    runs = [finished(api, submit(api, ok["id"], {"text": "a"})), finished(api, submit(api, bad["id"], {"text": "b"}))]
    ids = lambda r: {x["id"] for x in r.json()["results"]}  # noqa: E731
    assert ids(api.get("/api/runs/")) == {r["id"] for r in runs}
    assert ids(api.get("/api/runs/?status=failed")) == {runs[1]["id"]}
    assert ids(api.get("/api/runs/?status=done,failed")) == {r["id"] for r in runs}
    assert ids(api.get(f"/api/runs/?workflow={ok['id']}&version=1")) == {runs[0]["id"]}
    assert ids(api.get("/api/runs/?created_after=2100-01-01T00:00:00Z")) == set()
    assert ids(api.get("/api/runs/?created_before=2100-01-01T00:00:00")) == {r["id"] for r in runs}
    for query in ("status=bogus", "workflow=12", "version=x", "created_after=yesterday"):
        assert api.get(f"/api/runs/?{query}").status_code == 400, query
    assert other_api.get("/api/runs/").json()["results"] == []
    assert other_api.get(f"/api/runs/{runs[0]['id']}/").status_code == 404
    assert other_api.get(f"/api/runs/{runs[0]['id']}/events/").status_code == 404
    assert api.get("/api/runs/00000000-0000-0000-0000-000000000000/").status_code == 404


def test_a_run_names_the_deployment_it_ran_on(api, user) -> None:
    wf = create_workflow(api, spec_doc())
    on_engine = finished(api, submit(api, wf["id"], {"text": "a"}))
    version = WorkflowVersion.objects.get(workflow_id=wf["id"])
    named = Deployment.objects.create(owner=user, version=version, name="echoer", status=DeploymentStatus.RUNNING)
    unnamed = Deployment.objects.create(owner=user, version=version, status=DeploymentStatus.STOPPED)
    # Recorded as a run of each would be; no worker runs it here (the serializer is what is tested).
    runs = {d.pk: Run.objects.create(owner=user, workflow=version.workflow, version=version, deployment=d)
            for d in (named, unnamed)}
    listed = {r["id"]: (r["deployment"], r["deployment_name"]) for r in api.get("/api/runs/").json()["results"]}
    assert listed == {on_engine["id"]: (None, None), str(runs[named.pk].pk): (str(named.pk), "echoer"),
                      str(runs[unnamed.pk].pk): (str(unnamed.pk), "")}
    detail = api.get(f"/api/runs/{runs[named.pk].pk}/").json()
    assert (detail["deployment"], detail["deployment_name"]) == (str(named.pk), "echoer")
    assert api.get(f"/api/runs/{on_engine['id']}/").json()["deployment_name"] is None


def test_only_chat_shaped_deployments_are_chat_models(api, user) -> None:
    """`/v1/models` and a deployment's `chat` flag offer the examples that answer in text, and not
    image_generation: it has an llm, a text input and a text output, but its result is a picture."""
    names = ("chat", "vision_chat", "omni_dialogue", "pd_chat", "image_generation", "hello")
    for name in names:
        wf = create_workflow(api, example_spec(name))
        version = WorkflowVersion.objects.get(workflow_id=wf["id"], number=1)
        Deployment.objects.create(owner=user, version=version, name=name, status=DeploymentStatus.RUNNING)
    models = api.get("/v1/models")
    assert models.status_code == 200, models.content
    assert sorted(m["id"] for m in models.json()["data"]) == ["chat", "omni_dialogue", "pd_chat", "vision_chat"]
    flags = {d["name"]: d["chat"] for d in api.get("/api/deployments/").json()["results"]}
    assert flags == {"chat": True, "vision_chat": True, "omni_dialogue": True, "pd_chat": True,
                     "image_generation": False, "hello": False}
    refused = api.post("/v1/chat/completions", {"model": "image_generation", "messages": [{"role": "user",
                                                                                         "content": "hi"}]},
                       format="json")
    assert refused.status_code == 400 and "a chat reply is text" in refused.json()["error"]["message"], refused.content


def test_metrics_and_health(api, client, staff) -> None:
    wf = create_workflow(api, spec_doc())
    finished(api, submit(api, wf["id"], {"text": "a"}))
    client.force_login(staff)
    text = client.get("/metrics").content.decode()
    assert 'omniflow_runs_finished_total{status="done"} 1.0' in text
    assert 'omniflow_node_latency_seconds_count{kind="python"} 1.0' in text
    assert 'omniflow_runs{status="done"} 1.0' in text
    assert "omniflow_runs_active 0.0" in text
    health = client.get("/healthz").json()
    assert health["status"] == "ok" and health["checks"]["database"] == "ok"


def media_spec() -> dict:
    """text -> `paint` (a PNG, fns.png) -> `step` (its digest) -> result: the image is no output."""
    spec = image_spec()
    spec["nodes"][0]["outputs"]["value"]["type"] = "text"
    spec["nodes"].append({"id": "paint", "kind": "python", "role": "py", "op": "tests.studio.fns:png",
                          "inputs": {"text": {"type": "text"}}, "outputs": {"out": {"type": "image"}}})
    spec["edges"] = [
        {"source": "text", "source_port": "value", "target": "paint", "target_port": "text"},
        {"source": "paint", "source_port": "out", "target": "step", "target_port": "image"},
        *spec["edges"][1:],
    ]
    return spec


def test_a_node_image_is_a_run_file_of_its_owner_and_each_node_says_where_it_ran(api, other_api) -> None:
    wf = create_workflow(api, media_spec())
    done = finished(api, submit(api, wf["id"], {"text": "pixels"}))
    import hashlib

    assert done["status"] == "done" and done["outputs"] == {"result": hashlib.sha256(fns.png("pixels")).hexdigest()}
    [kept] = [f for f in done["files"] if f["role"] == "node"]
    assert kept["content_type"] == "image/png" and kept["name"] == "paint.out" and kept["size"] == len(fns.png("pixels"))
    paint = next(n for n in done["nodes"] if n["node"] == "paint")
    assert paint["outputs"] == {"out": {"$file": kept["id"], "url": kept["url"], "content_type": "image/png",
                                        "bytes": kept["size"]}}
    events = [e["data"] for e in api.get(f"/api/runs/{done['id']}/events/").json()]
    [output] = [e for e in events if e["type"] == "node_output" and e["node"] == "paint"]
    assert output["value"]["url"] == kept["url"]
    download = api.get(kept["url"])
    assert download.status_code == 200 and download["Content-Type"] == "image/png"
    assert b"".join(download.streaming_content) == fns.png("pixels")
    assert other_api.get(kept["url"]).status_code == 404
    import time

    detail = api.get(f"/api/runs/{done['id']}/").json()
    assert abs(detail["server_time"] - time.time()) < 5  # the live clock
    # The graph comes with the run, so the run view draws it before any event (no second request).
    version = api.get(f"/api/workflows/{wf['id']}/versions/{done['version']}/").json()
    assert (detail["spec"], detail["layout"]) == (version["spec"], version["layout"])
    running = [e for e in events if e["type"] == "node_state" and e["state"] == "running"]
    assert {e["node"] for e in running} == {"paint", "step"}
    assert all(e["worker"].startswith("in-process:") and e["host"] for e in running)
    # Run again from its inputs: a new run, its own file for the same image.
    again = finished(api, submit(api, wf["id"], done["inputs"]))
    assert again["inputs"] == {"text": "pixels"}
    [copy] = [f for f in again["files"] if f["role"] == "node"]
    assert copy["id"] != kept["id"] and copy["sha256"] == kept["sha256"]


def node_media_spec() -> dict:
    """text -> step -> result, and beside it text -> `album` (fns.gallery: images in a list and a
    dict) and text -> `film` (fns.frames: an image streamed per word): no output holds an image."""
    return spec_doc(extra_nodes=[
        {"id": "album", "kind": "python", "role": "py", "op": "tests.studio.fns:gallery",
         "inputs": {"text": {"type": "text"}}, "outputs": {"out": {"type": "json"}}},
        {"id": "film", "kind": "python", "role": "py", "op": "tests.studio.fns:frames", "stream": True,
         "inputs": {"text": {"type": "text"}}, "outputs": {"out": {"type": "image"}}},
    ]) | {"edges": [*spec_doc()["edges"],
                    {"source": "text", "source_port": "value", "target": "album", "target_port": "text"},
                    {"source": "text", "source_port": "value", "target": "film", "target_port": "text"}]}


def test_images_in_lists_dicts_and_streamed_frames_are_run_files_of_their_owner(api, other_api) -> None:
    wf = create_workflow(api, node_media_spec())
    done = finished(api, submit(api, wf["id"], {"text": "sea sky"}))
    assert done["status"] == "done", done
    files = {f["name"]: f for f in done["files"] if f["role"] == "node"}
    # Each image where it sat: the bytes that are no image, and the caption, stay as they were.
    assert set(files) == {"album.out[images][0]", "album.out[images][1]", "album.out[cover][front]",
                          "film.out#0", "film.out#1"}
    expected = {"album.out[images][0]": fns.png("sea sky-0"), "album.out[images][1]": fns.png("sea sky-1"),
                "album.out[cover][front]": fns.png("sea sky-cover"), "film.out#0": fns.png("sea"),
                "film.out#1": fns.png("sky")}
    for name, data in expected.items():
        download = api.get(files[name]["url"])
        assert download.status_code == 200 and download["Content-Type"] == "image/png"
        assert b"".join(download.streaming_content) == data  # the bytes the node made
        assert other_api.get(files[name]["url"]).status_code == 404  # its owner's only

    def media(name: str) -> dict:
        f = files[name]
        return {"$file": f["id"], "url": f["url"], "content_type": "image/png", "bytes": f["size"]}

    album = next(n for n in done["nodes"] if n["node"] == "album")
    assert album["outputs"] == {"out": {
        "images": [media("album.out[images][0]"), media("album.out[images][1]")],
        "cover": {"front": media("album.out[cover][front]")}, "raw": {"bytes": 2}, "caption": "sea sky"}}
    events = [e["data"] for e in api.get(f"/api/runs/{done['id']}/events/").json()]
    frames = [e for e in events if e["type"] == "node_output" and e["node"] == "film"]
    assert [(e["frame"], e["value"]) for e in frames] == [(0, media("film.out#0")), (1, media("film.out#1"))]
    body = json.dumps(done) + json.dumps(events)
    assert str(django_settings.OMNIFLOW.data_dir) not in body  # no server path


def test_pending_runs_list_their_place_in_the_queue(api, other_api) -> None:
    wf = create_workflow(api, spec_doc())
    first, second, third = (finished(api, submit(api, wf["id"], {"text": t})) for t in "abc")
    # The embedded engine starts runs at once: wait them out, then queue two as a busy studio would.
    Run.objects.filter(pk__in=[first["id"], third["id"]]).update(status="pending")
    listed = {r["id"]: r["queue_position"] for r in api.get("/api/runs/").json()["results"]}
    assert listed == {first["id"]: 1, second["id"]: None, third["id"]: 2}
    assert api.get(f"/api/runs/{third['id']}/").json()["queue_position"] == 2
    other = create_workflow(other_api, spec_doc())
    theirs = finished(other_api, submit(other_api, other["id"], {"text": "d"}))
    Run.objects.filter(pk=theirs["id"]).update(status="pending")
    # Everyone's pending runs count: the queue is shared, so theirs is behind ours.
    assert other_api.get(f"/api/runs/{theirs['id']}/").json()["queue_position"] == 3


def test_a_studio_running_one_run_at_a_time_queues_the_rest_in_order(api, other_api) -> None:
    """`OMNIFLOW_MAX_RUNS=1`: a second and third run wait, pending, with their places; cancelling one
    takes it out of the queue at once; the next starts when the running one ends."""
    app = apps.get_app_config("workflows")
    studio = build_engine(dataclasses.replace(django_settings.OMNIFLOW, allow_module_ops=True, max_runs=1))
    previous = app.install(studio)
    fns.GATE.clear()
    try:
        wf = create_workflow(api, spec_doc(op="tests.studio.fns:gated"))
        first = submit(api, wf["id"], {"text": "a"})
        wait_until(lambda: api.get(f"/api/runs/{first['id']}/").json()["status"] == "running", "the first run starts")
        second = submit(api, wf["id"], {"text": "b"})
        theirs = submit(other_api, create_workflow(other_api, spec_doc(op="tests.studio.fns:gated"))["id"],
                        {"text": "c"})
        assert api.get(f"/api/runs/{second['id']}/").json()["queue_position"] == 1
        assert other_api.get(f"/api/runs/{theirs['id']}/").json()["queue_position"] == 2
        cancelled = api.post(f"/api/runs/{second['id']}/cancel/")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.content
        assert other_api.get(f"/api/runs/{theirs['id']}/").json()["queue_position"] == 1
        assert other_api.get(f"/api/runs/{theirs['id']}/").json()["status"] == "pending"
        fns.GATE.set()
        assert finished(api, first)["outputs"] == {"result": "A"}
        done = finished(other_api, theirs)
        assert done["status"] == "done" and done["outputs"] == {"result": "C"}
        assert done["started_at"] >= api.get(f"/api/runs/{first['id']}/").json()["finished_at"]
    finally:
        fns.GATE.set()
        studio.runs.stop()
        app.install(previous)


@pytest.mark.parametrize(("example", "tiny", "random"), [
    ("image_generation", False, ["diffusion", "vae"]),  # smollm2 is real; the diffusion head and tiny-vae are seeded
    ("image_generation", True, ["llm", "diffusion", "vae"]),
    ("chat", False, []),
    ("diamond", False, []),
])
def test_a_run_names_the_roles_that_computed_with_random_weights(api, user, example: str, tiny: bool,
                                                                   random: list[str]) -> None:
    """The run view notes them, as the catalogue and the editor do: what those roles made is noise."""
    wf = create_workflow(api, example_spec(example, tiny=tiny))
    version = WorkflowVersion.objects.get(workflow_id=wf["id"], number=1)
    run = Run.objects.create(owner=user, workflow=version.workflow, version=version)
    body = api.get(f"/api/runs/{run.pk}/").json()
    assert body["random_weights_roles"] == random

