"""`omniflow bench studio [--json]`: the studio as a client sees it, against a live server.

The bench starts its own studio (`daphne studio.asgi:application` in a subprocess, a
fresh temporary OMNIFLOW_DATA_DIR: SQLite and in-process runs unless `--database-url` /
`--redis-url` are given), makes a user and a token with `manage.py`, and saves a workflow
of three python nodes (`x -> a -> b -> c -> y`, each the registered op `loop.grow`). It talks
to the server only over HTTP (stdlib `http.client`) and WebSockets (`websockets`); nothing here
imports Django.

The studio runs as deployed for a team: registered ops only (no `OMNIFLOW_ALLOW_MODULE_OPS`),
a user who is not staff, so every quota applies (the concurrent and queued runs quotas sized
to the load), and every run carrying its owner's tenant. The bench shows it: `user_is_staff`
(false), `quota_probe_status` (a run asking for a timeout over the user's quota: 403 before
anything runs), and `run_tenants` (the tenants the studio submitted the runs with, read from
its database at the end: the bench user's only).

* Latency: `--runs` (50) runs submitted one after another over REST, each followed on its
  WebSocket (`/ws/runs/<id>/`) to the end. `submit_to_first_event_p50_ms` (and p99): from
  sending `POST /api/runs/` to the first event received on the run's socket (the submit's
  answer, the WebSocket handshake and the first stored event included), and its parts'
  medians: `submit_p50_ms` (the POST's answer), `handshake_p50_ms` (the socket open) and
  `first_event_after_open_p50_ms`. Goal <= 50 ms.
  The anchor, measured in the same server in alternating blocks: `healthz_p50_ms`, a bare
  HTTP round trip (`GET /healthz`, which reads the database); `latency_ratio_vs_healthz` is
  the ratio of the two medians.
* Load: `--concurrent` (200) runs submitted at once (`--submitters` threads POST them)
  while every run's WebSocket stream is read to its end. `runs`, `runs_completed` (ended
  `done` with the right output), `events_lost` (over all runs: sequence numbers missing or
  received twice, and streams that ended before `run_finished`), `load_wall_s` and
  `load_runs_per_s`. Goal: every run completes and `events_lost` = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http.client
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

ROOT = Path(__file__).resolve().parents[2]
GOAL_FIRST_EVENT_MS = 50.0
NODES = ("a", "b", "c")
START = {"value": 1, "steps": 0, "target": 0}
"""The run's input: each `loop.grow` doubles `value` and counts a step."""


def workflow_spec() -> dict[str, Any]:
    """x -> a -> b -> c -> y, each a python node running the registered op `loop.grow`, on one role."""
    nodes: list[dict[str, Any]] = [{"id": "x", "kind": "input", "outputs": {"value": {"type": "json"}},
                                    "params": {"default": START}}]
    edges = []
    previous = ("x", "value")
    for name in NODES:
        nodes.append({"id": name, "kind": "python", "role": "py", "op": "loop.grow",
                      "inputs": {"state": {"type": "json"}}, "outputs": {"out": {"type": "json"}}})
        edges.append({"source": previous[0], "source_port": previous[1], "target": name, "target_port": "state"})
        previous = (name, "out")
    nodes.append({"id": "y", "kind": "output", "inputs": {"value": {"type": "json"}}})
    edges.append({"source": previous[0], "source_port": previous[1], "target": "y", "target_port": "value"})
    # A name of its own per bench: a shared database may hold an earlier bench's workflow.
    return {"version": 1, "name": f"bench_studio_{secrets.token_hex(4)}", "roles": [{"name": "py", "kind": "python"}], "nodes": nodes,
            "edges": edges}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=50, help="sequential runs for the latency")
    parser.add_argument("--warmup", type=int, default=10, help="untimed sequential runs first")
    parser.add_argument("--blocks", type=int, default=5, help="alternating blocks of runs and /healthz calls")
    parser.add_argument("--concurrent", type=int, default=200, help="runs submitted at once for the load")
    parser.add_argument("--submitters", type=int, default=16, help="threads POSTing the load's runs")
    parser.add_argument("--database-url", default=None, help="default: SQLite in a temporary data directory")
    parser.add_argument("--redis-url", default=None, help="default: none (in-process channel layer)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the load phase")


