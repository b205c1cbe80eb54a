"""`/ws/runs/<id>/` through Channels' communicator: replay, live follow, resume, refusals,
and gap repair when a live message is lost."""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.db import connections

from engine.client.runs import NodeProgressEvent, RunFinished, RunStatus
from studio.accounts.models import ApiToken
from studio.asgi import build_application
from studio.dbcalls import orm
from studio.workflows.apps import engine
from studio.workflows.models import RunEvent
from studio.workflows.runs import store
from tests.studio import fns
from tests.studio.factories import create_workflow, spec_doc

pytestmark = [pytest.mark.django_db(transaction=True)]


def connect(path: str, token: str | None, origin: str | None = None) -> WebsocketCommunicator:
    headers = []
    if token:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    if origin:
        headers.append((b"origin", origin.encode()))
    return WebsocketCommunicator(build_application(engine(), resume_stale=False), path, headers=headers)


async def read_until_closed(comm: WebsocketCommunicator) -> tuple[list[dict[str, Any]], int]:
    events = []
    while True:
        message = await comm.receive_output(timeout=10)
        if message["type"] == "websocket.close":
            return events, message.get("code", 1000)
        events.append(json.loads(message["text"]))


@pytest.fixture(autouse=True)
async def _close_connections() -> Any:
    """The test's own ORM calls run on asgiref's shared thread; close its connection so the
    test database can be flushed and dropped."""
    yield
    await orm(connections.close_all)()


@pytest.fixture
def token(user) -> str:
    return ApiToken.objects.issue(user, "ws").secret


@pytest.fixture
def finished_run(api) -> str:
    wf = create_workflow(api, spec_doc())
    run = api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}}, format="json").json()
    engine().runs.wait(run["id"])
    return run["id"]


@pytest.fixture
def gated_run(api) -> str:
    fns.GATE.clear()
    wf = create_workflow(api, spec_doc(op="tests.studio.fns:gated"))
    return api.post("/api/runs/", {"workflow": wf["id"], "inputs": {"text": "x"}}, format="json").json()["id"]


def stored(run_id: str) -> list[dict[str, Any]]:
    return [e.data for e in RunEvent.objects.filter(run_id=run_id).order_by("seq")]


async def test_replays_a_finished_run_then_closes(finished_run: str, token: str) -> None:
    comm = connect(f"/ws/runs/{finished_run}/", token)
    connected, _ = await comm.connect()
    assert connected
    events, code = await read_until_closed(comm)
    assert code == 1000
    assert events == await orm(stored)(finished_run)
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "run_finished" and events[-1]["status"] == "done"


async def test_resumes_from_since(finished_run: str, token: str) -> None:
    comm = connect(f"/ws/runs/{finished_run}/?since=4", token)
    await comm.connect()
    events, _ = await read_until_closed(comm)
    everything = await orm(stored)(finished_run)
    assert events == everything[4:]


async def test_follows_live_events_without_gaps_or_duplicates(gated_run: str, token: str) -> None:
    comm = connect(f"/ws/runs/{gated_run}/", token)
    await comm.connect()
    seen = []
    while not (seen and seen[-1]["type"] == "node_state" and seen[-1]["node"] == "step"
               and seen[-1]["state"] == "running"):
        seen.append(await comm.receive_json_from(timeout=10))
    fns.GATE.set()  # the rest is emitted while we are connected
    rest, code = await read_until_closed(comm)
    events = seen + rest
    assert code == 1000
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert events == await orm(stored)(gated_run)
    assert events[-1]["outputs"] == {"result": "X"}


async def test_since_message_restarts_the_stream(gated_run: str, token: str) -> None:
    comm = connect(f"/ws/runs/{gated_run}/", token)
    await comm.connect()
    seen = [await comm.receive_json_from(timeout=10)]
    while not (seen[-1]["type"] == "node_state" and seen[-1]["state"] == "running"):
        seen.append(await comm.receive_json_from(timeout=10))
    # The run is held at the gate: a restart from 1 replays exactly 1..k, then follows live.
    await comm.send_json_to({"since": 1})
    replayed = [await comm.receive_json_from(timeout=10) for _ in range(len(seen) - 1)]
    assert replayed == seen[1:]
    fns.GATE.set()
    rest, _ = await read_until_closed(comm)
    assert [e["seq"] for e in rest] == list(range(len(seen), len(seen) + len(rest)))
    assert rest[-1]["type"] == "run_finished"


