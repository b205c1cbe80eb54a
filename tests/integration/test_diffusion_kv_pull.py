"""`workflows/image_generation.py` on real worker processes: the diffusion worker pulls the prompt's
KV pages from the llm worker that computed them instead of recomputing them.

The llm and diffusion roles run in separate processes (no shared KV store, no Redis index: the
only way to the pages is the `kv` edge's holder address). The diffusion worker's own metrics
say how many pages and bytes it pulled and how many prompt tokens it computed; its latents are
checked against an independent reference: the same context (the llm node's prompt tokenized here,
then its output) denoised in this process with the prompt recomputed, together with the image
tokens, at every step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch
import zmq
import zmq.asyncio

from engine.compute.diffusion import DiffusionConfig, DiffusionRunner, Prompt
from engine.compute.models.loader import load_builtin
from engine.compute.models.tokenizer import BOS_ID
from engine.data.codec import WireCodec
from engine.data.curve import PlaneKeys, connect_as_client
from engine.data.peer import Peer, PeerConfig
from engine.data.wire import LoadReply, LoadRequest, TensorRef, WorkerMessage
from engine.flow.executor import Executor
from engine.flow.remote import WorkerDispatcher
from engine.spec.calls import NodeCall, NodeContext, NodeResult, RanOn
from engine.spec.graph import RoleSpec
from engine.spec.kinds import default_kinds
from engine.worker.launcher import LaunchedWorker, LocalCluster
from tests.examples import example

HB = 0.2


class Recording:
    """A dispatcher that keeps every node's inputs and outputs."""

    def __init__(self, inner: WorkerDispatcher) -> None:
        self.inner = inner
        self.inputs: dict[str, dict[str, Any]] = {}
        self.outputs: dict[str, dict[str, Any]] = {}

    async def execute(self, role: RoleSpec, call: NodeCall, ctx: NodeContext,
                      started: Callable[[RanOn], None]) -> NodeResult:
        self.inputs[call.node_id] = dict(call.inputs)
        result = await self.inner.execute(role, call, ctx, started)
        self.outputs[call.node_id] = dict(result.outputs)
        return result

    def execute_stream(self, role: RoleSpec, call: NodeCall, ctx: NodeContext, started: Callable[[RanOn], None]):
        return self.inner.execute_stream(role, call, ctx, started)

    async def close(self) -> None:
        await self.inner.close()


async def worker_metrics(worker: LaunchedWorker, keys: PlaneKeys | None) -> dict[str, float]:
    """What the worker reports on its liveness endpoint (a `LoadRequest`, 5 s deadline), asked
    with the plane's `keys`."""
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    connect_as_client(sock, keys)
    codec = WireCodec(1 << 20, WorkerMessage)
    try:
        sock.connect(worker.details["liveness"])
        await sock.send(codec.encode(LoadRequest(1)))
        reply = codec.decode(await asyncio.wait_for(sock.recv(), 5.0))
        assert isinstance(reply, LoadReply), reply
        return dict(reply.metrics)
    finally:
        sock.close()
        context.term()


async def test_the_diffusion_worker_pulls_the_llm_workers_prompt_pages_and_matches_recomputation():
    spec = example("image_generation", tiny=True)
    diffusion_role = spec.role("diffusion")
    cluster = LocalCluster(spec, allow_module_ops=True, heartbeat_s=HB, stop_timeout_s=10.0, extra_args=("--drain-timeout", "5"))
    peer = Peer.start(PeerConfig(keys=cluster.keys))
    try:
        await cluster.start()
        workers = {w.role: w for w in cluster.workers}
        assert workers["llm"].pid != workers["diffusion"].pid
        assert workers["llm"].details["data"] != workers["diffusion"].details["data"]
        recording = Recording(WorkerDispatcher(cluster.registry, peer, heartbeat_s=HB, connect_timeout_s=5.0))
        executor = Executor(recording, default_kinds())
        try:
            run = await executor.submit(spec, {})
            result = await asyncio.wait_for(run.wait(), 60)
            assert result.status == "done", result.error
            denoise_in = recording.inputs["denoise"]
            rewrite_in, rewrite_out = recording.inputs["rewrite"], recording.outputs["rewrite"]
            latents_ref = recording.outputs["denoise"]["latents"]
            assert isinstance(latents_ref, TensorRef)
            latents = peer.pull(latents_ref, timeout=10.0).torch(copy=True)
        finally:
            await executor.aclose()
        metrics = await worker_metrics(workers["diffusion"], cluster.keys)
        llm_metrics = await worker_metrics(workers["llm"], cluster.keys)
    finally:
        await cluster.stop()
        peer.close()

    kv = denoise_in["kv"]
    assert "tokens" not in denoise_in and "prompt" not in denoise_in  # the context comes with the kv
    model = load_builtin(diffusion_role.model)
    tokens = list(model.tokenizer(rewrite_in["prompt"]).input_ids) + list(rewrite_out["tokens"])
    assert [*kv.prompt_ids, *kv.output_ids] == tokens
    page = diffusion_role.params["page_size"]
    assert kv.holder.address == workers["llm"].details["data"]
    # The llm worker holds the full pages of its context but the last token's (it sampled that
    # token, never ran it): the diffusion worker pulls all of those and computes only the rest
    # of the context and the one-token negative prompt (BOS).
    held = min(len(tokens) // page, len(kv.page_hashes))
    assert held >= 2 and len(kv.page_hashes) >= (len(tokens) - 1) // page
    layout = kv.layout
    page_nbytes = 2 * layout["num_layers"] * page * layout["num_kv_heads"] * layout["head_dim"] * 4
    assert metrics["kv.pull.pages"] == held
    assert metrics["kv.pull.bytes"] == held * page_nbytes
    assert metrics["kv.pull.failures"] == 0
    assert metrics["diffusion.prompt_tokens_reused"] == held * page
    assert metrics["diffusion.prompt_tokens_computed"] == len(tokens) - held * page + 1
    assert metrics["diffusion.images"] == 1
    assert llm_metrics["kv.pull.pages"] == 0

    # The independent reference: the prompt recomputed with the image tokens at every step.
    params = diffusion_role.params
    runner = DiffusionRunner(model, DiffusionConfig(page_size=page, steps=params["steps"]))
    expected = runner.denoise_recompute([Prompt.of(tokens), Prompt.of([BOS_ID])], seed=0)[0]
    assert latents.shape == expected.shape
    assert (latents - expected).abs().max().item() <= 1e-5
    assert expected.abs().max().item() > 0.1  # not a degenerate all-zero image
    assert torch.isfinite(latents).all()
