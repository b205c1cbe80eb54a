"""Prefix matching on a TP-2 `llm` role pulls the pages another worker holds, through the KV index.

In process, with the Redis KV index under a private namespace: a TP-1 `llm` unit of tiny-llama
(its transfer seat serving its pages and publishing them to the index, as a role worker's KV
hosting does) and a TP-2 `TPLLMUnit` (rank 0 here, its follower a child process, `LocalRanks`)
whose seat has the index. A prompt the TP-1 role served is a prefix hit on the TP-2 role: rank 0
pulls its pages whole, splits them by head (rank 0 stores the holder's bytes of its own head; the
follower gets its own in the next pass), and the tokens equal Hugging Face `generate` and the TP-1
role's. An index entry whose holder lacks the pages, or is dead, costs at most the pull timeout:
the prompt is computed, with the same tokens. Every process and socket the module starts, it stops.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
import torch
from transformers import PreTrainedModel

from engine.compute.context import TransferSeat, UnitContext
from engine.compute.llm.unit import LLMUnit
from engine.compute.models.loader import load_builtin
from engine.compute.tp.local import LocalRanks
from engine.compute.tp.unit import TPLLMUnit
from engine.data.kv.index import RedisKVIndex
from engine.data.kv.keys import PageHash
from engine.data.kv.tier import Tier
from engine.data.peer import Peer, PeerConfig
from engine.flow.kvroute import prompt_pages
from engine.spec.calls import NodeCall, NodeContext
from engine.spec.graph import RoleSpec
from engine.worker.kv import KVHosting
from tests.integration.deployments import hf_greedy, text_ids
from tests.integration.workerfns import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.asyncio(loop_scope="module")]

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL = "tiny-llama"  # 4 query heads over 2 KV heads: one KV head per rank at TP-2
PAGE = 4
NEW = 8
PULL_TIMEOUT_S = 1.0
"""The TP-2 role's `kv_pull_timeout_s`: how long a dead holder may hold up a prompt."""
HOLDER = "tp1-holder"
CTX = NodeContext("run", "n", 1, 1, lambda f, m: None)


@dataclass
class Role:
    unit: LLMUnit
    peer: Peer


@pytest.fixture(scope="module")
def index() -> Iterator[RedisKVIndex]:
    idx = RedisKVIndex.from_url(REDIS_URL, namespace=f"test-tp-prefix-{uuid.uuid4().hex[:12]}", timeout_s=2.0)
    try:
        yield idx
    finally:
        idx.clear()
        idx.client.close()


@pytest.fixture(scope="module")
def reference() -> PreTrainedModel:
    return load_builtin(MODEL).model


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def holder(index: RedisKVIndex) -> AsyncIterator[Role]:
    """A TP-1 role's unit whose pages the index names, served from its seat."""
    peer = Peer.start(PeerConfig())
    role = RoleSpec(name="one", kind="llm", model=MODEL, params={"page_size": PAGE})
    unit = LLMUnit(role, UnitContext(seat=TransferSeat(peer, HOLDER, index)))
    hosting = KVHosting.start(unit, peer, HOLDER, index=index, heartbeat_s=0.25, ttl_s=30.0)
    try:
        yield Role(unit, peer)
    finally:
        hosting.close()
        await unit.close()
        peer.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tp2(index: RedisKVIndex) -> AsyncIterator[Role]:
    params = {"page_size": PAGE, "tp_timeout_s": 5.0, "kv_pull_timeout_s": PULL_TIMEOUT_S}
    role = RoleSpec(name="two", kind="llm", model=MODEL, tp_size=2, params=params)
    peer = Peer.start(PeerConfig())
    try:
        with LocalRanks(role) as ranks:
            unit = TPLLMUnit(role, tp=ranks.seat, transfer=TransferSeat(peer, "tp2-rank0", index))
            try:
                yield Role(unit, peer)
            finally:
                await unit.close()
    finally:
        peer.close()


async def generate(unit: LLMUnit, prompt: list[int], node: str) -> dict[str, Any]:
    call = NodeCall("run", node, None, {"max_new_tokens": NEW, "ignore_eos": True}, {"tokens": prompt},
                    ("tokens", "usage", "kv"), False, False, 1, 1)
    return (await unit.execute(call, CTX)).outputs


