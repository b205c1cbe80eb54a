"""Calls of a session go to one replica, whatever the role's balancing policy: the session's
history lives on the worker that holds it. Real worker processes, two replicas."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from engine.flow.dsl import Workflow
from engine.spec.calls import NodeCall, NodeContext
from tests.integration import workerfns
from tests.integration.deployments import Deployment, deployed

pytestmark = pytest.mark.asyncio(loop_scope="module")

OP = f"{workerfns.__name__}:whoami_in"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment() -> AsyncIterator[Deployment]:
    wf = Workflow("sessions")
    py = wf.role("py", kind="python", replicas=2, balance="round_robin")
    wf.output("out", wf.python(workerfns.whoami_in, role=py, id="who"))
    async with deployed(wf.to_spec(), heartbeat_s=0.2, with_executor=False) as d:
        yield d


async def pid_of(deployment: Deployment, params: dict[str, Any]) -> int:
    call = NodeCall(f"r{uuid.uuid4().hex[:8]}", "who", OP, params, {"x": 1}, ("out",), False, False, 1, 1)
    ctx = NodeContext(call.run_id, "who", 1, 1, lambda f, m: None)
    result = await deployment.dispatcher.execute(deployment.spec.role("py"), call, ctx, lambda ran_on: None)
    return result.outputs["out"]["pid"]


async def test_the_calls_of_a_session_stay_on_one_replica(deployment: Deployment):
    replicas = {w.pid for w in deployment.cluster.workers}
    assert len(replicas) == 2
    # Without a session, round robin takes turns.
    assert {await pid_of(deployment, {}) for _ in range(4)} == replicas
    for name in ("alpha", "beta", "gamma"):
        assert len({await pid_of(deployment, {"session": name}) for _ in range(6)}) == 1
    # Sessions spread over the replicas (hashed: 32 sessions all on one of two replicas would
    # be a one-in-two-billion chance).
    assert {await pid_of(deployment, {"session": f"s{i}"}) for i in range(32)} == replicas