# ------------------------------------------------------------------------------ server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Studio:
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    token: str
    log: Path
    env: dict[str, str]

    @property
    def ws_base(self) -> str:
        return f"ws://{self.host}:{self.port}"


def _env(data_dir: Path, args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "OMNIFLOW_DISPATCH")}
    env.pop("OMNIFLOW_ALLOW_MODULE_OPS", None)
    env.update({"DJANGO_SETTINGS_MODULE": "studio.settings", "OMNIFLOW_DATA_DIR": str(data_dir),
                "OMNIFLOW_LOG_LEVEL": "WARNING",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")])),
                "HF_HUB_OFFLINE": "1"})
    # Quotas stay on, sized to the load: one user submits `--concurrent` runs at once, and follows
    # each on its own WebSocket.
    for name in ("OMNIFLOW_QUOTA_CONCURRENT_RUNS", "OMNIFLOW_QUOTA_QUEUED_RUNS", "OMNIFLOW_QUOTA_WEBSOCKETS"):
        env.setdefault(name, str(max(args.concurrent, 1)))
    env.setdefault("OMNIFLOW_THROTTLE_RUN", f"{max(args.concurrent + args.runs, 1) * 2}/minute")
    if args.database_url:
        env["DATABASE_URL"] = args.database_url
    if args.redis_url:
        env["REDIS_URL"] = args.redis_url
    return env


def _manage(env: dict[str, str], *argv: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "manage.py"), *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _start_studio(data_dir: Path, args: argparse.Namespace) -> _Studio:
    env = _env(data_dir, args)
    _manage(env, "migrate", "--noinput")
    _manage(env, "setup_demo", "--username", "bench", "--password", secrets.token_urlsafe(16), "--no-examples")
    token = _manage(env, "create_token", "bench", "--name", "bench").strip().splitlines()[-1]
    port = _free_port()
    log = data_dir / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                                 "studio.asgi:application"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    studio = _Studio(proc, "127.0.0.1", port, token, log, env)
    deadline = time.monotonic() + 60
    while True:  # readiness: /healthz answers
        try:
            if _Http(studio).request("GET", "/healthz")[0] == 200:
                return studio
        except OSError:
            pass
        if time.monotonic() > deadline:
            _stop(studio)
            raise RuntimeError(f"the studio did not answer /healthz:\n{log.read_text()[-3000:]}")
        try:
            proc.wait(timeout=0.1)  # the pause between polls, and a check that it still runs
        except subprocess.TimeoutExpired:
            continue
        raise RuntimeError(f"the studio exited with status {proc.returncode}:\n{log.read_text()[-3000:]}")


def _stop(studio: _Studio) -> None:
    studio.proc.terminate()
    try:
        studio.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        studio.proc.kill()
        studio.proc.wait(timeout=10)


class _Http:
    """One keep-alive HTTP connection to the studio (one thread at a time)."""

    def __init__(self, studio: _Studio) -> None:
        self.studio = studio
        self.conn = http.client.HTTPConnection(studio.host, studio.port, timeout=60)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {self.studio.token}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            self.conn.request(method, path, body=data, headers=headers)
            response = self.conn.getresponse()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            self.conn.close()  # the server closed an idle keep-alive connection: once more
            self.conn.request(method, path, body=data, headers=headers)
            response = self.conn.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw else None

    def close(self) -> None:
        self.conn.close()


# ----------------------------------------------------------------------------- streams
@dataclass
class _Followed:
    seqs: list[int] = field(default_factory=list)
    opened_at: float | None = None
    first_event_at: float | None = None
    finished: dict[str, Any] | None = None


