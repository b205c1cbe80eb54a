"""GPU memory on the cluster page, from the heartbeat on, in real Chromium (no GPU needed).

A GPU worker reaches the studio through one boundary: its liveness thread (`engine.worker.liveness`)
registers it in the deployment's Redis namespace and heartbeats its load there, whose gauges carry
`gpu_memory_<kind>_bytes` for a CUDA device (`engine.worker.process.process_metrics`; what it reads
from torch on a real GPU is checked by tests/gpu/test_worker_gpu_metrics.py). Everything the studio
shows is read from that registry. So here a studio runs with REDIS_URL, deploys the example `hello`
workflow (a CPU python worker), and the page is seen first as a CPU-only cluster (the RSS chart and its
note). Then two workers of a GPU host join the deployment by hand as `omniflow worker --namespace`
would: each a real `Liveness` thread, registered on `cuda:0` and `cuda:1`, heartbeating the gauges a
worker on that device reports. From there on: the history REST endpoint returns their GPU points,
`frontend/e2e/gpu-metrics.e2e.mjs` sees one GPU memory series per device with their allocated bytes
(overall, per worker, and after a reload), and `/metrics` carries `omniflow_gpu_memory_bytes` for each
device and kind. Screenshots land in tests/e2e/artifacts/gpu-metrics/.
"""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from engine.compute.models.cache import ModelCache
from engine.flow.discovery import WorkerInfo, WorkerLoad
from engine.spec.graph import RoleSpec
from engine.worker.config import WorkerConfig
from engine.worker.liveness import Liveness
from tests.e2e.browser import ARTIFACTS, assert_shots, needs_browser, run_script
from tests.e2e.conftest import METRICS_TOKEN, LiveStudio, prepare_studio, serving, studio_env
from tests.e2e.test_metrics_e2e import Api, demo_token, deployed, served, until

REDIS_URL = os.environ.get("REDIS_URL")
GiB = 1024**3
GPU_HOST = "gpu-node-1"

pytestmark = [needs_browser,
              pytest.mark.skipif(not REDIS_URL, reason="needs REDIS_URL (GPU workers join through its registry)")]


@dataclass(frozen=True, slots=True)
class GpuWorker:
    """A worker of the GPU host and what its heartbeat reports (torch's allocator on its device)."""

    worker_id: str
    device: str
    allocated: float
    reserved: float
    total: float
    rss: float

    @property
    def label(self) -> str:
        """The series the cluster page draws for its device: `<host> <device>`."""
        return f"{GPU_HOST} {self.device}"

    def gauges(self) -> dict[str, float]:
        """The process gauges a worker on a CUDA device heartbeats (`process_metrics`)."""
        return {"rss_bytes": self.rss, "gpu_memory_allocated_bytes": self.allocated,
                "gpu_memory_reserved_bytes": self.reserved, "gpu_memory_total_bytes": self.total,
                "gpu_memory_free_bytes": self.total - self.reserved}


GPU_WORKERS = (
    GpuWorker("llm-gpu-0", "cuda:0", allocated=3.25 * GiB, reserved=4 * GiB, total=80 * GiB, rss=2.5 * GiB),
    GpuWorker("llm-gpu-1", "cuda:1", allocated=12 * GiB, reserved=14.5 * GiB, total=80 * GiB, rss=2.75 * GiB),
)


@contextmanager
def joined(worker: GpuWorker, namespace: str) -> Iterator[None]:
    """`worker` joined to `namespace`: its liveness thread registered and heartbeating until the block
    ends, then deregistering it (as a worker that stops does)."""
    config = WorkerConfig(role=RoleSpec(name="llm", kind="llm", model="smollm2-135m", device=worker.device),
                          worker_id=worker.worker_id, workflow="hello", listen="tcp://127.0.0.1:0",
                          registry_url=REDIS_URL, namespace=namespace, heartbeat_s=0.25, registry_ttl_s=2.0)
    stopped: list[str] = []
    liveness = Liveness(config, "127.0.0.1", lambda: WorkerLoad(metrics=worker.gauges()), stopped.append)
    address = liveness.start_and_bind()
    try:
        liveness.register(WorkerInfo(worker.worker_id, "llm", address, model="smollm2-135m", device=worker.device,
                                     host=GPU_HOST, meta={"liveness": address, "workflow": "hello"}))
        yield
    finally:
        liveness.stop()
    assert not stopped, stopped


