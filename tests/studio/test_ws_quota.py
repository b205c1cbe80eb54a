"""Open WebSockets per user: past `OMNIFLOW_QUOTA_WEBSOCKETS` a socket gets one error message and
close code 4429, on `/ws/runs/<id>/` and `/ws/metrics/` alike; closing one frees its place; other
users and staff are not counted against it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.db import connections

from studio.accounts.models import ApiToken
from studio.asgi import build_application
from studio.dbcalls import orm
from studio.workflows.apps import engine
from tests.studio.factories import create_workflow
from tests.studio.limits import configured, python_spec

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


@pytest.fixture
async def _close_connections() -> Any:
    yield
    await orm(connections.close_all)()


async def _token(user: Any) -> str:
    return await orm(lambda: ApiToken.objects.issue(user, "ws").secret)()


async def _open(path: str, token: str) -> tuple[WebsocketCommunicator, dict[str, Any]]:
    """A connected socket and its first message."""
    comm = WebsocketCommunicator(build_application(engine(), resume_stale=False), path,
                                 headers=[(b"authorization", f"Bearer {token}".encode())])
    connected, _ = await comm.connect()
    assert connected
    return comm, json.loads(await comm.receive_from(timeout=10))


async def test_a_users_sockets_past_the_quota_are_refused_and_a_closed_one_frees_its_place(
        api, user, other_user, staff, _close_connections: Any) -> None:
    mine, theirs, staffs = await _token(user), await _token(other_user), await _token(staff)
    wf = await orm(create_workflow)(api, python_spec(op="tests.studio.fns:wait_forever"))
    run = await orm(lambda: api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}},
                                     format="json").json())()
    with configured(quotas={"websockets": 2}):
        first, _ = await _open(f"/ws/runs/{run['id']}/", mine)
        second, _ = await _open("/ws/metrics/", mine)
        for path in (f"/ws/runs/{run['id']}/", "/ws/metrics/"):
            refused, message = await _open(path, mine)
            assert message == {"type": "error", "status": 429, "error": "you have 2 WebSockets open on this server;"
                               " your quota is 2 (OMNIFLOW_QUOTA_WEBSOCKETS): close one first"}, path
            assert (await refused.receive_output(timeout=10)) == {"type": "websocket.close", "code": 4429}
            await refused.disconnect()
        others = [(await _open("/ws/metrics/", token))[0] for token in (theirs, staffs, staffs, staffs)]
        assert engine().sockets.held(user) == 2
        await first.disconnect()
        assert engine().sockets.held(user) == 1
        again, message = await _open("/ws/metrics/", mine)
        assert message["type"] == "history"
        for comm in (second, again, *others):
            await comm.disconnect()
        assert engine().sockets.held(user) == engine().sockets.held(other_user) == 0
    await orm(engine().runs.cancel)(run["id"])