@pytest.mark.parametrize(("path", "use_token", "status"), [
    ("/ws/runs/{run}/", False, 401),
    ("/ws/runs/{run}/?since=-1", True, 400),
    ("/ws/runs/{run}/?since=abc", True, 400),
    ("/ws/runs/00000000-0000-0000-0000-000000000000/", True, 404),
    ("/ws/runs/not-a-uuid/", True, 404),
])
async def test_refusals(finished_run: str, token: str, path: str, use_token: bool, status: int) -> None:
    comm = connect(path.format(run=finished_run), token if use_token else None)
    await comm.connect()
    error = await comm.receive_json_from(timeout=5)
    assert error["type"] == "error" and error["status"] == status
    assert (await comm.receive_output(timeout=5)) == {"type": "websocket.close", "code": 4000 + status}
    await comm.disconnect()


async def test_another_users_run_is_not_found(finished_run: str, other_user) -> None:
    other_token = await orm(lambda: ApiToken.objects.issue(other_user).secret)()
    comm = connect(f"/ws/runs/{finished_run}/", other_token)
    await comm.connect()
    assert (await comm.receive_json_from(timeout=5))["status"] == 404
    await comm.disconnect()


async def test_session_cookie_needs_same_origin(finished_run: str, user, client) -> None:
    await orm(client.force_login)(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    for origin, status in (("http://evil.example", 401), ("http://localhost", None)):
        comm = WebsocketCommunicator(build_application(engine(), resume_stale=False),
                                     f"/ws/runs/{finished_run}/", headers=[(b"cookie", cookie),
                                                                           (b"origin", origin.encode())])
        await comm.connect()
        first = await comm.receive_json_from(timeout=5)
        if status is None:
            assert first["type"] == "run_started"
        else:
            assert first == {"type": "error", "status": 401, "error": first["error"]}
        await comm.disconnect()


async def test_lost_live_message_is_read_back_from_the_store(api, token: str) -> None:
    """Store six events, publish only the last batch: the consumer fills 0..5 from the
    database, once each."""
    wf = await orm(create_workflow)(api, spec_doc(op="tests.studio.fns:wait_forever"))
    from studio.workflows.models import Run, Workflow

    def make_run() -> str:
        workflow = Workflow.objects.get(pk=wf["id"])
        run = Run.objects.create(owner=workflow.owner, workflow=workflow, version=workflow.latest_version())
        return str(run.pk)

    run_id = await orm(make_run)()
    comm = connect(f"/ws/runs/{run_id}/", token)
    await comm.connect()
    bus = engine().runs.bus
    events: list[store.StoredEvent] = [
        NodeProgressEvent(seq=i, run_id=run_id, time=1.0 + i, node="step", message=str(i)) for i in range(5)]
    events.append(RunFinished(seq=5, run_id=run_id, time=9.0, status=RunStatus.DONE))
    first = await orm(store.record)(run_id, events[:2])
    await bus.publish(run_id, first)
    assert [(await comm.receive_json_from(timeout=5))["seq"] for _ in range(2)] == [0, 1]
    await orm(store.record)(run_id, events[2:4])  # published nowhere: lost
    last = await orm(store.record)(run_id, events[4:])
    await bus.publish(run_id, last)
    rest, code = await read_until_closed(comm)
    assert [e["seq"] for e in rest] == [2, 3, 4, 5] and code == 1000


async def test_handshakes_hand_their_database_connections_back_to_the_pool(finished_run: str, token: str) -> None:
    """Each handshake authenticates its token on a thread in a copy of its task's context: the
    connection it opened must go back to the pool, or a pool of 16 runs dry after 16 sockets."""
    pool = connections["default"].pool if connections["default"].vendor == "postgresql" else None
    if pool is None:
        pytest.skip("no connection pool: the studio's tests run on SQLite here")

    def in_use() -> int:
        stats = pool.get_stats()
        return stats["pool_size"] - stats["pool_available"]

    before = in_use()
    for _ in range(pool.max_size + 4):
        comm = connect(f"/ws/runs/{finished_run}/", token)
        await comm.connect()
        assert (await comm.receive_json_from(timeout=10))["type"] == "run_started"
        await comm.disconnect()
    assert in_use() <= before
