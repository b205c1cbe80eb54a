"""The studio as it is deployed: daphne serving studio.asgi in a subprocess, driven over
real HTTP and a real WebSocket client (the `websockets` package)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosedError

from studio.accounts.models import ApiToken
from tests.liveserver import free_port, wait_ready
from tests.studio.factories import spec_doc

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.django_db(transaction=True)

METRICS_TOKEN = "prometheus-test-token-0123456789"
"""The servers' OMNIFLOW_METRICS_TOKEN (what Prometheus sends as a bearer token)."""


def scrape(base: str, token: str | None = METRICS_TOKEN) -> str:
    request = urllib.request.Request(base + "/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode()


SERVER_DEADLOCK_TIMEOUT = "options=-c%20deadlock_timeout%3D200ms"
"""The servers a test starts check for a lock cycle after 200 ms, before the test process (1 s):
when a test's flush (TRUNCATE of every table) meets a server's transaction (a node agent's
supervision tick) in a cycle, PostgreSQL ends the server's, which retries on its next tick, rather
than the flush, which would leave the test's rows to the next test."""


def database_url() -> str:
    """The test database, for the server process to share."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}?{SERVER_DEADLOCK_TIMEOUT}"


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], base: str) -> None:
        self.proc = proc
        self.base = base

    def request(self, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")




@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "studio.settings",
        "DATABASE_URL": database_url(),
        "OMNIFLOW_DATA_DIR": str(settings.OMNIFLOW.data_dir),
        "OMNIFLOW_ALLOW_MODULE_OPS": "1",
        "OMNIFLOW_METRICS_TOKEN": METRICS_TOKEN,
        "PYTHONPATH": str(ROOT),
    }
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "studio.asgi:application"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/healthz")
        yield Server(proc, f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


async def read_events(url: str, token: str | None) -> tuple[list[dict[str, Any]], int | None]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    events = []
    async with ws_connect(url, additional_headers=headers, open_timeout=10) as ws:
        try:
            async for message in ws:
                events.append(json.loads(message))
        except ConnectionClosedError:  # an application close code (4xxx) is not "OK"
            pass
        return events, ws.close_code


def test_rest_and_websocket_against_a_live_daphne(server: Server, user: Any) -> None:
    token = ApiToken.objects.issue(user, "live").secret
    assert server.request("GET", "/api/workflows/")[0] == 401

    status, wf = server.request("POST", "/api/workflows/", {"spec": spec_doc(op="tests.studio.fns:slow")}, token)
    assert status == 201, wf
    status, run = server.request("POST", "/api/runs/", {"workflow": wf["id"], "inputs": {"text": "live"}}, token)
    assert status == 201, run

    ws = server.base.replace("http://", "ws://") + f"/ws/runs/{run['id']}/"
    events, code = asyncio.run(read_events(ws, token))
    assert code == 1000
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "run_started" and events[-1]["type"] == "run_finished"
    assert events[-1]["status"] == "done" and events[-1]["outputs"] == {"result": "LIVE"}

    tail, _ = asyncio.run(read_events(ws + "?since=5", token))
    assert tail == events[5:]

    status, detail = server.request("GET", f"/api/runs/{run['id']}/", token=token)
    assert status == 200 and detail["status"] == "done" and detail["last_seq"] == events[-1]["seq"]

    refused, code = asyncio.run(read_events(ws, None))
    assert refused == [{"type": "error", "status": 401, "error": refused[0]["error"]}] and code == 4401

    assert 'omniflow_runs_finished_total{status="done"} 1.0' in scrape(server.base)
    with pytest.raises(urllib.error.HTTPError) as refused_scrape:
        scrape(server.base, None)
    assert refused_scrape.value.code == 401 and refused_scrape.value.headers["WWW-Authenticate"].startswith("Bearer")
