"""KVRouter: the prompt page keys and per-worker cached runs that the kv_aware policy is given.

Pure flow-layer tests (fake index, hand-made snapshots). That the keys equal the engine's own
page keys is checked in `tests/unit/compute/test_llm_pd_unit.py`; routing across real workers
in `tests/integration/test_pd_workers.py`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import msgspec
import pytest

from engine.data.kv.errors import KVIndexError
from engine.data.kv.keys import ExtraKeys, PageHash, page_hashes
from engine.data.kv.ref import KVHold, KVRef
from engine.flow.balance import BalanceRequest, KVAware, candidates_from
from engine.flow.discovery import InProcessRegistry, RedisRegistry, WorkerInfo, WorkerLoad, WorkerSnapshot
from engine.flow.kvroute import KV_META_KEY, NO_HINT, KVRouter, PrefixHint, kv_index_namespace, prompt_pages
from engine.spec.calls import NodeCall
from engine.spec.graph import RoleSpec

ROLE = RoleSpec(name="llm", kind="llm", model="m", balance="kv_aware")
META = {"model_id": "model-a", "page_size": 4, "layout": "L", "prefix_cache": True}
IDS = list(range(10, 31))  # 21 tokens: 5 pages, the last token's page never counts


def call(inputs: dict, params: dict | None = None, tenant: str | None = None) -> NodeCall:
    return NodeCall("run", "gen", None, params or {}, inputs, ("text",), False, False, 1, 1, tenant)


def snapshot(worker_id: str, meta: dict | None = None, outstanding: int = 0) -> WorkerSnapshot:
    return WorkerSnapshot(WorkerInfo(worker_id, "llm", f"tcp://h:{worker_id}", capacity=4,
                                     meta={KV_META_KEY: META} if meta is None else meta),
                          WorkerLoad(outstanding=outstanding), 0.0)


class FakeIndex:
    def __init__(self, held: Mapping[str, Sequence[str]], fail: bool = False,
                 gate: threading.Event | None = None) -> None:
        self.held = held
        self.fail = fail
        self.gate = gate
        self.asked: list[tuple[str, ...]] = []

    def lookup(self, pages: Sequence[str]) -> dict[str, int]:
        self.asked.append(tuple(pages))
        if self.gate is not None:
            self.gate.wait(5.0)
        if self.fail:
            raise KVIndexError("redis is down")
        out = {}
        for worker, have in self.held.items():
            run = 0
            while run < len(pages) and pages[run] in have:
                run += 1
            if run:
                out[worker] = run
        return out


def keys(ids: Sequence[int], tenant: str | None = None) -> list[str]:
    return page_hashes(ids, 4, extra_keys=ExtraKeys(model_id="model-a", tenant_salt=tenant))


def test_prompt_pages_from_token_ids_are_the_seeded_chain_up_to_the_last_token():
    assert prompt_pages(ROLE, call({"tokens": IDS}), META) == tuple(keys(IDS)[:5])
    assert prompt_pages(ROLE, call({"tokens": IDS[:20]}), META) == tuple(keys(IDS)[:4])
    assert prompt_pages(ROLE, call({"tokens": IDS}, tenant="t"), META) == tuple(keys(IDS, "t")[:5])
    assert prompt_pages(ROLE, call({"tokens": IDS}), META, max_pages=2) == tuple(keys(IDS)[:2])
    assert prompt_pages(ROLE, call({"tokens": IDS[:4]}), META) == ()


def test_two_tenants_identical_prompts_have_different_keys_and_a_node_param_cannot_pick_one():
    a, b = (prompt_pages(ROLE, call({"tokens": IDS}, tenant=t), META) for t in ("user:1", "user:2"))
    assert len(a) == len(b) == 5 and not set(a) & set(b)
    assert a == tuple(keys(IDS, "user:1")[:5]) and b == tuple(keys(IDS, "user:2")[:5])
    # the call's tenant is the run's: a `tenant` param naming another user changes nothing
    assert prompt_pages(ROLE, call({"tokens": IDS}, {"tenant": "user:1"}, tenant="user:2"), META) == b
    assert prompt_pages(ROLE, call({"tokens": IDS}, {"tenant": "user:1"}), META) == tuple(keys(IDS)[:5])


async def test_two_tenants_are_routed_by_their_own_pages_only():
    """Tenant A's pages are cached on w1: A's repeat goes there, B's identical prompt sees no cached page anywhere."""
    held = {"w1": keys(IDS, "user:1")[:5]}
    router = KVRouter(FakeIndex(held))
    workers = [snapshot("w1"), snapshot("w2")]
    hint_a = await router.hint(ROLE, call({"tokens": IDS}, tenant="user:1"), workers)
    hint_b = await router.hint(ROLE, call({"tokens": IDS}, tenant="user:2"), workers)
    assert hint_a.cached == {"w1": 5}
    assert hint_b.cached == {} and len(hint_b.pages) == 5


