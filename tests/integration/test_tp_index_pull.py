"""A tensor-parallel `llm` worker pulls a prompt's prefix pages that another worker computed,
found through the KV index, as any `llm` worker does: rank 0 pulls them whole and lands them split
by head (each follower gets its own heads in the next pass), and the tokens are HF's. And the other
way: a TP-1 worker pulls the prefix a TP-2 group computed, which the group serves whole (rank 0
gathers every rank's heads) and publishes to the index as a TP-1 worker does; the bytes served are
a TP-1 engine's full recomputation (up to float summation order), the tokens HF's.

One deployment (Redis registry and KV index under a private namespace): a TP-1 role and a TP-2 role
of the same model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

import pytest
import pytest_asyncio
import torch
from transformers import PreTrainedModel

from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.models.loader import load_builtin
from engine.compute.sampling import SamplingParams
from engine.data.kv.index import RedisKVIndex
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.pull import fetch_pages
from engine.data.kv.ref import KVRef
from engine.data.kv.store import Capacity, KVStore, KVStoreConfig
from engine.flow.dsl import Workflow
from engine.flow.kvroute import kv_index_namespace
from engine.spec.graph import GraphSpec
from tests.integration.deployments import Deployment, deployed, hf_greedy, text_ids
from tests.integration.workerfns import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL = "tiny-llama"  # 2 KV heads: one a rank at TP-2
PAGE = 4
NEW = 8
HB = 0.25


def spec() -> GraphSpec:
    wf = Workflow("tp-index")
    one = wf.role("one", kind="llm", model=MODEL, params={"page_size": PAGE})
    two = wf.role("two", kind="llm", model=MODEL, tp_size=2, params={"page_size": PAGE, "tp_timeout_s": 3.0})
    tokens = wf.input("prompt", "tokens")
    for name, role in (("gen1", one), ("gen2", two)):
        node = wf.node(name, "llm", role=role, params={"max_new_tokens": NEW})
        wf.edge(tokens, node.inp("tokens"))
        wf.output(f"{name}_tokens", node.out("tokens"), "tokens")
    return wf.to_spec()


@dataclass
class Indexed:
    deployment: Deployment
    index: RedisKVIndex

    async def metric(self, role: str, name: str) -> float:
        worker = self.deployment.replica(role).worker_id
        for snapshot in await self.deployment.cluster.registry.workers(role):
            if snapshot.info.worker_id == worker:
                return snapshot.load.metrics.get(name, -1.0)
        return -1.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def indexed() -> AsyncIterator[Indexed]:
    namespace = f"tpindex-{uuid.uuid4().hex[:10]}"
    index = RedisKVIndex.from_url(REDIS_URL, namespace=kv_index_namespace(namespace))
    try:
        async with deployed(spec(), heartbeat_s=HB, registry_url=REDIS_URL, namespace=namespace,
                            check_processes_stop=True, ready_timeout_s=120.0) as deployment:
            yield Indexed(deployment, index)
    finally:
        with contextlib.suppress(Exception):
            index.clear()
        index.client.close()


@pytest.fixture(scope="module")
def reference() -> PreTrainedModel:
    return load_builtin(MODEL).model


async def at_least(value: Awaitable[float], least: float) -> bool:
    return await value >= least


async def test_a_tp2_worker_pulls_the_prefix_a_tp1_worker_computed(indexed: Indexed, reference) -> None:
    deployment = indexed.deployment
    prompt = text_ids(11, 6 * PAGE + 1)
    first = await deployment.execute("one", {"tokens": prompt}, ("tokens", "kv"), {"max_new_tokens": NEW})
    ref = first["kv"]
    # The prompt's full pages (the reply's follow them): all a prefix match can take.
    assert isinstance(ref, KVRef) and len(ref.page_hashes) >= 6
    pages = [PageHash(p) for p in ref.page_hashes[:6]]
    one = deployment.replica("one").worker_id

    async def published() -> bool:
        return (await asyncio.to_thread(indexed.index.lookup, pages)).get(one, 0) == len(pages)

    await wait_until(published, 10.0, "the TP-1 worker to publish the prompt's pages")
    before = await indexed.metric("two", "llm.pulled_pages")
    out = await deployment.execute("two", {"tokens": prompt}, ("tokens",), {"max_new_tokens": NEW})
    assert first["tokens"] == out["tokens"] == hf_greedy(reference, prompt, NEW)
    await wait_until(lambda: at_least(indexed.metric("two", "llm.pulled_pages"), before + len(pages)), 10.0,
                     "the TP-2 worker to report the pages it pulled")


async def test_a_tp1_worker_pulls_the_prefix_a_tp2_group_computed(indexed: Indexed, reference) -> None:
    deployment = indexed.deployment
    prompt = text_ids(21, 6 * PAGE + 1)
    first = await deployment.execute("two", {"tokens": prompt}, ("tokens", "kv"), {"max_new_tokens": NEW})
    ref = first["kv"]
    assert isinstance(ref, KVRef) and len(ref.page_hashes) >= 6 and ref.holder is not None
    whole = KVLayout(**ref.layout)
    assert whole.num_kv_heads == 2  # the whole model's pages, not rank 0's head
    pages = [PageHash(p) for p in ref.page_hashes[:6]]
    two = deployment.replica("two").worker_id

    async def published() -> bool:
        return (await asyncio.to_thread(indexed.index.lookup, pages)).get(two, 0) == len(pages)

    await wait_until(published, 10.0, "the TP-2 group to publish the prompt's pages")
    before = await indexed.metric("one", "llm.pulled_pages")
    out = await deployment.execute("one", {"tokens": prompt}, ("tokens", "kv"), {"max_new_tokens": NEW})
    assert first["tokens"] == out["tokens"] == hf_greedy(reference, prompt, NEW)
    await wait_until(lambda: at_least(indexed.metric("one", "llm.pulled_pages"), before + len(pages)), 10.0,
                     "the TP-1 worker to report the pages it pulled from the TP-2 group")

    def fetch(holder: str) -> torch.Tensor:
        """The pages as the worker at `holder` serves them to anyone."""
        store = KVStore(KVStoreConfig(layout=whole, device_capacity=Capacity(pages=len(pages)), device="cpu"))
        try:
            assert len(fetch_pages(store, deployment.peer, holder, pages, 10.0).pages) == len(pages)
            return torch.stack([store.get(p) for p in pages])
        finally:
            store.close()

    served = await asyncio.to_thread(fetch, ref.holder.address)  # the group's `kv` output names it
    assert out["kv"].holder is not None
    assert torch.equal(await asyncio.to_thread(fetch, out["kv"].holder.address), served)  # what the TP-1 one took
    engine = LLMEngine(load_builtin(MODEL), EngineConfig(page_size=PAGE))
    try:
        (local,) = engine.generate([prompt], SamplingParams(max_new_tokens=1))
        assert list(local.kv_pages[:6]) == pages
        expected = torch.stack([engine.store.get(p) for p in pages])
    finally:
        engine.close()
    # Up to float summation order: the group adds its ranks' partial sums (all_reduce) in another order.
    torch.testing.assert_close(served, expected, rtol=1e-5, atol=1e-5)
