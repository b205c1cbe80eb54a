"""The workers' metrics history: points read from heartbeats, the bounded stores (in memory, and in
the real Redis at REDIS_URL), the sampler and its lease (one writer per cluster),
`GET /api/metrics/history/` (range, scoping, bounds), the history `/ws/metrics/` sends first,
and `/metrics` with the Grafana dashboard shipped in deploy/ (every query names a served series)."""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connections
from prometheus_client.parser import text_string_to_metric_families

from engine.flow.discovery import RegistryError, WorkerInfo, WorkerLoad, WorkerSnapshot
from studio.accounts.models import ApiToken
from studio.asgi import build_application
from studio.workflows.apps import StudioEngine, engine
from studio.workflows.history import ActiveWorkers, MetricsSampler
from studio.workflows.history.points import GpuPoint, MetricPoint, TierPoint, point_of
from studio.workflows.history.query import MAX_POINTS
from studio.workflows.history.store import HistoryLimits, MemoryHistory, RedisHistory, Sample, WorkerMeta
from studio.workflows.models import Deployment, DeploymentStatus, WorkflowVersion
from tests.studio.conftest import client_for
from tests.studio.factories import create_workflow, example_spec
from tests.studio.limits import configured

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def heartbeat(worker_id: str = "w1", *, role: str = "llm", device: str = "cpu", **metrics: float) -> WorkerSnapshot:
    return WorkerSnapshot(WorkerInfo(worker_id, role, "tcp://127.0.0.1:1", device=device, model="tiny-llama"),
                          WorkerLoad(outstanding=2, queue_depth=1, metrics=dict(metrics)), last_heartbeat=0.0)


TIERED = {"kv.device.lookups": 10.0, "kv.device.hit_pages": 4.0, "kv.device.pages_used": 8.0,
          "kv.device.capacity_pages": 32.0, "kv.device.bytes_used": 800.0, "kv.device.capacity_bytes": 3200.0,
          "kv.host.lookups": 6.0, "kv.host.hit_pages": 3.0, "kv.host.pages_used": 16.0,
          "kv.host.capacity_pages": 64.0, "kv.disk.lookups": 3.0, "kv.disk.hit_pages": 0.0,
          "kv.disk.pages_used": 16.0, "kv.disk.capacity_pages": 128.0, "rss_bytes": 5e8,
          "llm.generated_tokens": 40.0, "llm.prompt_tokens": 12.0}


def sample(deployment: str, worker: str, t: float, *, role: str = "llm", hits: float = 1.0) -> Sample:
    meta = WorkerMeta(worker_id=worker, deployment=deployment, role=role, device="cpu", host="h")
    return Sample(meta, MetricPoint(t=t, rss_bytes=1e6, tiers={"device": TierPoint(lookups=10, hits=hits)}))


# ------------------------------------------------------------------------------- points
def test_a_point_has_the_tiers_the_worker_has_and_gpu_memory_only_with_cuda() -> None:
    point = point_of(heartbeat(**TIERED), 12.5)
    assert point.t == 12.5 and (point.outstanding, point.queue_depth) == (2, 1)
    assert set(point.tiers) == {"device", "host", "disk"}
    assert point.tiers["device"] == TierPoint(lookups=10, hits=4, pages_used=8, capacity_pages=32, bytes_used=800,
                                              capacity_bytes=3200)
    assert point.tiers["device"].hit_rate == 0.4 and point.tiers["host"].occupancy == 0.25
    assert point.tiers["disk"].hit_rate == 0.0 and point.rss_bytes == 5e8 and point.gpu is None
    assert point.generated_tokens == 40.0 and point.prompt_tokens == 12.0
    assert point_of(heartbeat(rss_bytes=1.0), 1.0).prompt_tokens is None  # no LLM
    device_only = point_of(heartbeat(**{"kv.device.capacity_pages": 4.0, "kv.device.lookups": 0.0}), 1.0)
    assert set(device_only.tiers) == {"device"} and device_only.tiers["device"].hit_rate is None
    assert point_of(heartbeat(), 1.0).tiers == {}  # no KV cache (a python role)
    gpu = point_of(heartbeat(device="cuda:1", gpu_memory_allocated_bytes=3e9, gpu_memory_reserved_bytes=4e9,
                             gpu_memory_total_bytes=8e10), 1.0)
    assert gpu.gpu == GpuPoint(device="cuda:1", allocated_bytes=3e9, reserved_bytes=4e9, total_bytes=8e10)
    assert point_of(heartbeat(device="cpu", gpu_memory_allocated_bytes=0.0), 1.0).gpu is None  # a CPU role


