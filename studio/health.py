"""`/healthz` (is this process able to serve?) and `/metrics` (Prometheus text format)."""

from __future__ import annotations

import logging

from django.db import DatabaseError, connection
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from studio.workflows.apps import engine
from studio.workflows.models import Run, RunStatus

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


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    stored = CollectorRegistry()
    stored.register(_RunsByStatus())
    body = engine().runs.metrics.render() + generate_latest(stored)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
