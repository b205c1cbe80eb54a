"""Quotas on what a user keeps: workflows (busy, 429: deleting one frees a place) and a
workflow's versions (too large, 403: versions are never deleted one by one). Each version holds a
spec of up to the upload limit in the database, so neither count may grow without a bound."""

from __future__ import annotations

import pytest

from studio.workflows.models import Workflow, WorkflowVersion
from tests.studio.conftest import client_for
from tests.studio.factories import spec_doc
from tests.studio.limits import configured

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_user_keeps_at_most_their_quota_of_workflows_and_deleting_one_frees_a_place(api, staff) -> None:
    with configured(quotas={"workflows": 2}):
        made = [api.post("/api/workflows/", {"name": f"w{i}"}, format="json") for i in range(2)]
        assert [r.status_code for r in made] == [201, 201]
        over = api.post("/api/workflows/", {"name": "w2", "spec": spec_doc(name="w2")}, format="json")
        assert over.status_code == 429, over.content
        assert over.json()["details"] == [{
            "code": "quota", "limit": "workflows", "value": 2, "asked": 3, "setting": "OMNIFLOW_QUOTA_WORKFLOWS",
            "message": "you have 2 workflows; your quota is 2 (delete one you no longer need)"}]
        imported = api.post("/api/workflows/import/", {"spec": spec_doc(name="w3")}, format="json")
        assert imported.status_code == 429, imported.content
        assert client_for(staff).post("/api/workflows/", {"name": "staff-3"}, format="json").status_code == 201
        assert api.delete(f"/api/workflows/{made[0].json()['id']}/").status_code == 204
        assert api.post("/api/workflows/", {"name": "w2"}, format="json").status_code == 201
    assert sorted(Workflow.objects.exclude(name="staff-3").values_list("name", flat=True)) == ["w1", "w2"]


def test_a_workflow_keeps_at_most_its_owners_quota_of_versions(api) -> None:
    wf = api.post("/api/workflows/", {"name": "grows", "spec": spec_doc(name="grows")}, format="json").json()
    with configured(quotas={"versions": 2}):
        second = spec_doc(name="grows")
        second["description"] = "two"
        saved = api.post(f"/api/workflows/{wf['id']}/versions/", {"spec": second}, format="json")
        assert saved.status_code == 201, saved.content
        third = spec_doc(name="grows")
        third["description"] = "three"
        over = api.post(f"/api/workflows/{wf['id']}/versions/", {"spec": third}, format="json")
        assert over.status_code == 403, over.content
        assert [(d["limit"], d["value"], d["asked"]) for d in over.json()["details"]] == [("versions", 2, 3)]
        same = api.post(f"/api/workflows/{wf['id']}/versions/", {"spec": second}, format="json")
        assert same.status_code == 200, same.content  # saving what the latest holds creates nothing
    assert WorkflowVersion.objects.filter(workflow_id=wf["id"]).count() == 2