# ------------------------------------------------------------------------------- stores
LIMITS = HistoryLimits(window_s=20.0, interval_s=1.0)  # 21 points per worker


def check_store_bounds(store: Any) -> None:
    """The contract both stores keep: at most `cap` points per worker, the newest ones; only the
    points since the asked time; a worker absent for a whole window forgotten."""
    for t in range(100, 160):  # 60 ticks of d1/w1 and d1/w2; d2/w3 until 120
        samples = [sample("d1", "w1", t, hits=t), sample("d1", "w2", t, role="py")]
        if t <= 120:
            samples.append(sample("d2", "w3", t))
        store.append(float(t), samples)
    (w1, w2) = store.series({"d1"}, since=0.0)
    assert (w1.worker_id, w1.role, w2.worker_id, w2.role) == ("w1", "llm", "w2", "py")
    assert len(w1.points) == LIMITS.cap == 21
    assert [p.t for p in w1.points] == [float(t) for t in range(139, 160)]
    assert [p.tiers["device"].hits for p in w1.points][-1] == 159
    (recent,) = store.series({"d1"}, since=155.0, worker="w1")
    assert [p.t for p in recent.points] == [155.0, 156.0, 157.0, 158.0, 159.0]
    assert store.series({"d1", "d2"}, since=0.0, worker="nobody") == []
    assert store.deployments(since=150.0) == {"d1"}
    assert store.series({"d2"}, since=0.0) == []  # w3's last point (120) is older than the window


def test_memory_history_is_bounded_and_forgets_workers_gone_for_a_window() -> None:
    check_store_bounds(MemoryHistory(LIMITS))


@pytest.fixture
def redis_history() -> Iterator[RedisHistory]:
    prefix = f"test-history-{uuid.uuid4().hex[:8]}"
    store = RedisHistory(REDIS_URL, prefix, LIMITS)
    raw = redis.Redis.from_url(REDIS_URL)
    try:
        yield store
    finally:
        keys = list(raw.scan_iter(f"{prefix}:*"))
        if keys:
            raw.delete(*keys)
        raw.close()
        store.close()


@pytest.mark.redis
def test_redis_history_is_bounded_expires_with_the_worker_and_leases_one_sampler(
        redis_history: RedisHistory) -> None:
    check_store_bounds(redis_history)
    raw = redis.Redis.from_url(REDIS_URL)
    try:
        prefix = redis_history.prefix
        assert raw.llen(f"{prefix}:points:d1:w1") == LIMITS.cap  # trimmed at every append
        for key in (f"{prefix}:points:d1:w1", f"{prefix}:meta:d1:w1", f"{prefix}:workers:d1",
                    f"{prefix}:deployments"):
            assert 0 < raw.pttl(key) <= LIMITS.window_s * 1000, key  # gone a window after the last point
        assert raw.zrange(f"{prefix}:workers:d2", 0, -1) == []  # dropped from the index at once
        assert {k.decode() for k in raw.scan_iter(f"{prefix}:*")} <= {
            f"{prefix}:{k}" for k in ("points:d1:w1", "points:d1:w2", "meta:d1:w1", "meta:d1:w2", "workers:d1",
                                      "deployments", "points:d2:w3", "meta:d2:w3", "workers:d2")}
    finally:
        raw.close()

    # the lease: one holder at a time, renewed by it, free again once released
    assert redis_history.hold_sampler("a", ttl_s=5.0)
    assert not redis_history.hold_sampler("b", ttl_s=5.0)
    assert redis_history.hold_sampler("a", ttl_s=5.0)
    redis_history.release_sampler("b")  # not b's to give up
    assert not redis_history.hold_sampler("b", ttl_s=5.0)
    redis_history.release_sampler("a")
    assert redis_history.hold_sampler("b", ttl_s=5.0)


