"""Request limits: deeply nested or oversized JSON on every surface (REST, `/v1`, session turns,
WebSocket messages) is a 400/413 with the error shape, never a 500; throttles on login, token
creation and run submission answer 429."""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connections

from studio.accounts.models import ApiToken
from studio.asgi import build_application
from studio.config import Throttles
from studio.dbcalls import orm
from studio.jsonbody import JsonRefused, json_depth, load_json
from studio.workflows.apps import engine
from studio.workflows.models import Run
from tests.studio.factories import create_workflow
from tests.studio.limits import configured, python_spec

DEEP = "[" * 10_000 + "]" * 10_000
"""Past the JSON parser's own recursion limit."""
NESTED = '{"a": ' * 100 + "1" + "}" * 100
"""Parses, but past OMNIFLOW_MAX_JSON_DEPTH."""


def test_load_json_limits() -> None:
    assert json_depth({"a": [1, {"b": []}]}) == 4 and json_depth(5) == 0
    assert load_json('{"a": [1]}', max_depth=2) == {"a": [1]}
    for raw in (DEEP, NESTED):
        with pytest.raises(JsonRefused) as refused:
            load_json(raw, max_depth=64)
        assert refused.value.status == 400 and "OMNIFLOW_MAX_JSON_DEPTH" in refused.value.message
    with pytest.raises(JsonRefused) as refused:
        load_json("[1, 2]", max_depth=64, max_bytes=4)
    assert refused.value.status == 413


def error_shape(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error", "details"}, body
    return body


@pytest.mark.django_db
@pytest.mark.parametrize("raw", [DEEP, NESTED], ids=["deep", "nested"])
def test_nested_json_on_rest_is_400(api, raw: str) -> None:
    wf = create_workflow(api, python_spec())
    bodies = {
        "/api/runs/": f'{{"workflow": "{wf["id"]}", "inputs": {{"text": {raw}}}}}',
        "/api/workflows/": f'{{"name": "x", "spec": {raw}}}',
        "/api/validate/": raw,
        f"/api/workflows/{wf['id']}/versions/": f'{{"spec": {raw}}}',
    }
    for url, body in bodies.items():
        response = api.post(url, body, content_type="application/json")
        assert response.status_code == 400, (url, response.content[:300])
        assert "OMNIFLOW_MAX_JSON_DEPTH" in error_shape(response)["error"], url
    multipart = api.post("/api/runs/", {"workflow": wf["id"], "inputs": raw}, format="multipart")
    assert multipart.status_code == 400 and "OMNIFLOW_MAX_JSON_DEPTH" in error_shape(multipart)["error"]
    imported = api.post("/api/workflows/import/", {"file": _upload(raw)}, format="multipart")
    assert imported.status_code == 400, imported.content[:300]
    assert not Run.objects.exists()


def _upload(raw: str) -> Any:
    return SimpleUploadedFile("spec.json", raw.encode(), "application/json")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("raw", [DEEP, NESTED], ids=["deep", "nested"])
def test_nested_json_on_v1_and_session_turns_is_400(api, raw: str) -> None:
    response = api.post("/v1/chat/completions", f'{{"model": "m", "messages": {raw}}}',
                        content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    assert "OMNIFLOW_MAX_JSON_DEPTH" in response.json()["error"]["message"]
    turn = api.post(f"/api/sessions/{uuid.uuid4()}/turns/", f'{{"content": {raw}}}', content_type="application/json")
    assert turn.status_code == 400 and "OMNIFLOW_MAX_JSON_DEPTH" in error_shape(turn)["error"]


@pytest.mark.django_db(transaction=True)
def test_oversized_bodies_are_413(api, settings) -> None:
    settings.OMNIFLOW = dataclasses.replace(settings.OMNIFLOW, max_upload_bytes=4096)
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]})
    for url in ("/v1/chat/completions", "/api/runs/", "/api/validate/"):
        response = api.post(url, big, content_type="application/json")
        assert response.status_code == 413, url
        assert "upload limit" in error_shape(response)["error"]


# ------------------------------------------------------------------------- WebSocket
@pytest.fixture
async def _close_connections() -> Any:
    yield
    await orm(connections.close_all)()


def _connect(path: str, token: str) -> WebsocketCommunicator:
    return WebsocketCommunicator(build_application(engine(), resume_stale=False), path,
                                 headers=[(b"authorization", f"Bearer {token}".encode())])


