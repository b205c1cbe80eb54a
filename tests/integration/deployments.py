"""A GraphSpec deployed on real worker processes, as the worker integration tests start it.

`deployed(spec, ...)` starts a `LocalCluster` with a `WorkerDispatcher` (and an `Executor`) on
one `Peer`, and stops all of them again; `Deployment.execute` runs one node on a role's workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from transformers import PreTrainedModel

from engine.data.peer import Peer, PeerConfig
from engine.flow.executor import Executor
from engine.flow.remote import WorkerDispatcher
from engine.spec.calls import NodeCall, NodeContext
from engine.spec.graph import GraphSpec
from engine.spec.kinds import default_kinds
from engine.worker.launcher import LaunchedWorker, LocalCluster


@dataclass
class Deployment:
    spec: GraphSpec
    cluster: LocalCluster
    dispatcher: WorkerDispatcher
    peer: Peer
    executor: Executor | None
    """Runs whole graphs; None where the deployment was started without one."""

    def replica(self, role: str) -> LaunchedWorker:
        """The role's one replica."""
        (worker,) = [w for w in self.cluster.workers if w.role == role]
        return worker

    async def execute(self, role: str, inputs: dict[str, Any], outputs: tuple[str, ...],
                      params: dict[str, Any] | None = None,
                      started: asyncio.Event | None = None) -> dict[str, Any]:
        """One node (fresh run and node ids) on a worker of `role`; `started` is set once it runs."""
        node_id = f"n{uuid.uuid4().hex[:6]}"
        call = NodeCall(f"r{uuid.uuid4().hex[:8]}", node_id, None, params or {}, inputs, outputs,
                        False, False, 1, 1)
        ctx = NodeContext(call.run_id, node_id, 1, 1, lambda f, m: None)
        result = await self.dispatcher.execute(self.spec.role(role), call, ctx,
                                               (lambda ran_on: started.set()) if started is not None else (lambda ran_on: None))
        return result.outputs


@contextlib.asynccontextmanager
async def deployed(spec: GraphSpec, *, heartbeat_s: float, with_executor: bool = True,
                   check_processes_stop: bool = False, stream_window: int = 64,
                   stream_capacity: int = Executor.DEFAULT_STREAM_CAPACITY,
                   **cluster_options: Any) -> AsyncIterator[Deployment]:
    """`spec` on a started `LocalCluster`; `check_processes_stop` asserts no worker process outlives it."""
    cluster = LocalCluster(spec, allow_module_ops=True, heartbeat_s=heartbeat_s, stop_timeout_s=10.0, **cluster_options)
    peer = Peer.start(PeerConfig(keys=cluster.keys))
    try:
        await cluster.start()
        dispatcher = WorkerDispatcher(cluster.registry, peer, heartbeat_s=heartbeat_s, connect_timeout_s=5.0,
                                      stream_window=stream_window)
        executor = Executor(dispatcher, default_kinds(), stream_capacity=stream_capacity) if with_executor else None
        try:
            yield Deployment(spec, cluster, dispatcher, peer, executor)
        finally:
            await (executor.aclose() if executor is not None else dispatcher.close())
    finally:
        pids = [w.pid for w in cluster.workers for w in w.processes]
        await cluster.stop()
        peer.close()
        if check_processes_stop:
            alive = [pid for pid in pids
                     if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
            assert not alive, "a rank process outlived stop()"


def text_ids(seed: int, n: int) -> list[int]:
    """`n` printable-ASCII token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def hf_greedy(model: PreTrainedModel, prompt: list[int], new: int) -> list[int]:
    """The `new` tokens Hugging Face `generate` picks greedily after `prompt`."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


async def equals(value: Awaitable[float], expected: float) -> bool:
    """Whether `value` resolves to `expected` (a condition for `wait_until`)."""
    return await value == expected
