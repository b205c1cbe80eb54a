"""Workers' metrics over time: each worker's points for the last `OMNIFLOW_METRICS_HISTORY_S`
(an hour by default), one per `OMNIFLOW_METRICS_INTERVAL_S`.

`points.py` reads a heartbeat's gauges into a `MetricPoint` (KV tiers, GPU memory, process
memory, tokens); `store.py` keeps the bounded series (in memory embedded, in Redis
distributed); `sampler.py` writes one point per worker per interval, one sampler per cluster;
`query.py` answers `GET /api/metrics/history/` and the first message of `/ws/metrics/`, each
user seeing only their deployments' workers (staff: all).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from studio.workflows.history.sampler import MetricsSampler
from studio.workflows.history.store import HistoryLimits, HistoryStore, MemoryHistory, RedisHistory

if TYPE_CHECKING:
    from engine.client.cluster import WorkerSnapshot
    from studio.config import StudioConfig
    from studio.workflows.deployments.embedded import EmbeddedDeployments
    from studio.workflows.runs.service import RunService

SNAPSHOT_TIMEOUT_S = 5.0


class ActiveWorkers:
    """The live workers of every active deployment (the sampler's input): the deployments from
    the database, their snapshots read on the engine loop, which must answer within `timeout_s`."""

    def __init__(self, runs: RunService, deployments: EmbeddedDeployments, *,
                 timeout_s: float = SNAPSHOT_TIMEOUT_S) -> None:
        self._runs = runs
        self._deployments = deployments
        self.timeout_s = timeout_s

    def __call__(self) -> dict[str, list[WorkerSnapshot]]:
        """Raises TimeoutError, saying so, when the engine loop does not answer in time (something
        holds it: the read is given up, not left to run later)."""
        from studio.workflows.deployments.workers import active_deployments
        from studio.workflows.models import Deployment

        namespaces = active_deployments(Deployment.objects.all())
        if not namespaces:
            return {}
        future = self._runs.call(self._deployments.snapshots(namespaces))
        try:
            return future.result(self.timeout_s)
        except TimeoutError:  # the future's own carries no message: say what did not answer
            future.cancel()
            raise TimeoutError(f"the engine loop did not list the workers within {self.timeout_s:g} s") from None


def history_store(config: StudioConfig) -> HistoryStore:
    limits = HistoryLimits(window_s=config.metrics_history_s, interval_s=config.metrics_interval_s)
    if config.redis_url is not None:
        return RedisHistory(config.redis_url, config.redis_prefix, limits)
    return MemoryHistory(limits)


def build_sampler(config: StudioConfig, runs: RunService, deployments: EmbeddedDeployments) -> MetricsSampler:
    return MetricsSampler(history_store(config), ActiveWorkers(runs, deployments), interval_s=config.metrics_interval_s)


__all__ = ["ActiveWorkers", "HistoryLimits", "HistoryStore", "MemoryHistory", "MetricsSampler", "RedisHistory",
           "build_sampler", "history_store"]
