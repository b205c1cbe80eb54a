"""A worker enforces its launcher's op rule itself: started with `--no-module-ops` (what a
studio's `LocalCluster(allow_module_ops=False)` passes), it refuses every `module:function` op,
whoever sends the `ExecuteRequest` (a raw client, or an executor that never checked), and still
runs registered ops. The same worker with module ops allowed ran them all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import zmq.asyncio

from engine.data.peer import Peer, PeerConfig
from engine.data.wire import (
    ExecuteFailed,
    ExecuteRequest,
    ExecuteResult,
    ExecuteStarted,
    PortValue,
    ValueKind,
)
from engine.flow.dsl import Workflow
from engine.flow.events import NodeState, NodeStateEvent
from engine.flow.executor import Executor
from engine.flow.remote import WorkerDispatcher
from engine.spec.kinds import default_kinds
from engine.worker.launcher import LocalCluster
from tests.integration.workerfns import RawClient, whoami_request

HB = 0.2
# One strict worker serves the whole module (each test its own connection): starting one is what costs.
pytestmark = pytest.mark.asyncio(loop_scope="module")


async def answer(raw: RawClient, request) -> object:
    """The worker's answer to `request`, past its ExecuteStarted (a node that suspends is announced)."""
    reply = await raw.call(request, timeout=10.0)
    return await raw.recv(timeout=10.0) if isinstance(reply, ExecuteStarted) else reply


def strict_spec():
    """x -> square -> y on role `py`: a registered op."""
    from workflows.ops.diamond import square

    wf = Workflow("strict_ops")
    py = wf.role("py", kind="python")
    x = wf.input("x", default=3)
    node = wf.python(square, role=py, id="square")
    wf.edge(x, node)
    wf.output("y", node)
    return wf.to_spec()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def strict_cluster() -> AsyncIterator[LocalCluster]:
    cluster = LocalCluster(strict_spec(), allow_module_ops=False, heartbeat_s=HB, stop_timeout_s=10.0,
                           extra_args=("--drain-timeout", "5"))
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def raw(strict_cluster: LocalCluster) -> AsyncIterator[RawClient]:
    context = zmq.asyncio.Context()
    client = RawClient(context, strict_cluster.workers[0].details["address"], strict_cluster.keys)
    await client.hello()
    try:
        yield client
    finally:
        client.close()
        context.destroy(linger=0)


def calling(request: ExecuteRequest, **header: Any) -> ExecuteRequest:
    """`request` with its call's header changed as `header` says."""
    return msgspec.structs.replace(request, call=msgspec.structs.replace(request.call, **header))


@pytest.mark.parametrize("op", ["tests.integration.workerfns:whoami", "os:system",
                                "workflows.ops.common:Path.write_text", "workflows.ops.common:json.loads"])
async def test_a_strict_worker_refuses_module_ops_sent_to_it(raw: RawClient, op: str, tmp_path: Path) -> None:
    request = msgspec.structs.replace(calling(whoami_request(1), op=op, node_id="evil"),
                                      inputs={"x": PortValue(ValueKind.INLINE, data=str(tmp_path / "pwned"))})
    reply = await answer(raw, request)
    assert isinstance(reply, ExecuteFailed), reply
    assert reply.error.startswith("OpNotAllowedError: node 'evil': op ") and op in reply.error, reply
    assert reply.retryable is False  # refused anywhere alike: the executor must not try again
    assert not (tmp_path / "pwned").exists()


async def test_a_strict_worker_runs_registered_ops_and_refuses_unknown_ones(raw: RawClient) -> None:
    ok = calling(whoami_request(2, x=7), op="diamond.square", node_id="square")
    assert await answer(raw, ok) == ExecuteResult(2, {"out": PortValue(ValueKind.INLINE, data=49)})
    unknown = calling(whoami_request(3), op="diamond.sqare", node_id="square")
    reply = await answer(raw, unknown)
    assert isinstance(reply, ExecuteFailed), reply
    assert "UnknownOpError: node 'square': op 'diamond.sqare' is not a registered op" in reply.error
    assert "did you mean 'diamond.square'" in reply.error
    assert reply.retryable is False


async def test_an_executor_that_never_checked_gets_the_worker_refusal(strict_cluster: LocalCluster) -> None:
    spec = strict_spec()
    # Retries asked for, but a refusal is final: one attempt, not four refusals.
    nodes = [msgspec.structs.replace(n, op="tests.integration.workerfns:whoami", retries=3) if n.id == "square"
             else n for n in spec.nodes]
    evil = msgspec.structs.replace(spec, nodes=nodes)
    kinds = default_kinds()
    with Peer.start(PeerConfig(keys=strict_cluster.keys)) as peer:
        executor = Executor(WorkerDispatcher(strict_cluster.registry, peer), kinds)
        try:
            good = await (await executor.submit(spec, {"x": 5}, timeout_s=30)).wait()
            assert good.outputs == {"y": 25}, good.error
            run = await executor.submit(evil, {"x": 5}, timeout_s=30)
            result = await asyncio.wait_for(run.wait(), 60)
        finally:
            await executor.aclose()
    assert result.outputs == {}
    assert result.error is not None and "OpNotAllowedError: node 'square'" in result.error, result.error
    attempts = [e for e in run.log.snapshot()
                if isinstance(e, NodeStateEvent) and e.node == "square" and e.state == NodeState.RUNNING]
    assert len(attempts) == 1, attempts