def test_prompt_pages_from_a_handoff_text_and_the_cases_without_keys():
    generated = KVRef(model_id="m", page_size=4, page_hashes=(PageHash("p1"), PageHash("p2")))
    handoff = msgspec.structs.replace(generated, hold=KVHold(handoff_id="h", first_token=7))
    assert prompt_pages(ROLE, call({"kv": handoff}), None) == ("p1", "p2")
    assert prompt_pages(ROLE, call({"kv": generated}), None) == ()  # not a handoff: its pages are no prompt's
    text = "abcdefghijklmnopqrstu"
    assert prompt_pages(ROLE, call({"prompt": text}), META) == ()  # no tokenizer given
    seen = []

    def tokenizer(role: RoleSpec, prompt: str) -> list[int]:
        seen.append((role.name, prompt))
        return IDS

    assert prompt_pages(ROLE, call({"prompt": text}), META, tokenizer) == tuple(keys(IDS)[:5])
    assert seen == [("llm", text)]
    assert prompt_pages(ROLE, call({"tokens": IDS}, {"session": "s"}), META) == ()
    assert prompt_pages(ROLE, call({"tokens": IDS}), {**META, "prefix_cache": False}) == ()
    assert prompt_pages(ROLE, call({"tokens": IDS}), None) == ()  # workers that name no pages


async def test_hint_counts_the_leading_pages_each_worker_holds():
    pages = keys(IDS)[:5]
    index = FakeIndex({"w1": pages[:3], "w2": pages[1:]})
    router = KVRouter(index)
    hint = await router.hint(ROLE, call({"tokens": IDS}), [snapshot("w1"), snapshot("w2")])
    assert hint == PrefixHint(tuple(pages), {"w1": 3})
    # The policy then prefers the holder over a less loaded worker, until the load outweighs it.
    policy = KVAware(role="llm")
    request = BalanceRequest("r", prefix_pages=hint.pages)
    snaps = [snapshot("w1", outstanding=4), snapshot("w2")]
    assert policy.choose(request, candidates_from(snaps, cached=hint.cached)) == "w1"
    snaps = [snapshot("w1", outstanding=16), snapshot("w2")]
    assert policy.choose(request, candidates_from(snaps, cached=hint.cached)) == "w2"


async def test_meta_comes_from_any_worker_and_no_keys_means_no_lookup():
    index = FakeIndex({})
    router = KVRouter(index)
    hint = await router.hint(ROLE, call({"tokens": IDS}), [snapshot("w0", meta={}), snapshot("w1")])
    assert hint.pages and index.asked == [hint.pages]
    assert await router.hint(ROLE, call({"tokens": IDS}), [snapshot("w0", meta={})]) == NO_HINT
    assert len(index.asked) == 1


async def test_a_failing_or_slow_index_leaves_load_alone_to_decide():
    router = KVRouter(FakeIndex({}, fail=True))
    hint = await router.hint(ROLE, call({"tokens": IDS}), [snapshot("w1")])
    assert hint.pages and hint.cached == {}
    gate = threading.Event()
    slow = KVRouter(FakeIndex({"w1": keys(IDS)}, gate=gate), timeout_s=0.05)
    try:
        assert await slow.hint(ROLE, call({"tokens": IDS}), [snapshot("w1")]) == NO_HINT
    finally:
        gate.set()


def test_the_router_finds_the_index_of_a_redis_registry_only():
    assert KVRouter.for_registry(InProcessRegistry()).index is None
    registry = RedisRegistry("redis://127.0.0.1:1/0", namespace="ns")  # never connected
    router = KVRouter.for_registry(registry)
    assert router.index is not None and router.index.namespace == kv_index_namespace("ns") == "ns:kv"
    router.close()
    with pytest.raises(ValueError):
        KVRouter(None, timeout_s=0)
