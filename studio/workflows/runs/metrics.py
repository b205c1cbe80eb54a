"""Prometheus metrics of the runs this process executes (one registry per RunService)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.client.runs import NodeStateEvent, RunEvent, RunFinished

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class RunMetrics:
    """Counters and histograms fed from run events; `render()` is the text exposition."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.runs_submitted = Counter("omniflow_runs_submitted", "Runs accepted for execution", registry=r)
        self.runs_finished = Counter("omniflow_runs_finished", "Runs finished, by status", ["status"], registry=r)
        self.runs_active = Gauge("omniflow_runs_active", "Runs executing in this process", registry=r)
        self.run_duration = Histogram("omniflow_run_duration_seconds", "Run wall time, by status", ["status"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.node_finished = Counter("omniflow_node_executions", "Node executions ended, by node kind and state",
                                     ["kind", "state"], registry=r)
        self.node_latency = Histogram("omniflow_node_latency_seconds", "Busy time of nodes that finished,"
                                      " by node kind", ["kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self.events = Counter("omniflow_run_events", "Run events stored and published", registry=r)
        self.store_latency = Histogram("omniflow_event_store_seconds", "Time to store one batch of run events",
                                       buckets=_LATENCY_BUCKETS, registry=r)

    def observe(self, events: list[RunEvent], node_kinds: dict[str, str]) -> None:
        self.events.inc(len(events))
        for event in events:
            if isinstance(event, NodeStateEvent) and event.state.terminal:
                kind = node_kinds.get(event.node, "unknown")
                self.node_finished.labels(kind, str(event.state)).inc()
                if event.duration_ms is not None and str(event.state) == "done":
                    self.node_latency.labels(kind).observe(event.duration_ms / 1e3)
            elif isinstance(event, RunFinished):
                self.runs_finished.labels(str(event.status)).inc()
                self.run_duration.labels(str(event.status)).observe(event.duration_ms / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)
