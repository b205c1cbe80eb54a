"""Browser sessions with CSRF, API tokens, the management commands, the OpenAPI schema
and the admin."""

from __future__ import annotations

import builtins
import dataclasses
import datetime as dt
import io
import symtable
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings
from rest_framework.test import APIClient

from studio.accounts.models import ApiToken
from studio.workflows.management.commands.setup_demo import CHAT_SNIPPET_HEAD, chat_snippet
from studio.workflows.models import Deployment, Workflow
from tests.studio.conftest import client_for

EXAMPLES = sorted(p.stem for p in (Path(__file__).parents[2] / "workflows").glob("*.py") if p.stem != "__init__")

pytestmark = pytest.mark.django_db


def run_command(*args: str, **options) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out, stderr=io.StringIO(), **options)
    return out.getvalue()


def test_session_login_needs_csrf_and_writes_need_csrf(user) -> None:
    browser = APIClient(enforce_csrf_checks=True)
    session = browser.get("/api/auth/session/").json()
    assert session["user"] is None and session["csrf_token"]
    no_csrf = browser.post("/api/auth/session/", {"username": "alice", "password": "alice-password-1"},
                           format="json")
    assert no_csrf.status_code == 403 and "CSRF" in no_csrf.json()["error"]
    csrf = browser.cookies["csrftoken"].value
    wrong = browser.post("/api/auth/session/", {"username": "alice", "password": "nope"}, format="json",
                         HTTP_X_CSRFTOKEN=csrf)
    assert wrong.status_code == 401
    ok = browser.post("/api/auth/session/", {"username": "alice", "password": "alice-password-1"},
                      format="json", HTTP_X_CSRFTOKEN=csrf)
    assert ok.status_code == 200 and ok.json()["user"]["username"] == "alice"
    assert browser.get("/api/workflows/").status_code == 200  # reads need no token
    assert browser.get("/api/auth/session/").json()["user"]["username"] == "alice"  # a reload still knows
    csrf = browser.cookies["csrftoken"].value  # rotated at login
    blocked = browser.post("/api/workflows/", {"name": "x"}, format="json")
    assert blocked.status_code == 403 and "CSRF" in blocked.json()["error"]
    allowed = browser.post("/api/workflows/", {"name": "x"}, format="json", HTTP_X_CSRFTOKEN=csrf)
    assert allowed.status_code == 201
    assert browser.delete("/api/auth/session/", HTTP_X_CSRFTOKEN=csrf).status_code == 204
    assert browser.get("/api/workflows/").status_code == 401


def test_token_api(api, user) -> None:
    created = api.post("/api/tokens/", {"name": "ci"}, format="json")
    assert created.status_code == 201
    secret = created.json()["token"]
    assert ApiToken.objects.get(pk=created.json()["id"]).key_hash != secret  # only the hash is kept
    fresh = APIClient()
    fresh.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert fresh.get("/api/workflows/").status_code == 200
    assert {t["name"] for t in api.get("/api/tokens/").json()} == {"test", "ci"}
    assert api.delete(f"/api/tokens/{created.json()['id']}/").status_code == 204
    assert fresh.get("/api/workflows/").status_code == 401


def test_token_last_use_is_recorded_at_most_once_a_minute(api, other_api, user) -> None:
    created = api.post("/api/tokens/", {"name": "laptop"}, format="json").json()
    assert created["last_used_at"] is None
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created['token']}")
    assert client.get("/api/workflows/").status_code == 200
    token = ApiToken.objects.get(pk=created["id"])
    first = token.last_used_at
    assert first is not None
    assert client.get("/api/workflows/").status_code == 200
    assert ApiToken.objects.get(pk=token.pk).last_used_at == first  # within the minute: not written again
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=first - dt.timedelta(minutes=2))
    assert client.get("/api/workflows/").status_code == 200
    assert ApiToken.objects.get(pk=token.pk).last_used_at > first - dt.timedelta(minutes=2)
    listed = {t["name"]: t for t in api.get("/api/tokens/").json()}
    assert listed["laptop"]["last_used_at"] is not None and "token" not in listed["laptop"]  # shown once only
    # Another user neither sees nor revokes it.
    assert "laptop" not in {t["name"] for t in other_api.get("/api/tokens/").json()}
    assert other_api.delete(f"/api/tokens/{created['id']}/").status_code == 404
    assert client.get("/api/workflows/").status_code == 200


def test_inactive_users_tokens_do_not_work(user) -> None:
    secret = ApiToken.objects.issue(user).secret
    user.is_active = False
    user.save()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert client.get("/api/workflows/").status_code == 401


def test_create_token_command(user) -> None:
    secret = run_command("create_token", "alice").strip()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert client.get("/api/workflows/").status_code == 200
    with pytest.raises(CommandError, match="no user 'nobody'"):
        run_command("create_token", "nobody")


