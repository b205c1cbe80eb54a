"""Whole numbers in query strings (`?since=`, `?limit=`, `?version=`, `?against=`, a socket's
`?since=`) and the ids in URLs: what is not a number within its column's range is a 400 naming
the parameter (on a socket: an error message and close code 4400), never a 500."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import pytest
from channels.testing import WebsocketCommunicator
from django.db import connections

from studio.accounts.models import ApiToken
from studio.asgi import build_application
from studio.dbcalls import orm
from studio.errors import BadRequest
from studio.numbers import DB_INT_MAX, count
from studio.workflows.apps import engine
from tests.studio.factories import create_workflow
from tests.studio.limits import python_spec

pytestmark = pytest.mark.django_db(transaction=True)

NOT_COUNTS = {"superscript two": "²", "5000 digits": "9" * 5000, "past the column": str(DB_INT_MAX + 1),
              "10**30": "1" + "0" * 30, "negative": "-1", "spaced": " 1"}
"""`"²".isdigit()` is true, and `int("²")` raises; 5000 digits are past Python's int conversion
limit; the others are numbers no integer column holds, or no whole number at all."""


def test_count_reads_ascii_digits_within_the_bounds() -> None:
    assert count("0", "since", 10) == 0 and count("0010", "since", 10) == 10
    assert count(str(DB_INT_MAX), "since", DB_INT_MAX) == DB_INT_MAX
    for raw in [*NOT_COUNTS.values(), "", "11", "0"]:
        with pytest.raises(BadRequest) as refused:
            count(raw, "limit", 10, minimum=1)
        assert refused.value.message.startswith("limit must be a whole number from 1 to 10, not "), raw


def error_of(response: Any) -> str:
    body = response.json()
    assert set(body) == {"error", "details"}, body
    return body["error"]


@pytest.mark.parametrize("raw", NOT_COUNTS.values(), ids=NOT_COUNTS.keys())
def test_query_numbers_out_of_range_are_400_naming_the_parameter(api, raw: str) -> None:
    api.raise_request_exception = False  # a 500 is what the test looks for, not an exception
    wf = create_workflow(api, python_spec())
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}}, format="json").json()
    engine().runs.wait(run["id"])
    versions = f"/api/workflows/{wf['id']}/versions/"
    urls = {
        f"/api/runs/{run['id']}/events/": "since",
        f"/api/runs/{run['id']}/events/?since=0": "limit",
        f"/api/runs/?workflow={wf['id']}": "version",
        f"/api/workflows/{wf['id']}/export/": "version",
        f"{versions}1/diff/": "against",
    }
    for url, name in urls.items():
        response = api.get(f"{url}{'&' if '?' in url else '?'}{name}={quote(raw)}")
        assert response.status_code == 400, (url, name, response.content[:300])
        assert error_of(response).startswith(f"{name} must be a whole number from "), (url, error_of(response))


def test_query_numbers_within_range_still_work(api) -> None:
    wf = create_workflow(api, python_spec())
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}}, format="json").json()
    engine().runs.wait(run["id"])
    events = api.get(f"/api/runs/{run['id']}/events/?since=1&limit=2").json()
    assert [e["seq"] for e in events] == [1, 2]
    assert len(api.get(f"/api/runs/{run['id']}/events/?limit=5000").json()) == run_events(api, run["id"])
    assert api.get(f"/api/runs/{run['id']}/events/?since={DB_INT_MAX}").json() == []
    assert [r["id"] for r in api.get(f"/api/runs/?workflow={wf['id']}&version=1").json()["results"]] == [run["id"]]
    assert api.get(f"/api/workflows/{wf['id']}/export/?version={DB_INT_MAX}").status_code == 404
    diff = api.get(f"/api/workflows/{wf['id']}/versions/1/diff/?against=0").json()
    assert (diff["from_version"], diff["to_version"]) == (0, 1)


def run_events(api, run_id: str) -> int:
    return api.get(f"/api/runs/{run_id}/").json()["last_seq"] + 1


# ------------------------------------------------------------------------- WebSocket
@pytest.fixture
async def _close_connections() -> Any:
    yield
    await orm(connections.close_all)()


async def socket_refusal(path: str, token: str, message: str | None = None) -> tuple[dict[str, Any], int]:
    """The error a run socket answers at `path` (or to `message` sent once connected) and its close code."""
    comm = WebsocketCommunicator(build_application(engine(), resume_stale=False), path,
                                 headers=[(b"authorization", f"Bearer {token}".encode())])
    connected, _ = await comm.connect()
    assert connected
    if message is not None:
        await comm.send_to(text_data=message)
    error: dict[str, Any] = {}
    while True:
        output = await comm.receive_output(timeout=10)
        if output["type"] == "websocket.close":
            await comm.disconnect()
            return error, output["code"]
        data = json.loads(output["text"])
        if data["type"] == "error":
            error = data


@pytest.mark.parametrize("raw", NOT_COUNTS.values(), ids=NOT_COUNTS.keys())
async def test_socket_since_out_of_range_is_refused(api, user, raw: str, _close_connections: Any) -> None:
    token = await orm(lambda: ApiToken.objects.issue(user, "ws").secret)()
    wf = await orm(create_workflow)(api, python_spec(op="tests.studio.fns:wait_forever"))
    run = await orm(lambda: api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}},
                                     format="json").json())()
    try:
        for path, message in ((f"/ws/runs/{run['id']}/?since={quote(raw)}", None),
                              (f"/ws/runs/{run['id']}/", json.dumps({"since": raw}))):
            error, code = await socket_refusal(path, token, message)
            assert (error.get("status"), code) == (400, 4400), (path, message, error)
            assert error["error"].startswith("since must be a whole number from 0 to "), error
        if raw.lstrip("-").isdigit() and len(raw) < 20:  # as a JSON number too
            error, code = await socket_refusal(f"/ws/runs/{run['id']}/", token, f'{{"since": {raw}}}')
            assert (error.get("status"), code) == (400, 4400), error
    finally:
        await orm(engine().runs.cancel)(run["id"])


# ---------------------------------------------------------------------------- URL ids
NOT_UUIDS = ["-" * 36, "a" * 32 + "----", "0" * 35, "g" * 32]


def test_ids_in_urls_that_are_no_uuid_are_404(api) -> None:
    api.raise_request_exception = False
    wf = create_workflow(api, python_spec())
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}}, format="json").json()
    engine().runs.wait(run["id"])
    for bad in NOT_UUIDS:
        for url in (f"/api/runs/{run['id']}/files/{bad}/", f"/api/runs/{bad}/", f"/api/workflows/{bad}/",
                    f"/api/deployments/{bad}/", f"/api/sessions/{bad}/"):
            response = api.get(url)
            assert response.status_code == 404, (url, response.content[:300])
            assert set(response.json()) == {"error", "details"}, url


# ------------------------------------------------------------------------------- NUL
def test_nul_characters_in_query_strings_are_400_naming_the_parameter(api) -> None:
    api.raise_request_exception = False
    wf = create_workflow(api, python_spec())
    for url, name in (("/api/workflows/?search=a%00b", "search"),
                      ("/api/workflows/import/?name=a%00b", "name"),
                      ("/api/runs/?created_after=2020%00", "created_after"),
                      (f"/api/workflows/{wf['id']}/?x%00y=1", "x\\x00y"),
                      ("/api/metrics/history/?range=5m%00", "range")):
        response = api.post(url, "{}", content_type="application/json") if "import" in url else api.get(url)
        assert response.status_code == 400, (url, response.content[:300])
        assert error_of(response) == f"query parameter '{name}' holds a NUL character", url
