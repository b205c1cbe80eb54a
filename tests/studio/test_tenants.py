"""Tenants in the studio: every run is submitted as its owner's (or, on a deployment whose cache
scope staff made shared, as that deployment's), a graph cannot name a tenant, and only staff
share a deployment's cache. The runs here execute on the studio's own engine, whose units
every user's runs without a deployment share: the case where one user's pages would otherwise be
a hit for another's prompt."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from studio.errors import Unprocessable
from studio.workflows.apps import engine
from studio.workflows.models import CacheScope, Deployment, DeploymentStatus, Run, WorkflowVersion
from studio.workflows.operations import create_run
from studio.workflows.runs import store
from tests.studio.conftest import client_for
from tests.studio.factories import create_workflow, example_spec

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "### User:\nThe launch code is 4242-7319, keep it safe.\n\n### Assistant:\n"  # 70 bytes: 4 full pages
PAGE = 16  # workflows/chat.py's page size


def chat_spec(**reply_params: Any) -> dict[str, Any]:
    spec = example_spec("chat", tiny=True)
    for node in spec["nodes"]:
        if node["id"] == "reply":
            node["params"] = {**node["params"], "max_new_tokens": 2, **reply_params}
    return spec


def cached_tokens(api: Any, workflow_id: str, prompt: str) -> int:
    response = api.post("/api/runs/", {"workflow": workflow_id, "inputs": {"prompt": prompt}}, format="json")
    assert response.status_code == 201, response.content
    engine().runs.wait(response.json()["id"], timeout_s=120)
    run = api.get(f"/api/runs/{response.json()['id']}/").json()
    assert run["status"] == "done", run["error"]
    return run["outputs"]["usage"]["cached_tokens"]


def test_two_users_same_workflow_same_prompt_never_share_cached_tokens(api: Any, other_api: Any) -> None:
    mine = create_workflow(api, chat_spec())
    theirs = create_workflow(other_api, chat_spec())  # the same spec: one shared llm unit in this process
    assert cached_tokens(api, mine["id"], SECRET) == 0
    assert cached_tokens(api, mine["id"], SECRET) == 4 * PAGE  # the owner's repeat hits
    assert cached_tokens(other_api, theirs["id"], SECRET) == 0  # a right guess tells the other user nothing
    assert cached_tokens(other_api, theirs["id"], SECRET) == 4 * PAGE  # their own repeat hits, as always


def test_a_graph_naming_another_users_tenant_is_refused_and_overridden(api: Any, other_api: Any, user: Any,
                                                                       other_user: Any) -> None:
    mine = create_workflow(api, chat_spec())
    assert cached_tokens(api, mine["id"], SECRET) == 0
    stolen = chat_spec(tenant=f"user:{user.pk}")
    response = other_api.post("/api/workflows/", {"spec": stolen}, format="json")
    assert response.status_code == 201  # kept as a draft, with the issue on the node
    version = response.json()["latest_version"]
    issues = WorkflowVersion.objects.get(workflow_id=response.json()["id"], number=version["number"]).issues
    assert [(i["code"], i["node"]) for i in issues] == [("tenant_param", "reply")]
    assert "set by the server" in issues[0]["message"]
    refused = other_api.post("/api/runs/", {"workflow": response.json()["id"], "inputs": {"prompt": SECRET}},
                             format="json")
    assert refused.status_code == 422 and refused.json()["details"][0]["code"] == "tenant_param"
    # laid over the spec for one run (as chat turns lay sampling params), it is refused the same way
    theirs = create_workflow(other_api, chat_spec(), name="chat-2")
    latest = WorkflowVersion.objects.get(workflow_id=theirs["id"])
    with pytest.raises(Unprocessable) as err:
        create_run(other_user, latest, {"prompt": SECRET}, node_params={"reply": {"tenant": f"user:{user.pk}"}})
    assert err.value.details[0]["code"] == "tenant_param"
    assert Run.objects.filter(owner=other_user).count() == 0
    # and should such a spec reach the engine anyway, the run's own tenant wins
    run = Run.objects.create(owner=other_user, workflow=latest.workflow, version=latest,
                             inputs={"prompt": SECRET}, node_params={"reply": {"tenant": f"user:{user.pk}"}})
    engine().runs.submit(str(run.pk))
    engine().runs.wait(str(run.pk), timeout_s=120)
    run.refresh_from_db()
    assert run.status == "done", run.error
    assert run.outputs["usage"]["cached_tokens"] == 0


def test_a_run_is_its_owners_tenant_or_its_shared_deployments(user: Any, other_user: Any, api: Any) -> None:
    wf = create_workflow(api, chat_spec())
    version = WorkflowVersion.objects.get(workflow_id=wf["id"])
    own = Run.objects.create(owner=user, workflow=version.workflow, version=version)
    deployment = Deployment.objects.create(owner=user, version=version, status=DeploymentStatus.RUNNING)
    on_deployment = Run.objects.create(owner=other_user, workflow=version.workflow, version=version,
                                       deployment=deployment)
    assert own.tenant == f"user:{user.pk}" and on_deployment.tenant == f"user:{other_user.pk}"
    deployment.cache_scope = CacheScope.SHARED
    deployment.save()
    on_deployment.refresh_from_db()
    assert on_deployment.tenant == f"deployment:{deployment.pk}"
    ticket = store.claim(str(own.pk))
    assert ticket is not None and ticket.tenant == f"user:{user.pk}"


def test_only_staff_share_a_deployments_cache(api: Any, user: Any, staff: Any) -> None:
    wf = create_workflow(api, chat_spec())
    response = api.post("/api/deployments/", {"workflow": wf["id"], "cache_scope": "shared"}, format="json")
    assert response.status_code == 403, response.content
    body = response.json()
    assert "staff" in body["error"] and [d["field"] for d in body["details"]] == ["cache_scope"]
    assert Deployment.objects.count() == 0
    assert api.post("/api/deployments/", {"workflow": wf["id"], "cache_scope": "everyone"},
                    format="json").status_code == 400

    version = WorkflowVersion.objects.get(workflow_id=wf["id"])
    deployment = Deployment.objects.create(owner=user, version=version, status=DeploymentStatus.STOPPED)
    url = f"/api/deployments/{deployment.pk}/cache-scope/"
    assert api.get(f"/api/deployments/{deployment.pk}/").json()["cache_scope"] == "user"
    refused = api.post(url, {"cache_scope": "shared"}, format="json")
    assert refused.status_code == 403 and refused.json()["details"][0]["field"] == "cache_scope"
    assert api.post(url, {"cache_scope": "user"}, format="json").status_code == 200  # keeping it private is fine
    assert api.post(url, {}, format="json").status_code == 400
    shared = client_for(staff).post(url, {"cache_scope": "shared"}, format="json")
    assert shared.status_code == 200 and shared.json()["cache_scope"] == "shared"
    assert api.get("/api/deployments/").json()["results"][0]["cache_scope"] == "shared"  # the owner sees it (the UI)
    deployment.refresh_from_db()
    assert deployment.cache_scope == CacheScope.SHARED


def test_the_spec_check_names_every_node_that_sets_a_tenant() -> None:
    from studio.workflows.specs import parse_document, tenant_param_issues

    spec = copy.deepcopy(chat_spec(tenant="user:1"))
    assert [i.node for i in tenant_param_issues(parse_document(spec))] == ["reply"]
    assert tenant_param_issues(parse_document(chat_spec())) == []