@pytest.mark.redis
def test_two_samplers_on_one_redis_write_one_point_per_worker_per_tick(redis_history: RedisHistory) -> None:
    clock = iter(float(t) for t in range(1000, 2000))
    live = {"d1": [heartbeat("w1", **TIERED), heartbeat("w2", role="py", rss_bytes=2e6)]}
    first = MetricsSampler(redis_history, lambda: live, interval_s=1.0, clock=lambda: next(clock))
    second = MetricsSampler(redis_history, lambda: live, interval_s=1.0, clock=lambda: next(clock))
    for _ in range(3):
        assert first.sample_once() == 2
        assert second.sample_once() == 0  # the first holds the lease
    (w1, w2) = redis_history.series({"d1"}, since=0.0)
    assert [p.t for p in w1.points] == [p.t for p in w2.points] and len(w1.points) == 3  # aligned, one per tick
    assert set(w1.points[-1].tiers) == {"device", "host", "disk"} and w2.points[-1].rss_bytes == 2e6
    redis_history.release_sampler(first.owner)  # as `stop()` does: the second takes over
    assert second.sample_once() == 2 and first.sample_once() == 0


def test_the_sampler_thread_samples_every_interval_and_outlives_a_failing_read() -> None:
    store = MemoryHistory(HistoryLimits(window_s=60.0, interval_s=0.02))
    calls: list[int] = []
    enough = threading.Event()

    def live() -> dict[str, list[WorkerSnapshot]]:
        calls.append(1)
        if len(calls) == 1:
            raise RegistryError("the registry is down")  # logged; the next tick tries again
        if len(calls) >= 6:
            enough.set()
        return {"d1": [heartbeat("w1", **TIERED)]}

    sampler = MetricsSampler(store, live, interval_s=0.02)
    sampler.start()
    sampler.start()  # idempotent: one thread
    try:
        assert enough.wait(30), calls
    finally:
        sampler.stop()
    assert not sampler.running and "omniflow-metrics" not in {t.name for t in threading.enumerate()}
    (series,) = store.series({"d1"}, since=0.0)
    times = [p.t for p in series.points]
    assert len(times) >= 4 and times == sorted(set(times))  # one point per tick, in order