def pulls(unit: LLMUnit) -> tuple[float, float, float]:
    """Pages the unit's engine took from peers, and its store's pulled pages and failed pulls."""
    store = unit.engine.store.metrics()
    return unit.metrics()["llm.pulled_pages"], store["pull.pages"], store["pull.failures"]


def prompt_keys(unit: LLMUnit, prompt: list[int]) -> list[PageHash]:
    """The page keys a router computes for `prompt` on `unit`'s role (all but the last token's page)."""
    call = NodeCall("run", "keys", None, {}, {"tokens": prompt}, ("tokens",), False, False, 1, 1)
    return [PageHash(p) for p in prompt_pages(unit.role, call, unit.kv_meta())]


async def test_a_tp2_prefix_miss_pulls_the_pages_a_tp1_role_computed(holder: Role, tp2: Role, index: RedisKVIndex,
                                                                      reference: PreTrainedModel) -> None:
    prompt = text_ids(1, 5 * PAGE + 2)
    expected = hf_greedy(reference, prompt, NEW)
    one = await generate(holder.unit, prompt, "one")
    assert one["tokens"] == expected
    pages = [PageHash(p) for p in one["kv"].page_hashes[:5]]
    assert pages == prompt_keys(tp2.unit, prompt)  # both roles key the prompt alike
    await wait_until(lambda: index.lookup(pages).get(HOLDER) == 5, 10.0,
                     "the index to show the prompt's pages on the TP-1 worker")
    pulled, stored, failed = pulls(tp2.unit)

    two = await generate(tp2.unit, prompt, "two")

    assert two["tokens"] == expected
    assert two["usage"]["cached_tokens"] == 5 * PAGE  # pulled, not computed
    assert pulls(tp2.unit) == (pulled + 5, stored + 5, failed)
    # Rank 0 holds its KV head of the holder's bytes (the follower's decoded the same tokens).
    heads = tp2.unit.engine.layout.num_kv_heads
    for page in pages:
        mine, whole = tp2.unit.engine.store.get(page, promote=False), holder.unit.engine.store.get(page, promote=False)
        assert mine is not None and whole is not None
        assert torch.equal(mine, whole[..., :heads, :])
    # The pulled pages are the TP-2 role's own now: the repeat is a local hit on every rank.
    again = await generate(tp2.unit, prompt, "again")
    assert again["tokens"] == expected and again["usage"]["cached_tokens"] == 5 * PAGE
    assert pulls(tp2.unit) == (pulled + 5, stored + 5, failed)


async def test_an_index_entry_whose_holder_lacks_the_pages_is_computed(holder: Role, tp2: Role, index: RedisKVIndex,
                                                                        reference: PreTrainedModel) -> None:
    """The index names the TP-1 worker for pages it does not hold (it evicted them, say): it
    answers with none, and the prompt is computed without a failure."""
    prompt = text_ids(2, 4 * PAGE + 1)
    keys = prompt_keys(tp2.unit, prompt)
    index.publish(HOLDER, dict.fromkeys(keys, Tier.DEVICE))
    assert index.lookup(keys).get(HOLDER) == 4
    before = pulls(tp2.unit)

    out = await generate(tp2.unit, prompt, "stale")

    assert out["tokens"] == hf_greedy(reference, prompt, NEW)
    assert out["usage"]["cached_tokens"] == 0
    assert pulls(tp2.unit) == before


async def test_a_dead_holder_costs_at_most_the_pull_timeout_then_the_prompt_is_computed(
        tp2: Role, index: RedisKVIndex, reference: PreTrainedModel) -> None:
    """The index names a live-looking worker whose transfer seat is gone: the pull fails within
    the role's `kv_pull_timeout_s`, counted, and the prompt is computed."""
    prompt = text_ids(3, 4 * PAGE + 3)
    keys = prompt_keys(tp2.unit, prompt)
    gone = Peer.start(PeerConfig())
    address = gone.address
    gone.close()
    index.register_worker("a-dead-worker", address, ttl_s=60.0)
    index.publish("a-dead-worker", dict.fromkeys(keys, Tier.DEVICE))
    pulled, stored, failed = pulls(tp2.unit)
    started = time.monotonic()

    out = await generate(tp2.unit, prompt, "dead")

    elapsed = time.monotonic() - started
    assert out["tokens"] == hf_greedy(reference, prompt, NEW)
    assert out["usage"]["cached_tokens"] == 0
    assert pulls(tp2.unit) == (pulled, stored, failed + 1)
    assert elapsed < PULL_TIMEOUT_S + 5.0, elapsed
