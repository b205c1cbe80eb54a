"""Prefill/decode disaggregation and KV-aware routing across real worker processes.

One deployment for the module (Redis registry under a private namespace): two `prefill`
workers (balanced `kv_aware`), one `decode` worker and one `single` worker, all loading the
same exported tiny-llama checkpoint, which Hugging Face `AutoModelForCausalLM` also loads as
the independent reference. The decode worker gets a prompt's KV only by pulling it from the
prefill worker that computed it. Every wait is on a condition (run results, registry
heartbeats, index entries) with a deadline; the module stops every process it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.compute.models import export_model
from engine.compute.models.role_tokenizers import RoleTokenizers
from engine.data.kv.index import RedisKVIndex
from engine.flow.dsl import Workflow
from engine.flow.kvroute import KV_META_KEY, KVRouter, kv_index_namespace, prompt_pages
from engine.flow.remote import RemoteNodeError, WorkerDispatcher
from engine.spec.calls import NodeCall, NodeContext
from engine.spec.graph import GraphSpec
from tests.integration import deployments
from tests.integration.deployments import deployed, equals, hf_greedy, text_ids
from tests.integration.workerfns import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.asyncio(loop_scope="module")]

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
HB = 0.2
PAGE = 4
NEW = 12
PULL_TIMEOUT_S = 1.5
"""The decode role's `kv_pull_timeout_s`: how long a pull from a dead prefill worker may take."""


def pd_spec(checkpoint: Path) -> GraphSpec:
    """A token prompt through prefill -> decode and, beside it, through one `llm` node."""
    wf = Workflow("pd")
    params = {"page_size": PAGE}
    prefill = wf.role("prefill", kind="llm", model=str(checkpoint), replicas=2, balance="kv_aware", params=params)
    decode = wf.role("decode", kind="llm", model=str(checkpoint), balance="kv_aware",
                     params={**params, "kv_pull_timeout_s": PULL_TIMEOUT_S})
    single = wf.role("single", kind="llm", model=str(checkpoint), params=params)
    tokens = wf.input("prompt", "tokens")
    pre = wf.node("pre", "llm.prefill", role=prefill, params={"max_new_tokens": NEW})
    dec = wf.node("dec", "llm.decode", role=decode)
    one = wf.node("one", "llm", role=single, params={"max_new_tokens": NEW})
    wf.edge(tokens, pre.inp("tokens"))
    wf.edge(tokens, one.inp("tokens"))
    wf.edge(pre, dec)
    wf.output("pd", dec.out("tokens"), "tokens")
    wf.output("pd_kv", dec.out("kv"), "kv")
    wf.output("handoff", pre, "kv")
    wf.output("single", one.out("tokens"), "tokens")
    return wf.to_spec()


@dataclass
class Deployment(deployments.Deployment):
    """The deployment with the KV index its workers publish to."""

    index: RedisKVIndex

    def worker_ids(self, role: str) -> list[str]:
        return sorted(w.worker_id for w in self.cluster.workers if w.role == role)

    async def metric(self, worker_id: str, name: str) -> float:
        for snapshot in await self.cluster.registry.workers():
            if snapshot.info.worker_id == worker_id:
                return snapshot.load.metrics.get(name, -1.0)
        return -1.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return export_model("tiny-llama", tmp_path_factory.mktemp("pd") / "tiny-llama")


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment(checkpoint: Path) -> AsyncIterator[Deployment]:
    namespace = f"pdtest-{uuid.uuid4().hex[:10]}"
    index = RedisKVIndex.from_url(REDIS_URL, namespace=kv_index_namespace(namespace))
    try:
        async with deployed(pd_spec(checkpoint), heartbeat_s=HB, registry_url=REDIS_URL,
                            namespace=namespace) as base:
            yield Deployment(**vars(base), index=index)
    finally:
        with contextlib.suppress(Exception):
            index.clear()
        index.client.close()


async def test_workers_describe_their_kv_pages_in_the_registry(deployment: Deployment):
    snapshots = await deployment.cluster.registry.workers("decode")
    meta = snapshots[0].info.meta[KV_META_KEY]
    assert meta["page_size"] == PAGE and meta["model_id"].startswith("checkpoint:")
    assert meta["index"] == deployment.index.namespace


