"""Back-pressure on streams between real worker processes: a producer on one worker, its
reader on another, the executor between them with credit windows on both links.

One deployment of the two roles serves the module. Readers wait on the producer's counter
file (`workerfns.counted`), with deadlines, never on a clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from engine.flow.dsl import Workflow
from engine.flow.events import NodeState, NodeStateEvent, RunStatus
from engine.flow.executor import RunResult
from tests.integration import workerfns
from tests.integration.deployments import Deployment, deployed
from tests.unit.flow import fns

pytestmark = pytest.mark.asyncio(loop_scope="module")

HB = 0.2
WINDOW = 4
"""Frames each link may carry ahead of its reader's credit."""
CAPACITY = 4
"""Frames the executor holds for a stream edge its reader has not taken."""


def two_roles(name: str) -> tuple[Workflow, Any, Any]:
    wf = Workflow(name)
    return wf, wf.role("src", kind="python"), wf.role("dst", kind="python")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment() -> AsyncIterator[Deployment]:
    wf, src, dst = two_roles("roles")
    wf.edge(wf.python(fns.identity, role=src, id="a"), wf.python(fns.identity, role=dst, id="b"))
    async with deployed(wf.to_spec(), heartbeat_s=HB, stream_window=WINDOW, stream_capacity=CAPACITY) as d:
        yield d


async def run(deployment: Deployment, wf: Workflow) -> RunResult:
    assert deployment.executor is not None
    handle = await deployment.executor.submit(wf.to_spec(), timeout_s=30.0)
    return await asyncio.wait_for(handle.wait(), 40.0)


async def test_a_producer_on_a_worker_runs_no_further_ahead_than_its_credit(deployment: Deployment,
                                                                            tmp_path: Path):
    n = 40
    wf, src_role, dst_role = two_roles("lag")
    src = wf.python(workerfns.counted_frames, role=src_role, id="src", stream=True,
                    params={"n": n, "dir": str(tmp_path), "gate": "go"})
    read = wf.python(workerfns.lagging_reader, role=dst_role, id="read",
                     params={"dir": str(tmp_path), "n": n, "ahead": CAPACITY})
    wf.edge(src, read, stream=True)
    wf.output("out", read)
    assert deployment.executor is not None
    handle = await deployment.executor.submit(wf.to_spec(), timeout_s=30.0)
    # Its first frame made, the producer waits until the reader runs: only then does the
    # executor hold the reader's stream to its capacity (a reader still queued might wait for
    # a slot its own producer holds).
    async with contextlib.aclosing(handle.events()) as events:
        async for event in events:
            if isinstance(event, NodeStateEvent) and event.node == "read" and event.state == NodeState.RUNNING:
                break
    workerfns.mark(tmp_path, "go")
    result = await asyncio.wait_for(handle.wait(), 40.0)
    assert result.status == RunStatus.DONE, result.error
    out = result.outputs["out"]
    assert out["count"] == n
    # At most: the reader's worker holds a window, the executor's channel its capacity and the
    # frame its forwarder waits to send, a window is on its way from the producer's worker,
    # and the producer holds the frame it made last.
    assert CAPACITY <= out["max_lead"] <= 2 * WINDOW + CAPACITY + 2, out


async def test_a_reader_on_a_worker_taking_its_ports_in_turn_does_not_deadlock(deployment: Deployment):
    n = 5 * (WINDOW + CAPACITY)
    wf, src_role, dst_role = two_roles("turns")
    src = wf.python(fns.ports_in_turn, role=src_role, id="src", stream=True, params={"n": n},
                    outputs={"a": "json", "b": "json"})
    zipped = wf.python(fns.zip_sum, role=dst_role, id="zip")
    wf.edge(src.out("a"), zipped.inp("a"), stream=True)
    wf.edge(src.out("b"), zipped.inp("b"), stream=True)
    wf.output("out", zipped)
    result = await run(deployment, wf)
    assert result.status == RunStatus.DONE, result.error
    assert result.outputs["out"] == [11 * i for i in range(n)]


async def test_a_reader_on_a_worker_that_stops_early_does_not_hold_its_producer(deployment: Deployment):
    n = 10 * (WINDOW + CAPACITY)
    wf, src_role, dst_role = two_roles("early")
    fns.early_reader(wf, fns.sync_frames, {"items": list(range(n))}, src_role, dst_role)
    result = await run(deployment, wf)
    assert result.status == RunStatus.DONE, result.error
    assert result.outputs == {"first": [0, 1, 2], "all": list(range(n))}