async def _follow(studio: _Studio, run_id: str) -> _Followed:
    out = _Followed()
    headers = {"Authorization": f"Bearer {studio.token}"}
    async with ws_connect(f"{studio.ws_base}/ws/runs/{run_id}/", additional_headers=headers, open_timeout=60,
                          max_queue=None) as ws:
        out.opened_at = time.perf_counter()
        try:
            async for message in ws:
                if out.first_event_at is None:
                    out.first_event_at = time.perf_counter()
                event = json.loads(message)
                out.seqs.append(event["seq"])
                if event["type"] == "run_finished":
                    out.finished = event
        except ConnectionClosed:
            pass
    return out


def _lost(followed: _Followed) -> int:
    """Sequence numbers missing or repeated, plus one for a stream that never finished."""
    seen = followed.seqs
    last = max(seen, default=-1)
    missing = len(set(range(last + 1)) - set(seen))
    duplicates = len(seen) - len(set(seen))
    return missing + duplicates + (0 if followed.finished is not None else 1)


def _completed(followed: _Followed) -> bool:
    f = followed.finished
    y = f.get("outputs", {}).get("y") if f is not None else None
    return (f is not None and f.get("status") == "done" and isinstance(y, dict)
            and y.get("steps") == len(NODES) and y.get("value") == START["value"] << len(NODES))


# ---------------------------------------------------------------------------- phases
def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class _Phases:
    """One sequential run's submit-to-first-event time (ms) and its parts: the POST's answer, the
    WebSocket handshake, and the first event after the socket opened."""

    total: list[float] = field(default_factory=list)
    submit: list[float] = field(default_factory=list)
    handshake: list[float] = field(default_factory=list)
    first_event: list[float] = field(default_factory=list)
    lost: int = 0


async def _sequential(studio: _Studio, http_: _Http, workflow_id: str, n: int, phases: _Phases) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(n):
        t0 = time.perf_counter()
        status, run = await loop.run_in_executor(None, http_.request, "POST", "/api/runs/",
                                                 {"workflow": workflow_id, "inputs": {"x": START}})
        submitted = time.perf_counter()
        if status != 201:
            raise RuntimeError(f"submitting a run failed ({status}): {run}")
        followed = await _follow(studio, run["id"])
        if followed.first_event_at is None or followed.opened_at is None or not _completed(followed):
            raise RuntimeError(f"run {run['id']} did not complete: {followed}")
        phases.total.append((followed.first_event_at - t0) * 1e3)
        phases.submit.append((submitted - t0) * 1e3)
        phases.handshake.append((followed.opened_at - submitted) * 1e3)
        phases.first_event.append((followed.first_event_at - followed.opened_at) * 1e3)
        phases.lost += _lost(followed)


def _healthz(http_: _Http, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        if http_.request("GET", "/healthz")[0] != 200:
            raise RuntimeError("/healthz failed")
        times.append((time.perf_counter() - t0) * 1e3)
    return times


async def _load(
    studio: _Studio, workflow_id: str, n: int, submitters: int
) -> tuple[list[_Followed | None], float, list[str]]:
    """`n` runs submitted at once, each stream followed; also the distinct errors of the
    runs whose submission or stream failed."""
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=submitters, thread_name_prefix="bench-submit")
    local: dict[int, _Http] = {}

    def submit(_: int) -> str:
        import threading

        conn = local.setdefault(threading.get_ident(), _Http(studio))
        status, run = conn.request("POST", "/api/runs/", {"workflow": workflow_id, "inputs": {"x": START}})
        if status != 201:
            raise RuntimeError(f"submitting a run failed ({status}): {run}")
        return run["id"]

    async def one(i: int) -> _Followed | None:
        run_id = await loop.run_in_executor(pool, submit, i)
        return await _follow(studio, run_id)

    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    finally:
        pool.shutdown(wait=True)
        for conn in local.values():
            conn.close()
    wall = time.perf_counter() - t0
    errors = sorted({f"{type(r).__name__}: {r}"[:300] for r in results if isinstance(r, BaseException)})
    return [r if isinstance(r, _Followed) else None for r in results], wall, errors


_AS_DEPLOYED = """
import json
from django.contrib.auth import get_user_model
from studio.workflows.models import Run
user = get_user_model().objects.get(username="bench")
print(json.dumps({"user_is_staff": user.is_staff,
                  "run_tenants": sorted({run.tenant for run in Run.objects.select_related("deployment")}),
                  "bench_tenant": f"user:{user.pk}"}))
"""


