"""What a role worker process tells its launcher, and the names the launcher reads back.

A worker that is ready prints one line, `OMNIFLOW-READY {json}`, on standard output; one that cannot
start prints `OMNIFLOW-FAILED {"error": ...}` instead (`report_start_failure`), which the launcher
reads back (`start_failure`). Its exit status 6 (`FENCED_EXIT`) says another replica took its
place, and its metric `plane.refused` (`REFUSED_METRIC`) counts the connections it refused.

Launchers (`engine.worker.ranks`, `engine.client.workers`) import this module, never the worker
process itself, which loads the compute stack (torch) that a launcher does not need.
"""

from __future__ import annotations

import json

READY_PREFIX = "OMNIFLOW-READY "
FAILED_PREFIX = "OMNIFLOW-FAILED "
FENCED_EXIT = 6
"""The exit status of a worker whose id was fenced: another replica took its place."""
REFUSED_METRIC = "plane.refused"
"""The worker metric counting connections its sockets refused: no CURVE, a key not authorised,
or (the local socket) a process of another uid; with those its unit's own sockets refused
(`ComputeUnit.refused`: a tensor-parallel replica's link and transfer seats, its follower ranks'
included)."""


def report_start_failure(error: str) -> None:
    """Tell the launcher why this worker could not start: the FAILED line on standard output."""
    print(FAILED_PREFIX + json.dumps({"error": error}), flush=True)


def start_failure(output: str) -> str | None:
    """Why a worker could not start, as the last FAILED line in `output` (what it printed) says;
    None when there is none."""
    for line in reversed(output.splitlines()):
        if line.startswith(FAILED_PREFIX):
            try:
                error = json.loads(line[len(FAILED_PREFIX):]).get("error")
            except (json.JSONDecodeError, AttributeError):
                return None
            return error if isinstance(error, str) and error else None
    return None