async def test_disaggregated_tokens_equal_hf_generate_and_one_worker(deployment: Deployment, reference):
    decode_id = deployment.worker_ids("decode")[0]
    before = await deployment.metric(decode_id, "kv.pull.pages")
    prompts = [text_ids(1, 3), text_ids(2, 16), text_ids(3, 37)]
    runs = [await deployment.executor.submit(deployment.spec, {"prompt": p}) for p in prompts]
    results = await asyncio.wait_for(asyncio.gather(*(run.wait() for run in runs)), 60.0)
    pulled = 0
    for prompt, result in zip(prompts, results, strict=True):
        assert result.status == "done", result.error
        expected = hf_greedy(reference, prompt, NEW)
        assert result.outputs["pd"] == result.outputs["single"] == expected
        handoff, kv = result.outputs["handoff"], result.outputs["pd_kv"]
        assert handoff.holder.worker_id in deployment.worker_ids("prefill")
        assert kv.holder.worker_id == decode_id and kv.pulled_from == handoff.holder
        assert len(handoff.page_hashes) == len(prompt) // PAGE
        assert kv.pulled_pages == len(prompt) // PAGE  # exactly the prompt's pages, nothing else
        assert kv.page_hashes[: len(prompt) // PAGE] == handoff.page_hashes
        pulled += kv.pulled_pages
    # The decode worker's own counters say the same, and every prefill worker let go of its holds.
    await wait_until(lambda: equals(deployment.metric(decode_id, "kv.pull.pages"), before + pulled), 10.0,
                     "the decode worker's pull count in its heartbeat")
    for prefill_id in deployment.worker_ids("prefill"):
        await wait_until(lambda w=prefill_id: equals(deployment.metric(w, "kv.device.locked_pages"), 0.0), 10.0,
                         f"prefill worker {prefill_id} to release its handoffs")


async def test_kv_aware_routing_sends_a_shared_prefix_to_the_worker_holding_it(deployment: Deployment):
    first_id, second_id = deployment.worker_ids("prefill")
    # Keep the first prefill worker busy: a call whose streamed prompt is still arriving.
    gate, started = asyncio.Event(), asyncio.Event()

    async def slow_prompt() -> AsyncIterator[list[int]]:
        await gate.wait()
        yield text_ids(9, 6)

    blocker = asyncio.create_task(deployment.execute("prefill", {"tokens": slow_prompt()}, ("kv",),
                                                     started=started))
    await asyncio.wait_for(started.wait(), 10.0)
    shared = text_ids(10, 16)  # four pages
    first = await deployment.execute("prefill", {"tokens": shared + text_ids(11, 5)}, ("kv",))
    assert first["kv"].holder.worker_id == second_id  # the idle one: nobody holds the prefix yet
    gate.set()
    assert (await asyncio.wait_for(blocker, 10.0))["kv"].holder.worker_id == first_id
    kv_meta = (await deployment.cluster.registry.workers("prefill"))[0].info.meta[KV_META_KEY]
    again = NodeCall("r", "y", None, {}, {"tokens": shared + text_ids(12, 7)}, ("kv",), False, False, 1, 1)
    pages = prompt_pages(deployment.spec.role("prefill"), again, kv_meta)
    await wait_until(lambda: deployment.index.lookup(pages).get(second_id) == 4, 10.0,
                     "the index to show the prefix on the worker that computed it")
    # Both idle now: load would pick the first worker, the cached prefix picks the second.
    second = await deployment.execute("prefill", again.inputs, ("kv",))
    assert second["kv"].holder.worker_id == second_id and second["kv"].cached_tokens == 16
    fresh = await deployment.execute("prefill", {"tokens": text_ids(13, 21)}, ("kv",))
    assert fresh["kv"].holder.worker_id == first_id and fresh["kv"].cached_tokens == 0
    # Decoding both: the second handoff shares four pages with the first, so only its fifth moves.
    for handoff, moved in ((first["kv"], 5), (second["kv"], 1)):
        out = await deployment.execute("decode", {"kv": handoff}, ("kv",))
        assert out["kv"].pulled_pages == moved


async def idle(deployment: Deployment, role: str) -> bool:
    return all(s.load.outstanding == 0 for s in await deployment.cluster.registry.workers(role))


async def test_kv_aware_routing_sends_a_text_prompt_to_the_worker_holding_its_prefix(deployment: Deployment):
    """What the studio's dispatchers do (`engine.client.plane.WorkerPlane`): a `kv_aware` role's
    text prompts are tokenized with the role's own tokenizer, so they route by their cached pages
    too (without a tokenizer a text prompt has no page keys and load alone decides: the first
    worker)."""
    first_id, second_id = deployment.worker_ids("prefill")
    # A new dispatcher knows other dispatchers' calls only from the workers' heartbeats: wait
    # until those say the earlier tests' calls ended, or a stale count ties the two workers.
    await wait_until(lambda: idle(deployment, "prefill"), 10.0, "the prefill workers' heartbeats to report them idle")
    router = KVRouter.for_registry(deployment.cluster.registry, tokenizer=RoleTokenizers())
    dispatcher = WorkerDispatcher(deployment.cluster.registry, deployment.peer, heartbeat_s=HB,
                                  connect_timeout_s=5.0, kv_router=router)
    role = deployment.spec.role("prefill")

    async def execute(inputs: dict, started: asyncio.Event | None = None) -> dict:
        call = NodeCall(f"r{uuid.uuid4().hex[:8]}", "pre", None, {}, inputs, ("kv",), False, False, 1, 1)
        ctx = NodeContext(call.run_id, "pre", 1, 1, lambda f, m: None)
        result = await dispatcher.execute(role, call, ctx, (lambda ran_on: started.set()) if started is not None else (lambda ran_on: None))
        return result.outputs

    shared = "You are a helpful assistant. Answer briefly. "  # 44 bytes: eleven pages
    # The first worker busy with a streamed prompt: the prefix is computed on the second.
    gate, started = asyncio.Event(), asyncio.Event()

    async def slow_prompt() -> AsyncIterator[list[int]]:
        await gate.wait()
        yield text_ids(40, 6)

    blocker = asyncio.create_task(execute({"tokens": slow_prompt()}, started))
    try:
        await asyncio.wait_for(started.wait(), 10.0)
        first = await execute({"prompt": shared + "What is 2 + 2?"})
        assert first["kv"].holder.worker_id == second_id
        gate.set()
        assert (await asyncio.wait_for(blocker, 10.0))["kv"].holder.worker_id == first_id
        held = first["kv"].page_hashes[:11]
        await wait_until(lambda: deployment.index.lookup(held).get(second_id) == 11, 10.0,
                         "the index to show the shared prefix on the second worker")
        # Both idle: load alone would pick the first worker; the text's cached pages pick the second.
        again = await execute({"prompt": shared + "Name a colour."})
        assert again["kv"].holder.worker_id == second_id and again["kv"].cached_tokens == 44
    finally:
        gate.set()
        await asyncio.gather(blocker, return_exceptions=True)
        await dispatcher.close()


async def test_prefix_matching_pulls_pages_another_worker_computed_through_the_index(deployment: Deployment):
    single_id, prefill_id = deployment.worker_ids("single")[0], deployment.worker_ids("prefill")[0]
    prompt = text_ids(30, 21)
    computed = await deployment.execute("single", {"tokens": prompt}, ("text", "tokens", "kv"),
                                        {"max_new_tokens": 2})
    assert computed["kv"].holder.worker_id == single_id
    pages = computed["kv"].page_hashes[:5]
    await wait_until(lambda: deployment.index.lookup(pages).get(single_id) == 5, 10.0,
                     "the index to show the prompt's pages on the single worker")
    before = await deployment.metric(prefill_id, "kv.pull.pages")

    async def streamed() -> AsyncIterator[list[int]]:  # a streamed prompt has no routing keys: load decides
        yield prompt + text_ids(31, 3)

    out = await deployment.execute("prefill", {"tokens": streamed()}, ("kv",))
    assert out["kv"].holder.worker_id == prefill_id and out["kv"].cached_tokens == 20  # pulled, not computed
    await wait_until(lambda: equals(deployment.metric(prefill_id, "kv.pull.pages"), before + 5), 10.0,
                     "the prefill worker's pull count in its heartbeat")


async def test_a_killed_prefill_worker_fails_the_decode_within_its_pull_timeout(deployment: Deployment):
    """Runs last: it kills one of the module's prefill workers."""
    handoff = (await deployment.execute("prefill", {"tokens": text_ids(20, 10)}, ("kv",)))["kv"]
    holder = next(w for w in deployment.cluster.workers if w.worker_id == handoff.holder.worker_id)
    holder.process.send_signal(signal.SIGKILL)
    await asyncio.wait_for(holder.process.wait(), 10.0)
    started = time.monotonic()
    with pytest.raises(RemoteNodeError) as err:
        await asyncio.wait_for(deployment.execute("decode", {"kv": handoff}, ("tokens",)), 3 * PULL_TIMEOUT_S + 5)
    elapsed = time.monotonic() - started
    assert f"cannot pull the prompt's KV from prefill worker {handoff.holder.worker_id}" in str(err.value)
    assert PULL_TIMEOUT_S * 0.5 < elapsed < PULL_TIMEOUT_S + 3.0, elapsed
