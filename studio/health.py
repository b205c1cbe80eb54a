"""`/healthz` (is this process able to serve?) and `/metrics` (Prometheus text format).

`/metrics` holds this process's run metrics (`RunMetrics`: runs submitted/finished/active,
run and node latency histograms by node kind), run and deployment counts from the
database, and at scrape time the live workers' gauges from the registry, labelled
`deployment, role, worker` (and `tier` for the KV cache): per tier wherever the worker has one
(device, host, disk), hit rate, lookups and hits, occupancy, pages and bytes held and capacity;
process memory (`omniflow_worker_rss_bytes`), GPU memory per device where the process has CUDA
(`omniflow_gpu_memory_bytes{device, kind}`), queue depth, outstanding calls, tokens generated,
connections refused on the worker plane (`omniflow_worker_plane_refused`: no CURVE key, or
another uid; a tensor-parallel replica's, its follower ranks' included, on its rank 0). They are the series the cluster page charts (`studio.workflows.history.points`);
`deploy/grafana/omniflow-dashboard.json` charts them in Grafana.

`/metrics` answers only Prometheus with the operator's token (`OMNIFLOW_METRICS_TOKEN`, sent
as `Authorization: Bearer <token>`, compared in constant time) or staff (a browser session or
an API token of a staff user): without credentials 401 (`WWW-Authenticate: Bearer`), another
user 403. Run counts, deployments and workers' load are the whole studio's, not one user's.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from django.db import DatabaseError, connection
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.client.cluster import RegistryError
from engine.client.workers import REFUSED_METRIC
from studio.accounts.auth import bearer_token, user_for_token
from studio.errors import error_body
from studio.workflows.apps import engine
from studio.workflows.deployments.workers import active_deployments, snapshots_sync
from studio.workflows.history.points import TierPoint, point_of
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


def _by_status(model: Any, statuses: list[str], name: str, documentation: str) -> GaugeMetricFamily:
    """A gauge of `model`'s rows by their `status` (every one of `statuses`, zero included)."""
    family = GaugeMetricFamily(name, documentation, labels=["status"])
    counts = dict.fromkeys(statuses, 0)
    for row in model.objects.values("status").annotate(n=Count("id")):
        counts[row["status"]] = row["n"]
    for status, n in counts.items():
        family.add_metric([status], n)
    return family


class _RunsByStatus:
    """Run counts by status, read from the database at scrape time (all processes' runs)."""

    def collect(self):
        yield _by_status(Run, RunStatus.values, "omniflow_runs", "Runs stored, by status")


_TIER_SERIES: tuple[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str,
                         Callable[[TierPoint], float | None]], ...] = (
    (GaugeMetricFamily, "omniflow_kv_hit_rate", "KV cache hit rate since the worker started, per tier",
     lambda t: t.hit_rate or 0.0),
    (CounterMetricFamily, "omniflow_kv_lookups", "KV pages looked up, per tier", attrgetter("lookups")),
    (CounterMetricFamily, "omniflow_kv_hits", "KV pages found, per tier", attrgetter("hits")),
    (GaugeMetricFamily, "omniflow_kv_occupancy", "KV pages held over the tier's capacity (0..1)",
     attrgetter("occupancy")),
    (GaugeMetricFamily, "omniflow_kv_pages", "KV pages held, per tier", attrgetter("pages_used")),
    (GaugeMetricFamily, "omniflow_kv_capacity_pages", "KV cache capacity in pages, per tier",
     attrgetter("capacity_pages")),
    (GaugeMetricFamily, "omniflow_kv_bytes", "KV cache bytes held, per tier", attrgetter("bytes_used")),
    (GaugeMetricFamily, "omniflow_kv_capacity_bytes", "KV cache capacity, per tier", attrgetter("capacity_bytes")),
)
"""The per-tier families of each worker's KV store: their type, name, help and the value a `TierPoint`
gives them (None: no sample, as for a tier without capacity's occupancy)."""


class _Deployments:
    """Deployments by status (database) and their live workers' gauges (registry)."""

    def collect(self):
        yield _by_status(Deployment, DeploymentStatus.values, "omniflow_deployments",
                         "Deployments stored, by status")
        try:
            live = snapshots_sync(engine(), active_deployments(Deployment.objects.all()))
        except (TimeoutError, RegistryError) as exc:
            log.warning("metrics: reading the workers failed: %s", exc)
            live = {}
        labels = ["deployment", "role", "worker"]
        tiered = [*labels, "tier"]
        up = GaugeMetricFamily("omniflow_worker_up", "A live role worker (registered, heartbeating)", labels=labels)
        queue = GaugeMetricFamily("omniflow_worker_queue_depth", "Node calls waiting for a slot", labels=labels)
        outstanding = GaugeMetricFamily("omniflow_worker_outstanding", "Node calls accepted, not finished",
                                        labels=labels)
        rss = GaugeMetricFamily("omniflow_worker_rss_bytes", "Resident memory of the worker process", labels=labels)
        tier_families = [(family(name, documentation, labels=tiered), value_of)
                         for family, name, documentation, value_of in _TIER_SERIES]
        gpu = GaugeMetricFamily("omniflow_gpu_memory_bytes", "GPU memory of the worker process on its device"
                                " (allocated, reserved by its allocator; the device's total)",
                                labels=[*labels, "device", "kind"])
        tokens = CounterMetricFamily("omniflow_llm_generated_tokens", "Tokens generated by the worker's LLM",
                                     labels=labels)
        refused = CounterMetricFamily("omniflow_worker_plane_refused", "Connections the worker refused: no CURVE,"
                                      " a key not authorised, or a local peer of another uid", labels=labels)
        now = time.time()
        for deployment_id, workers in live.items():
            for w in workers:
                key = [deployment_id, w.role, w.worker_id]
                point = point_of(w, now)  # the series the history keeps (studio.workflows.history)
                up.add_metric(key, 1)
                queue.add_metric(key, point.queue_depth)
                outstanding.add_metric(key, point.outstanding)
                if point.rss_bytes is not None:
                    rss.add_metric(key, point.rss_bytes)
                for tier, t in point.tiers.items():
                    for family, value_of in tier_families:
                        if (sample := value_of(t)) is not None:
                            family.add_metric([*key, tier], sample)
                if point.gpu is not None:
                    for kind, value in (("allocated", point.gpu.allocated_bytes), ("reserved", point.gpu.reserved_bytes),
                                        ("total", point.gpu.total_bytes)):
                        gpu.add_metric([*key, point.gpu.device, kind], value)
                if point.generated_tokens is not None:
                    tokens.add_metric(key, point.generated_tokens)
                if REFUSED_METRIC in w.load.metrics:
                    refused.add_metric(key, w.load.metrics[REFUSED_METRIC])
        yield from (up, queue, outstanding, rss, *(family for family, _ in tier_families), gpu, tokens, refused)


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
