"""A `diffusion` role with `tp_size = 2` on real worker processes (`LocalCluster`, gloo on the CPU).

Role `one` (tiny-llama's transformer, TP-1) and role `two` (the same, TP-2: two rank processes,
rank 0 the one endpoint) denoise the same prompts: float32 latents agree within 1e-5, and both
equal an independent reference denoised in this process. Given the `kv` of an `llm` role (`lm`)
that computed the prompt, both reuse its pages, pulled across roles (TP-2: each rank keeps its
heads), with the same latents; given only that `kv`, both attend to its context by its own page
keys. A bad input fails its node and leaves the group intact; a killed follower rank fails the
next node with a clear error, and rank 0 then stops itself. The killed-rank test runs last; every
process the module starts is stopped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch
from msgspec.structs import replace

from engine.compute.diffusion import DiffusionConfig, DiffusionRunner, Prompt
from engine.compute.models.loader import load_builtin
from engine.compute.models.tokenizer import BOS_ID
from engine.data.kv.ref import KVHolder, KVRef
from engine.data.wire import TensorRef
from engine.flow.dsl import Workflow
from engine.flow.remote import RemoteNodeError, WorkerLost
from engine.spec.graph import GraphSpec
from tests.integration.deployments import Deployment, deployed
from tests.integration.workerfns import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny-llama"  # 4 query heads over 2 KV heads: one KV head per rank at TP-2
HB = 0.25
TP_TIMEOUT_S = 3.0
PARAMS = {"page_size": 4, "latent_size": 8, "steps": 3, "guidance_scale": 3.0}
"""The diffusion roles' params (also `DiffusionConfig` fields: the in-process reference's)."""


def spec() -> GraphSpec:
    wf = Workflow("tp-diffusion")
    wf.role("one", kind="diffusion", model=MODEL, params=PARAMS)
    wf.role("two", kind="diffusion", model=MODEL, tp_size=2, params={**PARAMS, "tp_timeout_s": TP_TIMEOUT_S})
    wf.role("lm", kind="llm", model=MODEL, params={"page_size": PARAMS["page_size"]})
    return wf.to_spec()


async def latents(deployment: Deployment, role: str, inputs: dict[str, Any],
                  params: dict[str, Any]) -> torch.Tensor:
    """One diffusion node's latents on `role`, pulled into this process."""
    ref = (await deployment.execute(role, inputs, ("latents",), params))["latents"]
    assert isinstance(ref, TensorRef)
    return deployment.peer.pull(ref, timeout=10.0).torch(copy=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment() -> AsyncIterator[Deployment]:
    async with deployed(spec(), heartbeat_s=HB, with_executor=False, check_processes_stop=True,
                        ready_timeout_s=120.0) as deployment:
        yield deployment


def reference(prompt: str | list[int], negative: str, seed: int, steps: int) -> torch.Tensor:
    """The same denoising in this process, on the whole model, with the prompts recomputed at every step."""
    loaded = load_builtin(MODEL)
    runner = DiffusionRunner(loaded, DiffusionConfig(**PARAMS))
    ids = [list(text) if isinstance(text, list) else list(loaded.tokenizer(text).input_ids) or [BOS_ID]
           for text in (prompt, negative)]
    return runner.denoise_recompute([Prompt.of(i) for i in ids], seed=seed, steps=steps)[0]


async def reused_tokens(deployment: Deployment, role: str) -> float:
    """The role's `diffusion.prompt_tokens_reused`, as its last load report gave it."""
    (snapshot,) = await deployment.cluster.registry.workers(role)
    return snapshot.load.metrics.get("diffusion.prompt_tokens_reused", 0.0)


async def test_a_tp2_diffusion_replica_is_two_rank_processes(deployment: Deployment):
    two = deployment.replica("two")
    assert [r.tp_rank for r in two.processes] == [0, 1]
    assert two.ranks[0].details["leader_pid"] == two.pid
    registered = await deployment.cluster.registry.workers("two")
    assert [s.info.worker_id for s in registered] == [two.worker_id]


@pytest.mark.parametrize(("prompt", "negative", "seed", "steps"), [
    ("a lighthouse on a cliff at dusk, oil on canvas", "blurry, low quality", 7, 3),
    ("cat", "", 0, 2),
])
async def test_tp2_latents_equal_tp1_within_1e_5(deployment: Deployment, prompt, negative, seed, steps):
    inputs = {"prompt": prompt, "negative_prompt": negative}
    params = {"seed": seed, "steps": steps}
    one = await latents(deployment, "one", inputs, params)
    two = await latents(deployment, "two", inputs, params)
    assert one.dtype == two.dtype == torch.float32 and one.shape == two.shape == (4, 8, 8)
    assert (one - two).abs().max().item() <= 1e-5
    assert (two - reference(prompt, negative, seed, steps)).abs().max().item() <= 1e-5


async def test_tp2_diffusion_reuses_the_prompt_kv_an_llm_role_computed(deployment: Deployment):
    tokens = list(load_builtin(MODEL).tokenizer("a red fox asleep in fresh snow under a pale winter moon").input_ids)
    pages = len(tokens) // PARAMS["page_size"]
    assert pages >= 3
    kv = (await deployment.execute("lm", {"tokens": tokens}, ("kv",), {"max_new_tokens": 1}))["kv"]
    assert kv.holder is not None and kv.holder.address, kv
    inputs = {"tokens": tokens, "negative_prompt": "blurry", "kv": kv}
    params = {"seed": 3, "steps": 2}
    before = {role: await reused_tokens(deployment, role) for role in ("one", "two")}
    one = await latents(deployment, "one", inputs, params)
    two = await latents(deployment, "two", inputs, params)
    assert (one - two).abs().max().item() <= 1e-5
    assert (two - reference(tokens, "blurry", 3, 2)).abs().max().item() <= 1e-5
    # Both reused every full page of the prompt (pulled from `lm`) instead of computing it (and
    # TP-1 perhaps a page of the negative prompt that it computed for an earlier node and kept).
    for role in ("one", "two"):
        async def reused(role: str = role) -> bool:
            return await reused_tokens(deployment, role) >= before[role] + pages * PARAMS["page_size"]

        await wait_until(reused, 10.0, f"role {role!r} reporting the reused prompt tokens")


async def test_tp2_diffusion_reads_the_kvs_context_by_the_kvs_own_page_keys(deployment: Deployment):
    """Without a prompt input the context is the `kv`'s (the llm's prompt and output ids) and its
    pages are named by the `kv`'s own keys, checked once on rank 0: both roles reuse them and agree
    with the reference. A `kv` whose keys are not its context's is refused, the group intact."""
    tokens = list(load_builtin(MODEL).tokenizer("a heron standing still in a misty river at dawn").input_ids)
    kv = (await deployment.execute("lm", {"tokens": tokens}, ("kv",), {"max_new_tokens": 3}))["kv"]
    context = [*kv.prompt_ids, *kv.output_ids]
    assert context[:len(tokens)] == tokens and len(kv.page_hashes) == (len(context) - 1) // PARAMS["page_size"] >= 3
    inputs = {"negative_prompt": "blurry", "kv": kv}
    params = {"seed": 5, "steps": 2}
    before = await reused_tokens(deployment, "two")
    one = await latents(deployment, "one", inputs, params)
    two = await latents(deployment, "two", inputs, params)
    assert (one - two).abs().max().item() <= 1e-5
    assert (two - reference(context, "blurry", 5, 2)).abs().max().item() <= 1e-5

    async def reused() -> bool:
        return await reused_tokens(deployment, "two") >= before + len(kv.page_hashes) * PARAMS["page_size"]

    await wait_until(reused, 10.0, "role 'two' reporting the reused context tokens")
    altered = replace(kv, page_hashes=(kv.page_hashes[1], *kv.page_hashes[1:]))
    for role in ("one", "two"):
        with pytest.raises(RemoteNodeError, match=r"input 'kv': page_hashes\[0\] is not the key of page 0"):
            await latents(deployment, role, {"kv": altered}, params)
    assert torch.equal(await latents(deployment, "two", inputs, params), two)


async def test_a_bad_input_fails_its_node_and_leaves_the_group_intact(deployment: Deployment):
    with pytest.raises(RemoteNodeError, match="KV of model 'm', this role runs"):
        await latents(deployment, "two", {"prompt": "x", "kv": KVRef(model_id="m", page_size=PARAMS["page_size"])}, {})
    kv = (await deployment.execute("lm", {"tokens": [40, 41, 42, 43, 44]}, ("kv",), {"max_new_tokens": 1}))["kv"]
    with pytest.raises(RemoteNodeError, match="input 'kv' names no holder"):
        await latents(deployment, "two", {"tokens": [40, 41, 42, 43, 44], "kv": replace(kv, holder=None)}, {})
    with pytest.raises(RemoteNodeError, match="holder 'garbage' is not a worker's data address"):
        await latents(deployment, "two", {"tokens": [40, 41, 42, 43, 44], "kv": replace(kv, holder=KVHolder("garbage"))}, {})
    # A holder that is gone: every rank's pull fails alike, within the role's pull timeout (half
    # its tp_timeout_s), and the group goes on.
    with pytest.raises(RemoteNodeError, match="pulling the prompt's KV from tcp://127.0.0.1:9 failed"):
        await latents(deployment, "two", {"tokens": [40, 41, 42, 43, 44], "kv": replace(kv, holder=KVHolder("tcp://127.0.0.1:9"))},
                      {"steps": 1})
    with pytest.raises(RemoteNodeError, match="exactly one of the inputs"):
        await latents(deployment, "two", {"prompt": "x", "tokens": [5, 6]}, {})
    again = await latents(deployment, "two", {"tokens": [40, 41, 42, 43, 44]},
                          {"steps": 1, "guidance_scale": 1.0})
    assert torch.isfinite(again).all()


async def test_a_killed_follower_fails_the_node_then_rank_0_stops_itself(deployment: Deployment):
    two = deployment.replica("two")
    follower = two.processes[1].pid
    os.kill(follower, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RemoteNodeError, match="tensor-parallel group failed"):
        await latents(deployment, "two", {"prompt": "after the kill"}, {"steps": 2})
    assert time.monotonic() - started < TP_TIMEOUT_S + 10.0
    # Its unit reports the broken group: at its next heartbeat the worker stops itself (status 4:
    # it cannot go on serving), to be replaced by a supervising cluster, and later calls find no
    # worker of the role here.
    assert await asyncio.wait_for(two.process.wait(), 20.0) == 4
    with pytest.raises(WorkerLost, match="no live worker of role 'two'"):
        await latents(deployment, "two", {"prompt": "and again"}, {"steps": 2})