def test_the_sampler_names_a_failure_that_has_no_message(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryHistory(HistoryLimits(window_s=60.0, interval_s=0.02))
    calls: list[int] = []
    recovered = threading.Event()

    def live() -> dict[str, list[WorkerSnapshot]]:
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError()  # what a timed-out future raises: no message of its own
        recovered.set()
        return {}

    sampler = MetricsSampler(store, live, interval_s=0.02)
    with caplog.at_level("WARNING", logger="studio.workflows.history.sampler"):
        sampler.start()
        try:
            assert recovered.wait(30), calls
        finally:
            sampler.stop()
    assert [r.getMessage() for r in caplog.records] == ["sampling worker metrics failed: TimeoutError"]


@pytest.mark.django_db
def test_reading_the_workers_gives_up_on_a_held_engine_loop_and_says_so(history_engine: StudioEngine, api: Any,
                                                                        user: Any) -> None:
    deployment_of(api, user, "held")
    held, release = threading.Event(), threading.Event()

    async def hold() -> None:
        held.set()
        release.wait(30)  # holds the loop, as a model loaded on it did

    holder = history_engine.runs.call(hold())
    try:
        assert held.wait(30)
        read = ActiveWorkers(history_engine.runs, history_engine.deployments, timeout_s=0.2)
        with pytest.raises(TimeoutError, match=r"^the engine loop did not list the workers within 0\.2 s$"):
            read()
    finally:
        release.set()
        holder.result(30)


# ---------------------------------------------------------------------------------- REST
@pytest.fixture
def history_engine() -> Iterator[StudioEngine]:
    """The studio's engine with a history of its own: in Redis under a prefix of its own when
    REDIS_URL is set (as distributed), else in memory (as embedded)."""
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    with configured(redis_prefix=prefix, metrics_history_s=3600.0, metrics_interval_s=1.0) as studio:
        try:
            yield studio
        finally:
            if isinstance(studio.history.store, RedisHistory):
                raw = redis.Redis.from_url(studio.config.redis_url)
                keys = list(raw.scan_iter(f"{prefix}:*"))
                if keys:
                    raw.delete(*keys)
                raw.close()
            studio.history.store.close()


def deployment_of(api: Any, owner: Any, name: str) -> str:
    wf = create_workflow(api, example_spec("chat"), name=name)
    version = WorkflowVersion.objects.get(workflow_id=wf["id"])
    return str(Deployment.objects.create(owner=owner, version=version, name=name, status=DeploymentStatus.RUNNING,
                                         replicas={"llm": 1}, namespace=f"test-{uuid.uuid4().hex[:8]}").pk)


@pytest.mark.django_db
def test_history_over_rest_by_range_scoped_to_the_owner_and_bounded(history_engine: StudioEngine, api: Any,
                                                                    other_api: Any, user: Any, other_user: Any,
                                                                    staff: Any) -> None:
    import time

    mine = deployment_of(api, user, "mine")
    theirs = deployment_of(other_api, other_user, "theirs")
    store = history_engine.history.store
    now = time.time()
    times = [now - (4000 - 1 - i) for i in range(4000)]  # past the hour's cap (3601 points)
    for t in times:
        store.append(t, [sample(mine, "mine-llm", t), sample(mine, "mine-py", t, role="py"),
                         sample(theirs, "their-llm", t)])

    body = api.get("/api/metrics/history/").json()  # 5m by default
    assert (body["range"], body["range_s"], body["interval_s"], body["step_s"]) == ("5m", 300.0, 1.0, 1.0)
    assert [(w["worker_id"], w["role"], w["deployment"]) for w in body["workers"]] == [
        ("mine-llm", "llm", mine), ("mine-py", "py", mine)]  # not the other user's worker
    points = body["workers"][0]["points"]
    assert [p["t"] for p in points] == [t for t in times if t >= body["since"]]  # the range, all of it
    assert points[-1]["tiers"] == {"device": {"lookups": 10.0, "hits": 1.0}} and points[-1]["rss_bytes"] == 1e6

    hour = api.get("/api/metrics/history/?range=1h").json()
    assert hour["range_s"] == 3600.0 and hour["step_s"] == 5.0
    assert all(MAX_POINTS - 2 <= len(w["points"]) <= MAX_POINTS + 1 for w in hour["workers"])  # the last of each 5 s
    assert [p["t"] for p in hour["workers"][0]["points"]] == [p["t"] for p in hour["workers"][1]["points"]]
    assert len(store.series({mine}, since=0.0, worker="mine-llm")[0].points) == store.limits.cap == 3601

    one = api.get(f"/api/metrics/history/?range=30s&deployment={mine}&worker=mine-py").json()
    assert [w["worker_id"] for w in one["workers"]] == ["mine-py"]
    assert [p["t"] for p in one["workers"][0]["points"]] == [t for t in times if t >= one["since"]]
    assert api.get(f"/api/metrics/history/?deployment={theirs}").status_code == 404
    assert api.get("/api/metrics/history/?worker=their-llm").json()["workers"] == []
    everyone = client_for(staff).get("/api/metrics/history/?range=1m").json()
    assert {w["worker_id"] for w in everyone["workers"]} == {"mine-llm", "mine-py", "their-llm"}

    for bad in ("2d", "5", "m", "-5m", "0m", "2h"):  # 2h: past the hour kept
        response = api.get(f"/api/metrics/history/?range={bad}")
        assert response.status_code == 400 and "range" in response.json()["error"], bad
    assert api.get("/api/metrics/history/?deployment=nope").status_code == 400
    client = client_for(user)
    client.credentials()
    assert client.get("/api/metrics/history/").status_code == 401


# ----------------------------------------------------------------------------- WebSocket
@pytest.fixture
async def _close_connections() -> Any:
    yield
    await database_sync_to_async(connections.close_all)()


@pytest.mark.django_db(transaction=True)
async def test_metrics_socket_sends_the_history_first_then_live_workers(history_engine: StudioEngine, api: Any,
                                                                        user: Any, _close_connections: Any) -> None:
    import time

    mine = await database_sync_to_async(deployment_of)(api, user, "mine")
    token = await database_sync_to_async(lambda: ApiToken.objects.issue(user, "ws").secret)()
    now = time.time()
    history_engine.history.store.append(now - 90, [sample(mine, "w", now - 90)])
    history_engine.history.store.append(now - 10, [sample(mine, "w", now - 10)])

    async def first_two(path: str) -> list[dict[str, Any]]:
        comm = WebsocketCommunicator(build_application(engine(), resume_stale=False), path,
                                     headers=[(b"authorization", f"Bearer {token}".encode())])
        connected, _ = await comm.connect()
        assert connected
        messages = [json.loads((await comm.receive_output(timeout=10))["text"]) for _ in range(2)]
        await comm.disconnect()
        return messages

    history, live = await first_two("/ws/metrics/?range=1m")
    assert (history["type"], history["range"], live["type"]) == ("history", "1m", "workers")
    assert [(w["worker_id"], len(w["points"])) for w in history["workers"]] == [("w", 1)]
    history, _ = await first_two("/ws/metrics/")  # 5m by default
    assert [p["t"] for p in history["workers"][0]["points"]] == [now - 90, now - 10]

    comm = WebsocketCommunicator(build_application(engine(), resume_stale=False), "/ws/metrics/?range=1y",
                                 headers=[(b"authorization", f"Bearer {token}".encode())])
    await comm.connect()
    error = json.loads((await comm.receive_output(timeout=10))["text"])
    assert (error["type"], error["status"]) == ("error", 400) and "range" in error["error"]
    assert (await comm.receive_output(timeout=10))["code"] == 4400
    # Ended here, else its channel layer read stays blocked in Redis until the loop closes (5 s in teardown).
    await comm.disconnect()


# ------------------------------------------------------------------ Prometheus and Grafana
def served_names(text: str) -> set[str]:
    """Every family and sample name a `/metrics` text declares."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
        names.update(f"{family.name}{suffix}" for suffix in ("_total", "_bucket", "_count", "_sum"))
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "omniflow-dashboard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(queries) >= 10
    return queries


@pytest.mark.django_db
def test_every_dashboard_query_names_a_series_metrics_serves(history_engine: StudioEngine, staff: Any) -> None:
    text = client_for(staff).get("/metrics").content.decode()
    served = served_names(text)
    for family in ("omniflow_kv_occupancy", "omniflow_kv_lookups", "omniflow_kv_hits", "omniflow_kv_pages",
                   "omniflow_kv_capacity_pages", "omniflow_worker_rss_bytes", "omniflow_gpu_memory_bytes"):
        assert f"# TYPE {family}" in text, family
    for query in dashboard_queries():
        names = set(re.findall(r"\bomniflow_[a-z0-9_]+", query))
        assert names, query
        assert names <= served, (query, names - served)


SCRAPE_TOKEN = "prometheus-scrape-token-0123456789"


@pytest.mark.django_db
def test_the_prometheus_config_parses_and_scrapes_metrics_with_its_token_file(client: Any, tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    assert (job["job_name"], job["scheme"], job["metrics_path"]) == ("omniflow", "http", "/metrics")
    auth = job["authorization"]
    assert auth["type"] == "Bearer" and set(auth) == {"type", "credentials_file"}
    # Its target is the studio's web service of docker-compose.yml, on the port it serves.
    [target] = [t for group in job["static_configs"] for t in group["targets"]]
    service, port = target.split(":")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert f"{port}:{port}" in compose["services"][service]["ports"]
    # A scrape as Prometheus makes it: the token file's text, trimmed of surrounding space (a
    # mounted secret often ends in a newline), as the bearer credentials of a GET of metrics_path.
    token_file = tmp_path / Path(auth["credentials_file"]).name
    token_file.write_text(SCRAPE_TOKEN + "\n")
    with configured(metrics_token=SCRAPE_TOKEN):
        scraped = client.get(job["metrics_path"], HTTP_AUTHORIZATION=f"{auth['type']} {token_file.read_text().strip()}")
        assert scraped.status_code == 200, scraped.content
        families = {f.name for f in text_string_to_metric_families(scraped.content.decode())}
        assert {"omniflow_runs_active", "omniflow_kv_occupancy"} <= families
        assert client.get(job["metrics_path"]).status_code == 401  # no file, no scrape
