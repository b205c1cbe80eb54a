"""A user's view of the history: `GET /api/metrics/history/` and the first message of `/ws/metrics/`.

The body (JSON):

    {"range": "5m", "range_s": 300, "since": <epoch s>, "now": <epoch s>,
     "interval_s": 1.0, "step_s": 1.0, "history_s": 3600,
     "workers": [{"worker_id", "deployment", "role", "device", "host", "model",
                  "points": [MetricPoint, ...]}, ...]}

A `MetricPoint` is `{"t", "outstanding", "queue_depth", "rss_bytes"?, "gpu"?: {"device",
"allocated_bytes", "reserved_bytes", "total_bytes"}, "tiers": {"device"|"host"|"disk": {"lookups",
"hits", "pages_used", "capacity_pages", "bytes_used", "capacity_bytes"}}, "generated_tokens"?,
"prompt_tokens"?}`
(`studio.workflows.history.points`; a key left out is a value the worker does not have).
A range is `<n>s`, `<n>m` or `<n>h` (the cluster page asks for `5m` and `1h`), at most the
history kept. Over a long range each worker's points are thinned to at most `MAX_POINTS`: the
last point of every `step_s` (the sampler writes every worker at the same instants, so the
workers' points stay aligned).

Scoping: the workers of the deployments the user can see (`Deployment.objects.visible_to`: their
own; staff all), stopped ones included while their points are within the range.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import msgspec

from studio.workflows.history.points import MetricPoint, WorkerSeries
from studio.workflows.history.store import HistoryStore
from studio.workflows.models import Deployment

DEFAULT_RANGE = "5m"
MAX_POINTS = 720
"""The most points of one worker in one answer (an hour at 5 s)."""
_RANGE = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


class RangeError(ValueError):
    """A `range` that is not `<n>s|m|h` within the history kept; the message says which."""


def parse_range(raw: str | None, history_s: float) -> tuple[str, float]:
    """`(range as given, seconds)`; the default `5m` when `raw` is None or empty."""
    text = (raw or DEFAULT_RANGE).strip()
    match = _RANGE.match(text)
    if match is None:
        raise RangeError(f"range {text!r}: write a number of seconds, minutes or hours, such as 5m or 1h")
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds > history_s:
        raise RangeError(f"range {text!r}: the studio keeps {history_s:g} s of history")
    return text, float(seconds)


def thin(points: list[MetricPoint], step_s: float) -> list[MetricPoint]:
    """The last point of each `step_s` bucket (all of them when `step_s` is the interval or less)."""
    out: list[MetricPoint] = []
    bucket: int | None = None
    for point in points:
        current = math.floor(point.t / step_s)
        if out and current == bucket:
            out[-1] = point
        else:
            out.append(point)
        bucket = current
    return out


def step_for(range_s: float, interval_s: float) -> float:
    return max(interval_s, range_s / MAX_POINTS)


def series_json(series: WorkerSeries, step_s: float, interval_s: float) -> dict[str, Any]:
    body = msgspec.to_builtins(series)
    if step_s > interval_s:
        body["points"] = msgspec.to_builtins(thin(series.points, step_s))
    return body


def history(store: HistoryStore, user: Any, *, range_text: str, range_s: float, worker: str | None = None,
            deployment: str | None = None) -> dict[str, Any]:
    """The history `user` may see over the last `range_s` (raises `HistoryUnavailable` from the store)."""
    now = time.time()
    since = now - range_s
    recent = store.deployments(since)
    if deployment is not None:
        recent &= {deployment}
    visible = {str(pk) for pk in Deployment.objects.visible_to(user).filter(pk__in=list(recent))
               .values_list("pk", flat=True)}
    limits = store.limits
    step_s = step_for(range_s, limits.interval_s)
    return {
        "range": range_text,
        "range_s": range_s,
        "since": since,
        "now": now,
        "interval_s": limits.interval_s,
        "step_s": step_s,
        "history_s": limits.window_s,
        "workers": [series_json(s, step_s, limits.interval_s)
                    for s in store.series(visible, since, worker) if s.points],
    }
