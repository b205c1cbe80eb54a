"""One worker's metrics at one time, as the history keeps them and `/metrics` exports them.

A worker reports free-form gauges in its heartbeats (`WorkerLoad.metrics`, see
`engine.worker.process`): its KV store's tiers as `kv.<tier>.<name>`, its process memory as
`rss_bytes`, the GPU memory of its device as `gpu_memory_<kind>_bytes`, its LLM's counters as
`llm.*`. `point_of` reads the ones the charts and Prometheus show into a `MetricPoint`: a tier
appears only where the worker has one (configured), GPU memory only for a worker on a CUDA
device (a CPU role on a GPU host reports its process's empty allocator; that is not shown). Everything else a heartbeat carries stays in the live snapshot (`/api/workers/`).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from engine.client.cluster import WorkerSnapshot

TIERS = ("device", "host", "disk")


class TierPoint(msgspec.Struct, frozen=True, omit_defaults=True):
    """One KV tier of a worker. Counters (`lookups`, `hits`) run from the worker's start."""

    lookups: float = 0.0
    """Pages looked up in this tier (a prefix search reaching it, a page served to a peer)."""
    hits: float = 0.0
    """Of those, pages found here."""
    pages_used: float = 0.0
    capacity_pages: float = 0.0
    bytes_used: float = 0.0
    capacity_bytes: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        """Hits over lookups since the worker started; None before the first lookup."""
        return self.hits / self.lookups if self.lookups else None

    @property
    def occupancy(self) -> float | None:
        """Pages held over the tier's capacity (0..1); None for a tier without capacity."""
        return self.pages_used / self.capacity_pages if self.capacity_pages else None


class GpuPoint(msgspec.Struct, frozen=True, omit_defaults=True):
    """The GPU memory of a worker's process on its device (torch's allocator, and the device's total)."""

    device: str
    """The worker's device as it registered (`cuda:0`, `cuda`)."""
    allocated_bytes: float = 0.0
    reserved_bytes: float = 0.0
    total_bytes: float = 0.0


class MetricPoint(msgspec.Struct, frozen=True, omit_defaults=True):
    """A worker's metrics at time `t` (epoch seconds, the sampler's clock)."""

    t: float
    outstanding: int = 0
    queue_depth: int = 0
    rss_bytes: float | None = None
    """The worker process's resident memory."""
    gpu: GpuPoint | None = None
    """None: the process has no CUDA (a CPU worker)."""
    tiers: dict[str, TierPoint] = {}
    """The KV tiers the worker has, by name (`device`, `host`, `disk`); none without a KV cache."""
    generated_tokens: float | None = None
    """Tokens its LLM generated since it started (a counter), when it runs one."""
    prompt_tokens: float | None = None
    """Prompt tokens its LLM took in since it started (a counter), when it runs one. With no KV
    lookup counted it tells prompts too short to look a page up (only a prompt longer than a page
    has one) from no prompt at all."""


class WorkerSeries(msgspec.Struct, frozen=True):
    """One worker's points, oldest first, with what the charts label it by."""

    worker_id: str
    deployment: str
    role: str
    device: str
    host: str
    model: str | None
    points: list[MetricPoint]


def _gauge(metrics: Mapping[str, float], tier: str, name: str) -> float | None:
    value = metrics.get(f"kv.{tier}.{name}", metrics.get(f"{tier}.{name}"))
    return None if value is None else float(value)


def tier_points(metrics: Mapping[str, float]) -> dict[str, TierPoint]:
    """The KV tiers a worker reports (a tier it has reports its capacity)."""
    out: dict[str, TierPoint] = {}
    for tier in TIERS:
        capacity = _gauge(metrics, tier, "capacity_pages")
        if capacity is None:
            continue
        out[tier] = TierPoint(
            lookups=_gauge(metrics, tier, "lookups") or 0.0,
            hits=_gauge(metrics, tier, "hit_pages") or 0.0,
            pages_used=_gauge(metrics, tier, "pages_used") or 0.0,
            capacity_pages=capacity,
            bytes_used=_gauge(metrics, tier, "bytes_used") or 0.0,
            capacity_bytes=_gauge(metrics, tier, "capacity_bytes") or 0.0,
        )
    return out


def point_of(snapshot: WorkerSnapshot, t: float) -> MetricPoint:
    m = snapshot.load.metrics
    gpu = None
    if "gpu_memory_allocated_bytes" in m and snapshot.info.device.startswith("cuda"):
        gpu = GpuPoint(device=snapshot.info.device, allocated_bytes=float(m["gpu_memory_allocated_bytes"]),
                       reserved_bytes=float(m.get("gpu_memory_reserved_bytes", 0.0)),
                       total_bytes=float(m.get("gpu_memory_total_bytes", 0.0)))
    rss = m.get("rss_bytes")
    generated = m.get("llm.generated_tokens")
    prompted = m.get("llm.prompt_tokens")
    return MetricPoint(
        t=t,
        outstanding=snapshot.load.outstanding,
        queue_depth=snapshot.load.queue_depth,
        rss_bytes=None if rss is None else float(rss),
        gpu=gpu,
        tiers=tier_points(m),
        generated_tokens=None if generated is None else float(generated),
        prompt_tokens=None if prompted is None else float(prompted),
    )