def _as_deployed(studio: _Studio) -> dict[str, Any]:
    """Whether the bench ran as a team's user: not staff (quotas apply), and which tenants the
    studio gave its runs (read from its database)."""
    return json.loads(_manage(studio.env, "shell", "-c", _AS_DEPLOYED).strip().splitlines()[-1])


def _quota_probe(http_: _Http, workflow_id: str) -> int:
    """A run asking for a timeout over the user's run timeout quota: the status of its refusal."""
    status, body = http_.request("POST", "/api/runs/", {"workflow": workflow_id, "inputs": {"x": START},
                                                        "timeout_s": 86400.0})
    if status == 403 and "run_timeout_s" not in json.dumps(body):
        raise RuntimeError(f"the quota probe was refused for another reason: {body}")
    return status


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="omniflow-bench-studio-") as tmp:
        studio = _start_studio(Path(tmp), args)
        try:
            result = asyncio.run(_measure(studio, args))
        finally:
            _stop(studio)
        deployed = _as_deployed(studio)
    tenants_ok = deployed["run_tenants"] == [deployed["bench_tenant"]]
    as_deployed = not deployed["user_is_staff"] and result["quota_probe_status"] == 403 and tenants_ok
    return {**result, "user_is_staff": deployed["user_is_staff"], "run_tenants": deployed["run_tenants"],
            "as_deployed": as_deployed, "goal_met": result["goal_met"] and as_deployed}


async def _measure(studio: _Studio, args: argparse.Namespace) -> dict[str, Any]:
    http_ = _Http(studio)
    loop = asyncio.get_running_loop()
    status, wf = await loop.run_in_executor(None, http_.request, "POST", "/api/workflows/", {"spec": workflow_spec()})
    if status != 201:
        raise RuntimeError(f"saving the bench workflow failed ({status}): {wf}")
    await _sequential(studio, http_, wf["id"], args.warmup, _Phases())
    quota_probe = await loop.run_in_executor(None, _quota_probe, http_, wf["id"])
    phases = _Phases()
    healthz: list[float] = []
    blocks = max(1, args.blocks)
    for b in range(blocks):
        share = args.runs // blocks + (1 if b < args.runs % blocks else 0)
        await _sequential(studio, http_, wf["id"], share, phases)
        healthz += await loop.run_in_executor(None, _healthz, http_, max(share, 1))
    latencies = phases.total
    http_.close()
    async with asyncio.timeout(args.timeout):
        followed, wall, errors = await _load(studio, wf["id"], args.concurrent, args.submitters)
    completed = sum(1 for f in followed if f is not None and _completed(f))
    events_lost = sum(_lost(f) for f in followed if f is not None)
    p50 = statistics.median(latencies)
    healthz_p50 = statistics.median(healthz)
    return {
        "submit_to_first_event_p50_ms": p50,
        "submit_to_first_event_p99_ms": _pct(latencies, 0.99),
        "healthz_p50_ms": healthz_p50,
        "latency_ratio_vs_healthz": p50 / healthz_p50,
        "submit_p50_ms": statistics.median(phases.submit),
        "handshake_p50_ms": statistics.median(phases.handshake),
        "first_event_after_open_p50_ms": statistics.median(phases.first_event),
        "sequential_events_lost": phases.lost,
        "runs": args.concurrent,
        "runs_completed": completed,
        "events_lost": events_lost,
        "streams_failed": sum(1 for f in followed if f is None),
        "stream_errors": errors[:5],
        "load_wall_s": wall,
        "load_runs_per_s": completed / wall,
        "goal_first_event_ms": GOAL_FIRST_EVENT_MS,
        "goal_met": p50 <= GOAL_FIRST_EVENT_MS and completed == args.concurrent and events_lost == 0,
        "quota_probe_status": quota_probe,
        "database": urllib.parse.urlsplit(args.database_url).scheme if args.database_url else "sqlite",
    }