async def _refusal(comm: WebsocketCommunicator) -> tuple[dict[str, Any], int]:
    """The error message (events sent before it skipped) and the close code after it."""
    error: dict[str, Any] = {}
    while True:
        message = await comm.receive_output(timeout=10)
        if message["type"] == "websocket.close":
            return error, message["code"]
        data = json.loads(message["text"])
        if data["type"] == "error":
            error = data


WS_LIMITS = pytest.mark.parametrize("raw,status", [(DEEP, 400), (NESTED, 400),
                                                   ('{"since": "' + "x" * 40_000 + '"}', 413)],
                                    ids=["deep", "nested", "oversized"])


async def _refused_on(path: str, token: str, raw: str, status: int) -> None:
    with configured(max_ws_message_bytes=32_768):
        comm = _connect(path, token)
        connected, _ = await comm.connect()
        assert connected
        await comm.send_to(text_data=raw)
        message, code = await _refusal(comm)
        assert (message["type"], message["status"], code) == ("error", status, 4000 + status), path
        await comm.disconnect()  # the consumer ends as it would on a real socket


@pytest.mark.django_db(transaction=True)
@WS_LIMITS
async def test_run_socket_messages_past_the_limits_are_refused(api, user, raw: str, status: int,
                                                               _close_connections: Any) -> None:
    token = await orm(lambda: ApiToken.objects.issue(user, "ws").secret)()
    wf = await orm(create_workflow)(api, python_spec(op="tests.studio.fns:wait_forever"))
    run = await orm(lambda: api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}},
                                                        format="json").json())()
    await _refused_on(f"/ws/runs/{run['id']}/", token, raw, status)
    await orm(engine().runs.cancel)(run["id"])


@pytest.mark.django_db(transaction=True)
@WS_LIMITS
async def test_metrics_socket_messages_past_the_limits_are_refused(user, raw: str, status: int,
                                                                   _close_connections: Any) -> None:
    token = await orm(lambda: ApiToken.objects.issue(user, "ws").secret)()
    await _refused_on("/ws/metrics/", token, raw, status)


# -------------------------------------------------------------------------- throttles
LOW = Throttles(login="2/minute", token="1/minute", run="2/minute")


@pytest.mark.django_db
def test_login_is_throttled(client, user) -> None:
    with configured(throttles=LOW):
        codes = [client.post("/api/auth/session/", {"username": "alice", "password": "wrong"},
                             content_type="application/json").status_code for _ in range(3)]
        assert codes == [401, 401, 429]
        throttled = client.post("/api/auth/session/", {"username": "alice", "password": "alice-password-1"},
                                content_type="application/json")
        assert throttled.status_code == 429 and "throttled" in error_shape(throttled)["error"]
        assert int(throttled["Retry-After"]) > 0
        assert client.get("/api/auth/session/").status_code == 200  # reading the session is not a log-in


@pytest.mark.django_db
def test_token_creation_is_throttled(api) -> None:
    with configured(throttles=LOW):
        assert api.post("/api/tokens/", {"name": "a"}, format="json").status_code == 201
        throttled = api.post("/api/tokens/", {"name": "b"}, format="json")
        assert throttled.status_code == 429 and error_shape(throttled)["error"]
        assert api.get("/api/tokens/").status_code == 200


@pytest.mark.django_db
def test_run_submission_is_throttled_per_user(api, other_api) -> None:
    wf = create_workflow(api, python_spec())
    with configured(throttles=LOW):
        codes = [api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}}, format="json").status_code
                 for _ in range(3)]
        assert codes == [201, 201, 429]
        assert api.get("/api/runs/").status_code == 200
        other = create_workflow(other_api, python_spec())
        assert other_api.post("/api/runs/", {"workflow": other["id"], "inputs": {"text": "x"}},
                              format="json").status_code == 201
    assert Run.objects.count() == 3


@pytest.mark.django_db(transaction=True)
def test_v1_chat_completions_and_session_turns_are_throttled(api) -> None:
    body = json.dumps({"model": "none", "messages": [{"role": "user", "content": "hi"}]})
    with configured(throttles=dataclasses.replace(LOW, run="1/minute")):
        assert api.post("/v1/chat/completions", body, content_type="application/json").status_code == 404
        throttled = api.post("/v1/chat/completions", body, content_type="application/json")
        assert throttled.status_code == 429
        assert throttled.json()["error"]["code"] == "rate_limit_exceeded"
        turn = api.post(f"/api/sessions/{uuid.uuid4()}/turns/", json.dumps({"content": "hi"}),
                        content_type="application/json")  # the same scope: a turn submits a run
        assert turn.status_code == 429 and "OMNIFLOW_THROTTLE_RUN" in error_shape(turn)["error"]
