"""The cluster page's metrics history in real Chromium, against a live (embedded) studio running a
deployment of `workflows/chat.py`, whose llm role has a host and a disk KV tier.

Here: deploy it over REST with an API token, put it under load with `/v1/chat/completions` (new
prompts fill pages in every tier, repeated ones hit them), and wait until the studio's history
(`GET /api/metrics/history/`) holds the llm worker's three tiers. Then `frontend/e2e/metrics.e2e.mjs`
checks in the browser: the aggregate and per-worker charts carry the device, host and disk series,
the memory panel says the cluster is CPU-only and charts RSS, the charts survive a reload with the
points from before it, and the range picker switches to an hour (kept in the URL across a reload).
Last, `/metrics` scraped with the metrics token carries the same series, and every query of the
Grafana dashboard in deploy/ names a series it serves. Screenshots land in tests/e2e/artifacts/metrics/.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.browser import ARTIFACTS, assert_shots, needs_browser, run_script
from tests.e2e.conftest import METRICS_TOKEN, ROOT, LiveStudio

TIERS = ("device", "host", "disk")

pytestmark = needs_browser


class Api:
    def __init__(self, base: str, token: str) -> None:
        self.base = base
        self.token = token

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        request = urllib.request.Request(self.base + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                raw = response.read()
                return response.status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw.decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")


def until(read: Callable[[], Any], ready: Callable[[Any], bool], what: str, deadline_s: float = 120.0) -> Any:
    """`read()` again until `ready` says so (readiness); the pause is the server's answer time."""
    deadline = time.monotonic() + deadline_s
    value = read()
    while not ready(value):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {deadline_s} s (last: {str(value)[:800]})")
        value = read()
    return value


@contextmanager
def deployed(api: Api, workflow: str) -> Iterator[dict[str, Any]]:
    """The demo user's example `workflow` deployed and running (its detail, workers included), stopped
    and seen stopped when the block ends."""
    status, found = api.call("GET", f"/api/workflows/?search={workflow}")
    assert status == 200, found
    (wf,) = [w for w in found["results"] if w["name"] == workflow]
    status, deployment = api.call("POST", "/api/deployments/", {"workflow": wf["id"]})
    assert status == 201, deployment
    url = f"/api/deployments/{deployment['id']}/"
    try:
        deployment = until(lambda: api.call("GET", url)[1], lambda d: d["status"] not in ("pending", "starting"),
                           f"the {workflow} deployment starts")
        assert deployment["status"] == "running", deployment
        yield deployment
    finally:
        api.call("POST", f"{url}stop/")
        until(lambda: api.call("GET", url)[1], lambda d: d["status"] == "stopped", "the deployment stops",
              deadline_s=60)


def demo_token(studio: LiveStudio) -> str:
    """A new API token of the demo user (its password is set again, to the same one)."""
    out = subprocess.run([sys.executable, str(ROOT / "manage.py"), "setup_demo", "--username", studio.user,
                          "--password", studio.password, "--no-examples", "--no-chat", "--token"], cwd=ROOT,
                         env=studio.env, check=True, timeout=120, capture_output=True, text=True)
    return re.search(r"^token: (\S+)$", out.stdout, re.M).group(1)


def tiers_filled(body: dict[str, Any], worker: str) -> bool:
    series = [w for w in body["workers"] if w["worker_id"] == worker]
    if not series or not series[0]["points"]:
        return False
    tiers = series[0]["points"][-1].get("tiers", {})
    return all(tiers.get(t, {}).get("pages_used", 0) > 0 for t in TIERS) and tiers["device"].get("hits", 0) > 0


def served(text: str) -> tuple[set[str], list[Any]]:
    names: set[str] = set()
    samples: list[Any] = []
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(f"{family.name}{suffix}" for suffix in ("_total", "_bucket", "_count", "_sum"))
        samples += family.samples
    return names, samples


@pytest.mark.timeout(420)
def test_cluster_page_history_tiers_and_range_in_chromium(live_studio: LiveStudio) -> None:
    api = Api(live_studio.url, demo_token(live_studio))
    with deployed(api, "chat") as deployment:
        (llm,) = [w for w in deployment["workers"] if w["role"] == "llm"]

        # load: new prompts write pages through to the host and disk tiers, repeated ones hit them
        for i in range(12):
            prompt = f"Tell me about the history of metric number {i % 6}. " * 3
            status, reply = api.call("POST", "/v1/chat/completions", {
                "model": deployment["name"], "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]})
            assert status == 200, reply
        history = until(lambda: api.call("GET", "/api/metrics/history/?range=5m")[1],
                        lambda body: tiers_filled(body, llm["worker_id"]),
                        "the history holds the llm worker's three tiers, filled")
        points = next(w for w in history["workers"] if w["worker_id"] == llm["worker_id"])["points"]
        assert len(points) >= 2 and points[-1]["rss_bytes"] > 0 and "gpu" not in points[-1]

        shots = run_script("metrics.e2e.mjs", live_studio, ARTIFACTS / "metrics", timeout_s=240,
                           env={"LLM_WORKER": llm["worker_id"]})
        assert_shots(shots, ("cluster-tiers", "cluster-after-reload", "cluster-range-1h", "cluster-workers-1024",
                             "cluster-workers-1440"))

        # Prometheus sees the same series: every tier of the llm worker, its RSS; the dashboard's names
        request = urllib.request.Request(live_studio.url + "/metrics",
                                         headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            names, samples = served(response.read().decode())
        mine = [s for s in samples if s.labels.get("worker") == llm["worker_id"]]
        for metric in ("omniflow_kv_occupancy", "omniflow_kv_hit_rate", "omniflow_kv_lookups_total"):
            assert {s.labels["tier"] for s in mine if s.name == metric} == set(TIERS), metric
        assert [s.value > 0 for s in mine if s.name == "omniflow_worker_rss_bytes"] == [True]
        dashboard = json.loads((ROOT / "deploy" / "grafana" / "omniflow-dashboard.json").read_text())
        for query in [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]:
            assert set(re.findall(r"\bomniflow_[a-z0-9_]+", query)) <= names, query
