"""Names a client gives that a column holds: a workflow's name (on create, import, rename) and an
uploaded file's content type. Too long, not a name, or one the owner already uses: a 400 naming
the field, never the database's refusal as a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from engine.compute.media import png_bytes, sample_picture
from studio.workflows.models import Run, RunFile, Workflow
from tests.studio.factories import create_workflow
from tests.studio.limits import python_spec
from tests.studio.test_limits_ops import one_op_spec

pytestmark = pytest.mark.django_db(transaction=True)

NAME_LIMIT = Workflow._meta.get_field("name").max_length
TYPE_LIMIT = RunFile._meta.get_field("content_type").max_length


def field_errors(response: Any) -> dict[str, str]:
    """A 400's details as field -> message."""
    assert response.status_code == 400, response.content[:300]
    body = response.json()
    assert set(body) == {"error", "details"}, body
    return {d["field"]: d["message"] for d in body["details"] if isinstance(d, dict) and "field" in d}


def test_an_imported_workflows_name_past_the_column_is_400(api) -> None:
    api.raise_request_exception = False
    name = "n" * (NAME_LIMIT + 1)
    response = api.post(f"/api/workflows/import/?name={name}", json.dumps(python_spec()),
                        content_type="application/json")
    assert "no more than 100 characters" in field_errors(response)["name"]
    ok = api.post(f"/api/workflows/import/?name={'n' * NAME_LIMIT}", json.dumps(python_spec()),
                  content_type="application/json")
    assert ok.status_code == 201 and ok.json()["name"] == "n" * NAME_LIMIT


@pytest.mark.parametrize("method", ["patch", "put"])
def test_renaming_to_a_name_already_used_is_400_naming_the_field(api, other_api, method: str) -> None:
    api.raise_request_exception = False
    first = create_workflow(api, python_spec(), name="first")
    create_workflow(api, python_spec(), name="second")
    theirs = create_workflow(other_api, python_spec(), name="third")
    send = getattr(api, method)
    response = send(f"/api/workflows/{first['id']}/", {"name": "second"}, format="json")
    assert field_errors(response) == {"name": "you already have a workflow named 'second'"}
    assert Workflow.objects.get(pk=first["id"]).name == "first"
    renamed = send(f"/api/workflows/{first['id']}/", {"name": "third"}, format="json")  # another user's name
    assert renamed.status_code == 200 and renamed.json()["name"] == "third"
    assert Workflow.objects.get(pk=theirs["id"]).name == "third"
    long = send(f"/api/workflows/{first['id']}/", {"name": "n" * (NAME_LIMIT + 1)}, format="json")
    assert "name" in field_errors(long)


@pytest.mark.parametrize("content_type", ["image/" + "x" * TYPE_LIMIT, "image/p\x00ng", "not a type"],
                         ids=["long", "nul", "no-slash"])
def test_an_uploads_content_type_that_is_no_media_type_is_400(api, content_type: str) -> None:
    api.raise_request_exception = False
    wf = create_workflow(api, one_op_spec("tests.studio.fns:digest", {"image": "image"}, "text"))
    upload = SimpleUploadedFile("in.png", png_bytes(sample_picture(8, 8)), content_type=content_type)
    response = api.post("/api/runs/", {"workflow": wf["id"], "image": upload}, format="multipart")
    assert "content type" in field_errors(response)["image"]
    assert not Run.objects.exists() and not RunFile.objects.exists()


def test_an_uploads_usual_content_types_still_go_through(api) -> None:
    wf = create_workflow(api, one_op_spec("tests.studio.fns:digest", {"image": "image"}, "text"))
    for content_type in ("image/png", "image/svg+xml", "application/vnd.example.v2+json", ""):
        upload = SimpleUploadedFile("in.png", png_bytes(sample_picture(8, 8)), content_type=content_type)
        response = api.post("/api/runs/", {"workflow": wf["id"], "image": upload}, format="multipart")
        assert response.status_code == 201, (content_type, response.content[:300])
