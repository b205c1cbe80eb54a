"""The example media ops take their sizes from what a run sends, so each has a declared maximum:
`omni.picture` / `omni.sound` turn a request's picture or sound into bytes, and
`media.save_outputs` writes an image (resized to a `size`) and a sound. A number where bytes
belong (`bytes(50_000_000)` is 50 MB of zeros) or a side past `MAX_SIDE` fails the node with an
error naming the input, and nothing is written."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from PIL import Image

from engine.compute.media import png_bytes, sample_picture
from engine.spec.calls import NodeContext
from studio.workflows.apps import engine
from studio.workflows.models import RunFile
from studio.workflows.paths import PathRoots
from tests.pictures import claimed_png
from tests.studio.factories import create_workflow
from workflows.ops.common import MAX_SIDE, MediaInputError, media_bytes, save_outputs

pytestmark = pytest.mark.django_db(transaction=True)

BIG = 50_000_000
"""What `bytes(n)` would make 50 MB of."""


def one_op_spec(op: str, inputs: dict[str, str], output: str) -> dict[str, Any]:
    """One input node per entry of `inputs` (name -> type) -> python node `step` running `op` -> output `result`."""
    return {
        "version": 1, "name": "media", "roles": [{"name": "py", "kind": "python"}],
        "nodes": [
            *({"id": name, "kind": "input", "outputs": {"value": {"type": kind}}} for name, kind in inputs.items()),
            {"id": "step", "kind": "python", "role": "py", "op": op,
             "inputs": {name: {"type": kind} for name, kind in inputs.items()}, "outputs": {"out": {"type": output}}},
            {"id": "result", "kind": "output", "inputs": {"value": {"type": output}}},
        ],
        "edges": [
            *({"source": name, "source_port": "value", "target": "step", "target_port": name} for name in inputs),
            {"source": "step", "source_port": "out", "target": "result", "target_port": "value"},
        ],
    }


def run_to_end(api, spec: dict[str, Any], data: dict[str, Any], fmt: str = "json") -> dict[str, Any]:
    wf = create_workflow(api, spec)
    response = api.post("/api/runs/", {"workflow": wf["id"], **data}, format=fmt)
    assert response.status_code == 201, response.content[:300]
    engine().runs.wait(response.json()["id"])
    return api.get(f"/api/runs/{response.json()['id']}/").json()


def step_error(run: dict[str, Any]) -> str:
    assert run["status"] == "failed" and run["failed_node"] == "step", (run["status"], run["error"])
    return next(n for n in run["nodes"] if n["node"] == "step")["error"]


def written(user: Any) -> list[tuple[str, int]]:
    """Every file under the user's own folder (where save_outputs writes), with its size."""
    root = PathRoots.of(engine().config).users / str(user.pk)
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("op,port", [("omni.picture", "image"), ("omni.sound", "audio")])
def test_picture_and_sound_refuse_a_number_for_bytes(api, op: str, port: str) -> None:
    run = run_to_end(api, one_op_spec(op, {"request": "json"}, port), {"inputs": {"request": {port: BIG}}})
    error = step_error(run)
    assert f"request.{port}" in error and "not an integer" in error, error
    assert not RunFile.objects.exists()


def test_media_bytes_are_bytes_or_byte_lists_within_the_limit() -> None:
    assert media_bytes(b"abc", "x", limit=3) == b"abc" and media_bytes([1, 2], "x", limit=3) == b"\x01\x02"
    problems = [(4, "x must be a file's bytes or a list of byte values, not an integer"),
                (True, "x must be a file's bytes or a list of byte values, not an integer"),
                (b"abcd", "x: 4 bytes, over the limit of 3"),
                ([1, 2, 3, 4], "x: 4 bytes, over the limit of 3"),
                ([256], "x must be a file's bytes or a list of byte values (0 to 255)"),
                ("png", "x must be a file's bytes or a list of byte values, not str")]
    for value, problem in problems:
        with pytest.raises(MediaInputError) as refused:
            media_bytes(value, "x", limit=3)
        assert problem in str(refused.value), (value, str(refused.value))


def test_picture_still_takes_the_sample_and_byte_lists(api) -> None:
    picture = png_bytes(sample_picture(8, 8))
    run = run_to_end(api, one_op_spec("omni.picture", {"request": "json"}, "image"),
                     {"inputs": {"request": {"image": list(picture)}}})
    assert run["status"] == "done", run["error"]
    assert RunFile.objects.get(name="result").file.read() == picture


def save_spec(image_type: str = "image") -> dict[str, Any]:
    return one_op_spec("media.save_outputs", {"image": image_type, "size": "json"}, "json")


def test_save_outputs_refuses_a_number_for_the_image(api, user) -> None:
    run = run_to_end(api, save_spec(image_type="json"), {"inputs": {"image": BIG, "size": None}})
    error = step_error(run)
    assert "image" in error and "not an integer" in error, error
    assert written(user) == []


@pytest.mark.parametrize("size,problem", [
    ({"width": MAX_SIDE + 1, "height": 1}, f"size.width must be an integer from 1 to {MAX_SIDE}"),
    ({"width": 8, "height": 0}, f"size.height must be an integer from 1 to {MAX_SIDE}"),
    ({"width": 8.5, "height": 8}, f"size.width must be an integer from 1 to {MAX_SIDE}"),
    ({"width": 8}, "size must be an object with an integer width and height"),
])
def test_save_outputs_refuses_sizes_past_the_limit(api, user, size: dict[str, Any], problem: str) -> None:
    upload = SimpleUploadedFile("in.png", png_bytes(sample_picture(8, 8)), content_type="image/png")
    run = run_to_end(api, save_spec(), {"image": upload, "inputs": json.dumps({"size": size})}, fmt="multipart")
    assert problem in step_error(run)
    assert written(user) == []


def test_save_outputs_resizes_within_the_limit(api, user) -> None:
    upload = SimpleUploadedFile("in.png", png_bytes(sample_picture(8, 8)), content_type="image/png")
    run = run_to_end(api, save_spec(), {"image": upload, "inputs": '{"size": {"width": 40, "height": 20}}'},
                     fmt="multipart")
    assert run["status"] == "done", run["error"]
    (name, _), = written(user)
    assert Path(name).name == "image.png"
    saved = RunFile.objects.get(filename="image.png").file.read()
    with Image.open(io.BytesIO(saved)) as picture:
        assert picture.size == (40, 20)


def test_save_outputs_refuses_to_resize_a_picture_whose_header_claims_too_many_pixels(tmp_path: Path) -> None:
    """Resizing decodes the picture whole: one whose header claims more than MAX_IMAGE_PIXELS is
    refused first (the studio's upload check stops such a file at the door; an op's output may still
    carry one)."""
    ctx = NodeContext(run_id="r1", node_id="save", iteration=0, attempt=1, report_progress=lambda *_: None)
    with pytest.raises(MediaInputError, match="5000x4000 pixels, over the limit"):
        save_outputs(ctx, image=claimed_png(5000, 4000), size={"width": 8, "height": 8}, out_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []

