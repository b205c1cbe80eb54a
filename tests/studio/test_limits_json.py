"""What a client's JSON may hold, on every surface (REST, `/v1`, session turns, WebSocket
messages): integers that fit 64 bits, finite numbers, text without NUL characters. Anything
else is a 400 naming where it is (on a socket: the error message and close code 4400), never
a 500 or a consumer that dies, and never a value PostgreSQL refuses to store."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.db import connections

from studio.accounts.models import ApiToken
from studio.asgi import build_application
from studio.dbcalls import orm
from studio.jsonbody import JsonRefused, load_json
from studio.workflows.apps import engine
from studio.workflows.models import Run, Workflow
from tests.studio.factories import create_workflow
from tests.studio.limits import python_spec

pytestmark = pytest.mark.django_db(transaction=True)

HUGE_INTEGERS = {"10**400": "1" + "0" * 400, "5000 digits": "7" * 5000, "2**63": str(2**63),
                 "-2**63-1": str(-2**63 - 1)}
"""Integers past a signed 64-bit one (PostgreSQL's bigint, the wire's msgpack): the 5000-digit one
is past Python's own limit on converting digits to an int."""


def error_shape(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error", "details"}, body
    return body


def surfaces(workflow_id: str, value: str) -> dict[str, str]:
    """URL -> a JSON body holding `value` (raw JSON text) where that surface reads a client's JSON."""
    return {
        "/api/runs/": f'{{"workflow": "{workflow_id}", "inputs": {{"text": {value}}}}}',
        "/api/validate/": f'{{"spec": {{"version": {value}}}}}',
        "/api/workflows/": f'{{"name": "w", "layout": {{"x": {value}}}}}',
        f"/api/workflows/{workflow_id}/versions/": f'{{"spec": {json.dumps(python_spec())}, "base": {value}}}',
        f"/api/sessions/{uuid.uuid4()}/turns/": f'{{"content": "hi", "max_tokens": {value}}}',
    }


def v1_body(value: str) -> str:
    return f'{{"model": "m", "max_tokens": {value}, "messages": [{{"role": "user", "content": "hi"}}]}}'


def test_load_json_keeps_integers_within_64_bits() -> None:
    assert load_json(f"[{2**63 - 1}, {-2**63}]", max_depth=4) == [2**63 - 1, -2**63]
    for name, raw in HUGE_INTEGERS.items():
        with pytest.raises(JsonRefused) as refused:
            load_json(f'{{"a": [1, {raw}]}}', max_depth=4)
        assert refused.value.status == 400, name
        assert "$.a[1]" in refused.value.message and "64-bit" in refused.value.message, refused.value.message


@pytest.mark.parametrize("raw", HUGE_INTEGERS.values(), ids=HUGE_INTEGERS.keys())
def test_huge_integers_on_rest_and_v1_are_400(api, raw: str) -> None:
    api.raise_request_exception = False  # a 500 is what the test looks for, not an exception
    wf = create_workflow(api, python_spec())
    for url, body in surfaces(wf["id"], raw).items():
        response = api.post(url, body, content_type="application/json")
        assert response.status_code == 400, (url, response.content[:300])
        assert "64-bit" in error_shape(response)["error"], url
    response = api.post("/v1/chat/completions", v1_body(raw), content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    assert "64-bit" in response.json()["error"]["message"]
    multipart = api.post("/api/runs/", {"workflow": wf["id"], "inputs": f'{{"text": {raw}}}'}, format="multipart")
    assert multipart.status_code == 400 and "64-bit" in error_shape(multipart)["error"]
    assert not Run.objects.exists() and list(Workflow.objects.values_list("name", flat=True)) == ["work"]


# ------------------------------------------------------------------------- WebSocket
@pytest.fixture
async def _close_connections() -> Any:
    yield
    await orm(connections.close_all)()


async def refused_message(path: str, token: str, raw: str) -> tuple[dict[str, Any], int]:
    """What a socket answers to the message `raw`: its error message and close code."""
    comm = WebsocketCommunicator(build_application(engine(), resume_stale=False), path,
                                 headers=[(b"authorization", f"Bearer {token}".encode())])
    connected, _ = await comm.connect()
    assert connected
    await comm.send_to(text_data=raw)
    error: dict[str, Any] = {}
    while True:
        message = await comm.receive_output(timeout=10)
        if message["type"] == "websocket.close":
            await comm.disconnect()
            return error, message["code"]
        data = json.loads(message["text"])
        if data["type"] == "error":
            error = data


@pytest.mark.parametrize("raw", HUGE_INTEGERS.values(), ids=HUGE_INTEGERS.keys())
async def test_huge_integers_on_sockets_are_refused_with_an_error_message(api, user, raw: str,
                                                                           _close_connections: Any) -> None:
    token = await orm(lambda: ApiToken.objects.issue(user, "ws").secret)()
    wf = await orm(create_workflow)(api, python_spec())
    run = await orm(lambda: api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}},
                                     format="json").json())()
    for path in (f"/ws/runs/{run['id']}/", "/ws/metrics/"):
        error, code = await refused_message(path, token, f'{{"since": {raw}}}')
        assert (error.get("status"), code) == (400, 4400), (path, error)
        assert "64-bit" in error["error"], error


# ------------------------------------------------------------------------------- NUL
NUL_PLACES: dict[str, Any] = {"a value": {"text": "a\x00b"}, "a key": {"te\x00xt": "ab"}}
"""JSON objects holding a NUL (written `\u0000` in JSON text), which PostgreSQL stores in no text
or jsonb column."""


def test_load_json_refuses_nul_characters_naming_their_place() -> None:
    for raw, place in (('{"a": ["ok", "x\\u0000"]}', "$.a[1]"), ('{"a\\u0000b": 1}', "$"), ('"\\u0000"', "$")):
        with pytest.raises(JsonRefused) as refused:
            load_json(raw, max_depth=4)
        assert refused.value.status == 400 and f"{place}: " in refused.value.message, refused.value.message
        assert "NUL" in refused.value.message


@pytest.mark.parametrize("value", NUL_PLACES.values(), ids=NUL_PLACES.keys())
def test_nul_characters_in_json_are_400(api, value: dict[str, Any]) -> None:
    api.raise_request_exception = False  # a 500 is what the test looks for, not an exception
    wf = create_workflow(api, python_spec())
    held = json.dumps(value)
    assert "\\u0000" in held
    spec = json.dumps({**python_spec(), "meta": value})
    bodies = {
        "/api/runs/": f'{{"workflow": "{wf["id"]}", "inputs": {held}}}',
        "/api/workflows/": f'{{"name": "w", "spec": {spec}}}',
        "/api/workflows/import/": spec,
        "/api/validate/": f'{{"spec": {spec}}}',
        f"/api/workflows/{wf['id']}/versions/": f'{{"spec": {spec}, "layout": {held}}}',
        f"/api/sessions/{uuid.uuid4()}/turns/": f'{{"content": "hi", "meta": {held}}}',
    }
    for url, body in bodies.items():
        response = api.post(url, body, content_type="application/json")
        assert response.status_code == 400, (url, response.content[:300])
        assert "NUL" in error_shape(response)["error"], url
    response = api.post("/v1/chat/completions", f'{{"model": "m", "user": {held}, "messages": []}}',
                        content_type="application/json")
    assert response.status_code == 400 and "NUL" in response.json()["error"]["message"], response.content[:300]
    multipart = api.post("/api/runs/", {"workflow": wf["id"], "inputs": held}, format="multipart")
    assert multipart.status_code == 400 and "NUL" in error_shape(multipart)["error"]
    assert not Run.objects.exists() and list(Workflow.objects.values_list("name", flat=True)) == ["work"]



# ---------------------------------------------------------------- paths of odd keys
def test_paths_quote_keys_that_are_not_plain_names() -> None:
    """A key holding `.`, `[`, a quote or a space is written JSON-quoted in brackets: `{"a.b": [1, x]}`
    and `{"a": {"b": [1, x]}}` must not both be `$.a.b[1]`."""
    for raw, place in (('{"a.b": [1, NaN]}', '$["a.b"][1]'), ('{"a": {"b": [1, NaN]}}', "$.a.b[1]"),
                       ('{"x y": {"[0]": NaN}}', '$["x y"]["[0]"]'), ('{"é": {"ok_1": NaN}}', '$["é"].ok_1')):
        with pytest.raises(JsonRefused) as refused:
            load_json(raw, max_depth=4)
        assert f": {place}: " in refused.value.message, refused.value.message


# -------------------------------------------------------------------- NaN and Infinity
NOT_FINITE = {"NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity", "1e400": "1e400"}
"""Python's json reads the first three (JSON has no such literals) and makes 1e400 an infinity."""


def test_load_json_refuses_numbers_that_are_not_finite() -> None:
    assert load_json("[1.5, -2e300, 0.0]", max_depth=4) == [1.5, -2e300, 0.0]
    for raw in NOT_FINITE.values():
        with pytest.raises(JsonRefused) as refused:
            load_json(f'{{"a": {{"b": {raw}}}}}', max_depth=4)
        assert refused.value.status == 400 and "$.a.b: " in refused.value.message, refused.value.message
        assert "finite" in refused.value.message


@pytest.mark.parametrize("raw", NOT_FINITE.values(), ids=NOT_FINITE.keys())
def test_numbers_that_are_not_finite_are_400(api, raw: str) -> None:
    api.raise_request_exception = False  # a 500 is what the test looks for, not an exception
    wf = create_workflow(api, python_spec())
    spec = json.dumps(python_spec())[:-1] + f', "meta": {{"x": {raw}}}}}'
    bodies = {
        **surfaces(wf["id"], raw),
        "/api/workflows/import/": spec,
        f"/api/workflows/{wf['id']}/versions/": f'{{"spec": {spec}}}',
    }
    for url, body in bodies.items():
        response = api.post(url, body, content_type="application/json")
        assert response.status_code == 400, (url, response.content[:300])
        assert "finite" in error_shape(response)["error"], (url, error_shape(response))
    response = api.post("/v1/chat/completions", f'{{"model": "m", "temperature": {raw}, "messages": []}}',
                        content_type="application/json")
    assert response.status_code == 400 and "finite" in response.json()["error"]["message"], response.content[:300]
    assert not Run.objects.exists() and list(Workflow.objects.values_list("name", flat=True)) == ["work"]


async def test_numbers_that_are_not_finite_on_a_socket_are_refused(user, _close_connections: Any) -> None:
    token = await orm(lambda: ApiToken.objects.issue(user, "ws").secret)()
    error, code = await refused_message("/ws/metrics/", token, '{"since": NaN}')
    assert (error.get("status"), code) == (400, 4400) and "finite" in error["error"], error