@pytest.fixture(scope="module")
def redis_studio(tmp_path_factory: pytest.TempPathFactory, smollm2_cache: ModelCache) -> Iterator[LiveStudio]:
    """An embedded studio whose deployments' workers register in Redis (REDIS_URL), under a prefix
    of its own (removed afterwards)."""
    data_dir = tmp_path_factory.mktemp("studio-redis")
    prefix = f"e2e-gpu-{uuid.uuid4().hex[:8]}"
    env = {**studio_env(data_dir, smollm2_cache), "REDIS_URL": str(REDIS_URL), "OMNIFLOW_REDIS_PREFIX": prefix}
    prepare_studio(env)
    try:
        with serving(data_dir, env) as studio:
            yield studio
    finally:
        client = redis.Redis.from_url(str(REDIS_URL))
        for key in client.scan_iter(f"*{prefix}*"):
            client.delete(key)
        client.close()


def series_of(body: dict[str, Any], worker_id: str) -> dict[str, Any] | None:
    return next((w for w in body["workers"] if w["worker_id"] == worker_id), None)


def gpu_shown(body: dict[str, Any]) -> bool:
    """Each GPU worker's newest point carries its device's memory."""
    return all((s := series_of(body, w.worker_id)) is not None and s["points"] and "gpu" in s["points"][-1]
               for w in GPU_WORKERS)


@pytest.mark.timeout(420)
def test_gpu_workers_heartbeats_reach_rest_chart_and_prometheus(redis_studio: LiveStudio) -> None:
    api = Api(redis_studio.url, demo_token(redis_studio))
    with deployed(api, "hello") as deployment:
        (py,) = [w for w in deployment["workers"] if w["role"] == "py"]
        # CPU only: the python worker's heartbeats (through Redis) carry its RSS and no GPU
        history = until(lambda: api.call("GET", "/api/metrics/history/?range=5m")[1],
                        lambda body: len((series_of(body, py["worker_id"]) or {"points": []})["points"]) >= 4,
                        "the history holds the python worker's points")
        points = series_of(history, py["worker_id"])["points"]
        assert all(p["rss_bytes"] > 0 and "gpu" not in p for p in points), points[-1]
        shots = run_script("gpu-metrics.e2e.mjs", redis_studio, ARTIFACTS / "gpu-metrics" / "cpu-only",
                           timeout_s=120, env={"PHASE": "cpu", "PY_WORKER": py["worker_id"]})
        assert_shots(shots, ("cpu-only",))

        with ExitStack() as workers:
            for worker in GPU_WORKERS:
                workers.enter_context(joined(worker, deployment["namespace"]))
            history = until(lambda: api.call("GET", "/api/metrics/history/?range=5m")[1], gpu_shown,
                            "the history holds the GPU workers' memory")
            for worker in GPU_WORKERS:
                series = series_of(history, worker.worker_id)
                assert (series["deployment"], series["role"], series["device"], series["host"]) == (
                    deployment["id"], "llm", worker.device, GPU_HOST)
                assert series["points"][-1]["gpu"] == {"device": worker.device, "allocated_bytes": worker.allocated,
                                                       "reserved_bytes": worker.reserved, "total_bytes": worker.total}
                assert series["points"][-1]["rss_bytes"] == worker.rss
            assert all("gpu" not in p for p in series_of(history, py["worker_id"])["points"])

            expected = [{"worker": w.worker_id, "label": w.label, "allocated": w.allocated} for w in GPU_WORKERS]
            shots = run_script("gpu-metrics.e2e.mjs", redis_studio, ARTIFACTS / "gpu-metrics" / "gpu",
                               timeout_s=180, env={"PHASE": "gpu", "PY_WORKER": py["worker_id"],
                                                   "GPU_WORKERS": json.dumps(expected)})
            assert_shots(shots, ("gpu-memory", "gpu-worker-cards", "gpu-after-reload"))

            request = urllib.request.Request(redis_studio.url + "/metrics",
                                             headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
            with urllib.request.urlopen(request, timeout=30) as response:
                _, samples = served(response.read().decode())
        gpu = {(s.labels["worker"], s.labels["device"], s.labels["kind"]): s.value
               for s in samples if s.name == "omniflow_gpu_memory_bytes"}
        assert gpu == {key: value for w in GPU_WORKERS for key, value in (
            ((w.worker_id, w.device, "allocated"), w.allocated), ((w.worker_id, w.device, "reserved"), w.reserved),
            ((w.worker_id, w.device, "total"), w.total))}
        assert {s.labels["deployment"] for s in samples if s.name == "omniflow_gpu_memory_bytes"} == {deployment["id"]}
        rss = {s.labels["worker"]: s.value for s in samples if s.name == "omniflow_worker_rss_bytes"}
        assert {w.worker_id: rss.get(w.worker_id) for w in GPU_WORKERS} == {w.worker_id: w.rss for w in GPU_WORKERS}
        assert rss[py["worker_id"]] > 0