def test_load_examples_is_idempotent(user) -> None:
    out = run_command("load_examples", owner="alice")
    assert out.splitlines() == [f"{name}: created" for name in EXAMPLES]
    # Loaded together, updated in one instant: the workflows list (newest first) shows them by name.
    assert len({w.updated_at for w in Workflow.objects.filter(owner=user)}) == 1
    listed = client_for(user).get("/api/workflows/").json()["results"]
    assert [w["name"] for w in listed] == sorted(EXAMPLES)
    again = run_command("load_examples", owner="alice")
    assert "diamond: version 1 (unchanged)" in again
    assert Workflow.objects.filter(owner=user).count() == len(EXAMPLES)
    assert all(w.latest_version().valid for w in Workflow.objects.all())
    with pytest.raises(CommandError, match="no user"):
        run_command("load_examples", owner="ghost")


def test_load_examples_reports_broken_files(user, tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise ImportError('nope')\n")
    with pytest.raises(CommandError, match="1 example"):
        run_command("load_examples", owner="alice", dir=str(tmp_path))


def test_setup_demo(django_user_model) -> None:
    out = run_command("setup_demo", "--token", "--password", "demo-password-9")
    assert "login: demo / demo-password-9" in out
    demo = django_user_model.objects.get(username="demo")
    assert demo.check_password("demo-password-9")
    assert Workflow.objects.filter(owner=demo).count() == len(EXAMPLES)
    secret = next(line for line in out.splitlines() if line.startswith("token: ")).split()[1]
    assert ApiToken.objects.resolve(secret).user == demo
    # The chat workflow is deployed as the model "chat", pending: the server starts it.
    (chat,) = Deployment.objects.filter(owner=demo, name="chat")
    assert (chat.status, chat.version.workflow.name, chat.version.number) == ("pending", "chat", 1)
    first = next(line for line in out.splitlines() if line.startswith("chat token: ")).split()[2]
    assert ApiToken.objects.resolve(first).user == demo
    assert f'api_key="{first}"' in out and 'model="chat"' in out and "base_url=\"http://127.0.0.1:8000/v1\"" in out
    out = run_command("setup_demo", "--no-examples")  # make run again: the deployment stays, a new token
    password = out.strip().splitlines()[1].split(" / ")[1]
    demo.refresh_from_db()
    assert demo.check_password(password) and "updated user 'demo'" in out
    assert "chat: kept workflow 'chat' version 1" in out
    assert [d.pk for d in Deployment.objects.filter(owner=demo, name="chat")] == [chat.pk]
    second = next(line for line in out.splitlines() if line.startswith("chat token: ")).split()[2]
    assert ApiToken.objects.resolve(first) is None and ApiToken.objects.resolve(second).user == demo
    # A changed chat workflow replaces the deployment; --no-chat leaves it alone.
    version = chat.version
    spec = {**version.spec, "description": "changed"}
    version.workflow.versions.create(number=2, spec=spec, spec_hash="changed", layout=version.layout, author=demo,
                                     valid=True)
    out = run_command("setup_demo", "--no-examples")
    chat.refresh_from_db()
    assert chat.status == "stopped" and "replaced by version 2" in chat.error
    (live,) = Deployment.objects.filter(owner=demo, name="chat", status="pending")
    assert live.version.number == 2 and "chat: deployed workflow 'chat' version 2" in out
    out = run_command("setup_demo", "--no-examples", "--no-chat")
    assert "chat" not in out and Deployment.objects.filter(owner=demo, status="pending").count() == 1


def unbound_names(source: str) -> set[str]:
    """The names `source` (a module) uses that neither it nor Python's builtins define."""
    table = symtable.symtable(source, "<pasted>", "exec")
    symbols = table.get_symbols()
    defined = {s.get_name() for s in symbols if s.is_assigned() or s.is_imported()}
    return {s.get_name() for s in symbols if s.is_referenced()} - defined - set(dir(builtins))


def test_setup_demo_prints_python_that_runs_as_pasted_and_the_readme_shows_it() -> None:
    out = run_command("setup_demo")
    assert out.count(CHAT_SNIPPET_HEAD) == 1
    secret = next(line for line in out.splitlines() if line.startswith("chat token: ")).split()[2]
    pasted = out.split(CHAT_SNIPPET_HEAD + "\n", 1)[1].rstrip("\n")  # the output's last lines
    assert pasted == chat_snippet("http://127.0.0.1:8000", secret)
    # Pasted into the interpreter, line by line: none indented (an IndentationError there), each a
    # statement, and every name it uses defined by it (the client's module imported).
    lines = pasted.splitlines()
    assert lines and all(line == line.lstrip() for line in lines)
    for line in lines:
        compile(line, "<pasted>", "single")
    assert unbound_names(pasted) == set()
    assert f'api_key="{secret}"' in pasted and 'model="chat"' in pasted
    # The README shows what `make run` prints, the token aside.
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert f"{CHAT_SNIPPET_HEAD}\n{chat_snippet('http://127.0.0.1:8000', '<TOKEN>')}\n```" in readme


def test_setup_demo_prints_the_address_it_is_given() -> None:
    out = run_command("setup_demo", "--url", "https://studio.example:9000/")
    assert 'base_url="https://studio.example:9000/v1"' in out and "127.0.0.1" not in out
    for bad in ("studio.example:9000", "ftp://studio.example", "http://"):
        with pytest.raises(CommandError, match=f"--url '{bad}'"):
            run_command("setup_demo", "--no-examples", "--url", bad)


def test_openapi_schema_has_no_warnings(tmp_path: Path) -> None:
    target = tmp_path / "schema.yaml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(target))
    text = target.read_text()
    for path in ("/api/workflows/{id}/export/", "/api/runs/{id}/cancel/", "/api/node-kinds/",
                 "/api/workflows/{workflow_id}/versions/{number}/diff/", "/api/validate/"):
        assert path in text


def test_schema_and_docs_are_served(client) -> None:
    assert client.get("/api/schema/").status_code == 200
    docs = client.get("/api/docs/")
    assert docs.status_code == 200 and b"swagger-ui" in docs.content


def test_admin_pages_render(client, django_user_model, api) -> None:
    from tests.studio.factories import create_workflow, spec_doc

    create_workflow(api, spec_doc())
    admin = django_user_model.objects.create_superuser("admin", password="admin-password-1")
    client.force_login(admin)
    for model in ("workflow", "workflowversion", "deployment", "worker", "run", "noderun", "runevent", "runfile",
                  "session"):
        assert client.get(f"/admin/workflows/{model}/").status_code == 200, model
    assert client.get("/admin/accounts/apitoken/").status_code == 200
    wf = Workflow.objects.get()
    assert client.get(f"/admin/workflows/workflow/{wf.pk}/change/").status_code == 200


def test_the_admin_neither_shows_nor_changes_a_deployments_secret_plane_key(client, staff, api, user) -> None:
    from django.contrib.auth.models import Permission
    from django.utils.html import escape

    from engine.data.curve import PlaneKeys
    from studio.workflows.models import Deployment, DeploymentStatus, WorkflowVersion
    from tests.studio.factories import create_workflow, spec_doc

    wf = create_workflow(api, spec_doc())
    keys = PlaneKeys.generate()
    row = Deployment.objects.create(owner=user, version=WorkflowVersion.objects.get(workflow_id=wf["id"], number=1),
                                    status=DeploymentStatus.RUNNING, plane_public=keys.public,
                                    plane_secret=keys.secret)
    staff.user_permissions.add(*Permission.objects.filter(codename__in=["view_deployment", "change_deployment"]))
    client.force_login(staff)
    page = client.get(f"/admin/workflows/deployment/{row.pk}/change/")
    assert page.status_code == 200
    body = page.content.decode()
    secret = (keys.secret, escape(keys.secret))  # Z85 keys hold characters HTML escapes
    assert not any(form in body for form in secret) and 'name="plane_secret"' not in body
    assert escape(keys.public) in body and 'name="plane_public"' not in body  # shown, not editable
    listing = client.get("/admin/workflows/deployment/")
    assert listing.status_code == 200 and not any(form in listing.content.decode() for form in secret)


def test_deployment_keys_writes_a_running_deployments_keys_and_nothing_for_an_ended_one(api, user, tmp_path) -> None:
    from engine.data.curve import BulkMode, PlaneKeys
    from studio.workflows.models import Deployment, DeploymentStatus, WorkflowVersion
    from tests.studio.factories import create_workflow, spec_doc

    wf = create_workflow(api, spec_doc())
    version = WorkflowVersion.objects.get(workflow_id=wf["id"], number=1)
    keys = PlaneKeys.generate()
    row = Deployment.objects.create(owner=user, version=version, status=DeploymentStatus.RUNNING,
                                    plane_public=keys.public, plane_secret=keys.secret)
    assert "wrote the keys" in run_command("deployment_keys", str(row.pk), str(tmp_path / "keys"))
    assert PlaneKeys.load(tmp_path / "keys") == keys
    # The studio's bulk mode travels with the keys, so a worker started by hand follows it.
    encrypted = dataclasses.replace(settings.OMNIFLOW, plane_bulk=BulkMode.ENCRYPTED)
    with override_settings(OMNIFLOW=encrypted):
        run_command("deployment_keys", str(row.pk), str(tmp_path / "encrypted"))
    assert PlaneKeys.load(tmp_path / "encrypted") == keys.with_bulk(BulkMode.ENCRYPTED)
    Deployment.objects.filter(pk=row.pk).update(status=DeploymentStatus.STOPPED, plane_public="", plane_secret="")
    with pytest.raises(CommandError, match="has ended"):
        run_command("deployment_keys", str(row.pk), str(tmp_path / "again"))
    with pytest.raises(CommandError, match="not a deployment id"):
        run_command("deployment_keys", "nope", str(tmp_path / "again"))
