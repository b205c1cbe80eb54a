"""`/healthz` (is this process able to serve?) and `/metrics` (Prometheus text format).

`/metrics` holds this process's run metrics (`RunMetrics`: runs submitted/finished/active,
run and node latency histograms by node kind), run and deployment counts from the
database, and at scrape time the live workers' gauges from the registry, labelled
`deployment, role, worker` (and `tier` for the KV cache): KV hit rate and bytes per tier,
GPU memory, queue depth, outstanding calls, tokens generated, connections refused on the
worker plane (`omniflow_worker_plane_refused`: no CURVE key, or another uid).

`/metrics` answers only Prometheus with the operator's token (`OMNIFLOW_METRICS_TOKEN`, sent
as `Authorization: Bearer <token>`, compared in constant time) or staff (a browser session or
an API token of a staff user): without credentials 401 (`WWW-Authenticate: Bearer`), another
user 403. Run counts, deployments and workers' load are the whole studio's, not one user's.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from django.db import DatabaseError, connection
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.flow.discovery import RegistryError
from engine.worker.process import REFUSED_METRIC
from studio.accounts.auth import bearer_token, user_for_token
from studio.errors import error_body
from studio.workflows.apps import engine
from studio.workflows.deployments.workers import TIERS, active_deployments, snapshots_sync
from studio.workflows.models import Deployment, DeploymentStatus, Run, RunStatus

log = logging.getLogger(__name__)


@require_GET
def healthz(request: HttpRequest) -> HttpResponse:
    checks: dict[str, str] = {}
    healthy = True
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except DatabaseError as exc:
        log.warning("health check: database: %s", exc)
        checks["database"] = f"error: {exc}"
        healthy = False
    eng = engine()
    checks["mode"] = "distributed" if eng.config.distributed else "embedded"
    checks["dispatch"] = str(eng.config.dispatch)
    checks["engine_loop"] = "running" if eng.runs.running else "idle"
    return JsonResponse({"status": "ok" if healthy else "unavailable", "checks": checks},
                        status=200 if healthy else 503)


class _RunsByStatus:
    """Run counts by status, read from the database at scrape time (all processes' runs)."""

    def collect(self):
        family = GaugeMetricFamily("omniflow_runs", "Runs stored, by status", labels=["status"])
        counts = dict.fromkeys(RunStatus.values, 0)
        for row in Run.objects.values("status").annotate(n=Count("id")):
            counts[row["status"]] = row["n"]
        for status, n in counts.items():
            family.add_metric([status], n)
        yield family


class _Deployments:
    """Deployments by status (database) and their live workers' gauges (registry)."""

    def collect(self):
        family = GaugeMetricFamily("omniflow_deployments", "Deployments stored, by status", labels=["status"])
        counts = dict.fromkeys(DeploymentStatus.values, 0)
        for row in Deployment.objects.values("status").annotate(n=Count("id")):
            counts[row["status"]] = row["n"]
        for status, n in counts.items():
            family.add_metric([status], n)
        yield family
        try:
            live = snapshots_sync(engine(), active_deployments(Deployment.objects.all()))
        except (TimeoutError, RegistryError) as exc:
            log.warning("metrics: reading the workers failed: %s", exc)
            live = {}
        labels = ["deployment", "role", "worker"]
        up = GaugeMetricFamily("omniflow_worker_up", "A live role worker (registered, heartbeating)", labels=labels)
        queue = GaugeMetricFamily("omniflow_worker_queue_depth", "Node calls waiting for a slot", labels=labels)
        outstanding = GaugeMetricFamily("omniflow_worker_outstanding", "Node calls accepted, not finished",
                                        labels=labels)
        hit = GaugeMetricFamily("omniflow_kv_hit_rate", "KV cache hit rate, per tier", labels=[*labels, "tier"])
        used = GaugeMetricFamily("omniflow_kv_bytes", "KV cache bytes held, per tier", labels=[*labels, "tier"])
        capacity = GaugeMetricFamily("omniflow_kv_capacity_bytes", "KV cache capacity, per tier",
                                     labels=[*labels, "tier"])
        gpu = GaugeMetricFamily("omniflow_gpu_memory_bytes", "GPU memory of the worker process",
                                labels=[*labels, "kind"])
        tokens = CounterMetricFamily("omniflow_llm_generated_tokens", "Tokens generated by the worker's LLM",
                                     labels=labels)
        refused = CounterMetricFamily("omniflow_worker_plane_refused", "Connections the worker refused: no CURVE,"
                                      " a key not authorised, or a local peer of another uid", labels=labels)
        for deployment_id, workers in live.items():
            for w in workers:
                key = [deployment_id, w.role, w.worker_id]
                m = w.load.metrics
                up.add_metric(key, 1)
                queue.add_metric(key, w.load.queue_depth)
                outstanding.add_metric(key, w.load.outstanding)
                for tier in TIERS:
                    for family_, name in ((hit, "hit_rate"), (used, "bytes_used"), (capacity, "capacity_bytes")):
                        value = m.get(f"kv.{tier}.{name}", m.get(f"{tier}.{name}"))
                        if value is not None:
                            family_.add_metric([*key, tier], value)
                for kind in ("allocated", "reserved"):
                    if f"gpu_memory_{kind}_bytes" in m:
                        gpu.add_metric([*key, kind], m[f"gpu_memory_{kind}_bytes"])
                if "llm.generated_tokens" in m:
                    tokens.add_metric(key, m["llm.generated_tokens"])
                if REFUSED_METRIC in m:
                    refused.add_metric(key, m[REFUSED_METRIC])
        yield from (up, queue, outstanding, hit, used, capacity, gpu, tokens, refused)


def _refused(status: int, message: str) -> JsonResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="metrics"'} if status == 401 else None
    return JsonResponse(error_body(message), status=status, headers=headers)


def metrics_refusal(request: HttpRequest, token: str | None) -> JsonResponse | None:
    """Why `request` may not read `/metrics`, or None when it may."""
    header = request.headers.get("Authorization")
    user: Any
    if header:
        secret = bearer_token(header)
        if secret is None:
            return _refused(401, "send 'Authorization: Bearer <token>'")
        if token is not None and hmac.compare_digest(secret.encode(), token.encode()):
            return None
        user = user_for_token(secret)
        if user is None:
            return _refused(401, "invalid metrics or API token")
    else:
        user = request.user
        if not user.is_authenticated:
            return _refused(401, "authentication required: send 'Authorization: Bearer <OMNIFLOW_METRICS_TOKEN>'"
                                 " or sign in as staff")
    return None if user.is_staff else _refused(403, "the metrics are for staff and the metrics token only")


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    refused = metrics_refusal(request, engine().config.metrics_token)
    if refused is not None:
        return refused
    stored = CollectorRegistry()
    stored.register(_RunsByStatus())
    stored.register(_Deployments())
    body = engine().runs.metrics.render() + generate_latest(stored)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
