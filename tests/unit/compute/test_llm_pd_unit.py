"""Prefill/decode disaggregation in the `llm` unit, in process: the node kinds, the handoff value,
the hold on the prefill side, the pull on the decode side, and the prompt keys a router computes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from engine.cli import main as cli_main
from engine.compute.kinds import register
from engine.compute.llm import EngineConfig, LLMEngine
from engine.compute.llm.unit import LLMUnit, LLMUnitError, NodeMode, node_mode
from engine.compute.models.role_tokenizers import RoleTokenizers
from engine.compute.sampling import SamplingParams
from engine.data.kv.ref import KVRef
from engine.flow.dispatch import InProcessDispatcher
from engine.flow.dsl import Workflow
from engine.flow.executor import Executor
from engine.flow.kvroute import prompt_pages
from engine.flow.loader import load_workflow
from engine.flow.plan import build_plan
from engine.flow.validate import GraphValidationError
from engine.spec.calls import NodeCall, NodeContext
from engine.spec.graph import RoleSpec
from engine.spec.kinds import default_kinds
from tests.examples import example_doc
from tests.unit.compute.conftest import prompt_ids

PAGE = 4


@pytest.fixture
def kinds():
    registry = default_kinds(load_entry_points=False)
    register(registry)
    return registry


@pytest.fixture
async def executor(kinds):
    ex = Executor(InProcessDispatcher(kinds), kinds)
    yield ex
    await ex.aclose()


def llm_role(name: str, **params) -> RoleSpec:
    return RoleSpec(name=name, kind="llm", model="tiny-llama", params={"page_size": PAGE, **params})


@pytest.fixture
async def make_unit() -> AsyncIterator:
    made: list[LLMUnit] = []

    def factory(name: str, **params) -> LLMUnit:
        unit = LLMUnit(llm_role(name, **params))
        made.append(unit)
        return unit

    yield factory
    for unit in made:
        await unit.close()


def call(node_id: str, inputs: dict, outputs: tuple[str, ...], params: dict | None = None,
         stream: bool = False, tenant: str | None = None) -> NodeCall:
    return NodeCall("run", node_id, None, params or {}, inputs, outputs, stream, False, 1, 1, tenant)


CTX = NodeContext("run", "n", 1, 1, lambda f, m: None)
DECODE_OUT = ("text", "tokens", "kv")


def pd_workflow(max_new: int = 10, stream: bool = False) -> Workflow:
    """The same prompt through prefill -> decode (two roles) and through one `llm` node."""
    wf = Workflow("pd")
    pre_role = wf.role("pre", kind="llm", model="tiny-llama", params={"page_size": PAGE})
    dec_role = wf.role("dec", kind="llm", model="tiny-llama", params={"page_size": PAGE})
    one_role = wf.role("one", kind="llm", model="tiny-llama", params={"page_size": PAGE})
    tokens = wf.input("prompt", "tokens")
    pre = wf.node("prefill", "llm.prefill", role=pre_role, params={"max_new_tokens": max_new})
    dec = wf.node("decode", "llm.decode", role=dec_role, stream=stream)
    one = wf.node("single", "llm", role=one_role, params={"max_new_tokens": max_new})
    wf.edge(tokens, pre.inp("tokens"))
    wf.edge(tokens, one.inp("tokens"))
    wf.edge(pre, dec)
    if stream:
        wf.output("pd_text", dec.out("text"), {"type": "text", "join": "ordered"})
    else:
        wf.output("pd_tokens", dec.out("tokens"), "tokens")
        wf.output("pd_text", dec.out("text"), "text")
        wf.output("pd_kv", dec.out("kv"), "kv")
        wf.output("handoff", pre, "kv")
    wf.output("tokens", one.out("tokens"), "tokens")
    wf.output("text", one.out("text"), "text")
    return wf


def reference(tiny_llama, prompt: list[int], max_new: int) -> list[int]:
    engine = LLMEngine(tiny_llama, EngineConfig(page_size=PAGE))
    try:
        return list(engine.generate([prompt], SamplingParams(max_new_tokens=max_new))[0].output_ids)
    finally:
        engine.close()


async def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
    return value


def locked(unit: LLMUnit) -> int:
    return int(unit.kv_store.metrics()["device.locked_pages"])


# --- kinds and DSL ----------------------------------------------------------------------------------


def test_prefill_and_decode_kinds_fix_their_ports_and_the_dsl_fills_them(kinds):
    prefill, decode = kinds.node_kind("llm.prefill"), kinds.node_kind("llm.decode")
    assert set(prefill.inputs) == {"prompt", "tokens"} and set(prefill.outputs) == {"kv"}
    assert set(decode.inputs) == {"kv"} and set(decode.outputs) == {"text", "tokens", "kv", "usage"}
    assert prefill.role_kinds == decode.role_kinds == ("llm",)
    spec = pd_workflow().to_spec()
    assert set(spec.node("decode").outputs) == {"text", "tokens", "kv", "usage"}
    build_plan(spec, kinds)
    wf = Workflow("bad", kinds=kinds)
    role = wf.role("llm", kind="llm", model="tiny-llama")
    pre = wf.node("pre", "llm.prefill", role=role, params={"session": "s"})  # sessions do not disaggregate
    dec = wf.node("dec", "llm.decode", role=role, params={"tenant": "t"})  # the handoff carries the tenant
    wf.edge(wf.input("p", "text"), pre.inp("prompt"))
    wf.edge(pre, dec)
    with pytest.raises(GraphValidationError) as err:
        build_plan(wf.to_spec(), kinds)
    assert [i.code for i in err.value.issues] == ["bad_param", "bad_param"]


def test_node_mode_follows_the_fixed_ports():
    assert node_mode(call("n", {"prompt": "x"}, ("text", "tokens", "kv"))) is NodeMode.GENERATE
    assert node_mode(call("n", {"tokens": [1]}, ("kv",))) is NodeMode.PREFILL
    assert node_mode(call("n", {"kv": {}}, DECODE_OUT)) is NodeMode.DECODE


# --- workflows ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [3, 8, 13])  # shorter than a page, page-aligned, pages + tail
async def test_prefill_decode_workflow_equals_one_llm_node(executor, tiny_llama, length):
    prompt = prompt_ids(60 + length, length)
    result = await (await executor.submit(pd_workflow().to_spec(), {"prompt": prompt})).wait()
    assert result.status == "done", result.error
    out = result.outputs
    assert out["pd_tokens"] == out["tokens"] == reference(tiny_llama, prompt, 10)
    assert out["pd_text"] == out["text"]
    handoff = out["handoff"]
    assert isinstance(handoff, KVRef) and handoff.hold is not None and len(handoff.page_hashes) == length // PAGE
    assert handoff.hold.tail_len == length % PAGE and handoff.hold.first_token == out["tokens"][0]
    kv = out["pd_kv"]
    assert kv.pulled_pages == length // PAGE and kv.prompt_tokens == length
    assert kv.page_hashes[: length // PAGE] == handoff.page_hashes


async def test_streaming_decode_yields_every_token(executor, tiny_llama):
    prompt = prompt_ids(70, 11)
    result = await (await executor.submit(pd_workflow(max_new=8, stream=True).to_spec(), {"prompt": prompt})).wait()
    assert result.status == "done", result.error
    assert len(result.outputs["pd_text"]) == 8
    assert "".join(result.outputs["pd_text"]) == result.outputs["text"]


# --- the hold and the pull -------------------------------------------------------------------------------


async def test_decode_pulls_exactly_the_prompt_pages_and_the_prefill_lets_go(make_unit, tiny_llama):
    prefill, decode = make_unit("pre"), make_unit("dec")
    prompt = prompt_ids(71, 23)
    value = (await prefill.execute(call("p", {"tokens": prompt}, ("kv",), {"max_new_tokens": 6}), CTX)).outputs["kv"]
    hold = value.handoff
    assert len(value.page_hashes) == 5 and hold.tail_len == 3 and hold.token is not None
    assert hold.sampling == {"max_new_tokens": 6}
    assert locked(prefill) == 5  # held for the decode side
    result = await decode.execute(call("d", {"kv": value}, DECODE_OUT), CTX)
    assert result.outputs["tokens"] == reference(tiny_llama, prompt, 6)
    assert result.outputs["kv"].pulled_pages == 5
    assert result.outputs["kv"].pulled_from == value.holder
    assert decode.kv_store.metrics()["pull.pages"] == 5
    assert decode.engine.stats.computed_prompt_tokens == 0
    await wait_for(lambda: locked(prefill) == 0, 5.0, "the prefill worker to let go of the pages")
    with pytest.raises(LLMUnitError, match="another llm.decode node took it"):
        await make_unit("dec2").execute(call("d", {"kv": value}, DECODE_OUT), CTX)
    # The same prompt again: the decode side already holds the pages and pulls none.
    again = (await prefill.execute(call("p", {"tokens": prompt}, ("kv",), {"max_new_tokens": 6}), CTX)).outputs["kv"]
    assert again.cached_tokens == 20
    second = await decode.execute(call("d", {"kv": again}, DECODE_OUT), CTX)
    assert second.outputs["kv"].pulled_pages == 0 and second.outputs["tokens"] == result.outputs["tokens"]


async def test_an_unclaimed_handoff_is_released_when_its_lease_ends(make_unit):
    prefill = make_unit("pre", handoff_lease_s=0.2)
    value = (await prefill.execute(call("p", {"tokens": prompt_ids(72, 17)}, ("kv",)), CTX)).outputs["kv"]
    assert locked(prefill) == 4
    await wait_for(lambda: locked(prefill) == 0, 5.0, "the lease to end the hold")
    decode = make_unit("dec")
    with pytest.raises(LLMUnitError, match="no longer holds this handoff"):
        await decode.execute(call("d", {"kv": value}, DECODE_OUT), CTX)  # the tail went with the hold


async def test_a_generation_that_ends_at_the_first_token_hands_nothing_off(make_unit, tiny_llama):
    prefill, decode = make_unit("pre"), make_unit("dec")
    prompt = prompt_ids(73, 9)
    value = (await prefill.execute(call("p", {"tokens": prompt}, ("kv",), {"max_new_tokens": 1}), CTX)).outputs["kv"]
    assert value.handoff.finish_reason == "length" and value.handoff.token is None and locked(prefill) == 0
    result = await decode.execute(call("d", {"kv": value}, DECODE_OUT), CTX)
    assert result.outputs["tokens"] == reference(tiny_llama, prompt, 1)
    assert result.outputs["kv"].pulled_pages == 0


async def test_decode_rejects_what_is_not_its_handoff(make_unit):
    decode = make_unit("dec")
    with pytest.raises(LLMUnitError, match="not a KV reference"):
        await decode.execute(call("d", {"kv": {"model_id": "x", "pages": []}}, DECODE_OUT), CTX)
    generated = (await decode.execute(call("g", {"tokens": prompt_ids(74, 9)}, ("tokens", "kv")), CTX)).outputs["kv"]
    with pytest.raises(LLMUnitError, match="not a prefill handoff"):  # an llm node's kv, not an llm.prefill's
        await decode.execute(call("d", {"kv": generated}, DECODE_OUT), CTX)
    prefill = make_unit("pre")
    value = (await prefill.execute(call("p", {"tokens": prompt_ids(74, 9)}, ("kv",)), CTX)).outputs["kv"]
    with pytest.raises(LLMUnitError, match="model"):
        await decode.execute(call("d", {"kv": msgspec.structs.replace(value, model_id="other")}, DECODE_OUT), CTX)
    with pytest.raises(LLMUnitError, match="model"):  # the same as JSON (a file, a stored run)
        await decode.execute(call("d", {"kv": {**value.to_json(), "model_id": "other"}}, DECODE_OUT), CTX)
    other_pages = make_unit("dec8", page_size=8)
    with pytest.raises(LLMUnitError, match="layout"):
        await other_pages.execute(call("d", {"kv": value}, DECODE_OUT), CTX)


async def test_decode_takes_only_its_own_tenants_handoff(make_unit, tiny_llama):
    """A handoff names pages keyed with its tenant: a decode call of another tenant's run (say one whose
    graph fed it a handoff it got hold of) is refused before a page is pulled; its own tenant's is served."""
    prefill, decode = make_unit("pre"), make_unit("dec")
    prompt = prompt_ids(75, 13)
    value = (await prefill.execute(call("p", {"tokens": prompt}, ("kv",), {"max_new_tokens": 4}, tenant="user:1"),
                                   CTX)).outputs["kv"]
    assert value.tenant_salt == "user:1"
    for thief in ("user:2", "user:10"):
        with pytest.raises(LLMUnitError, match="another tenant"):
            await decode.execute(call("d", {"kv": value}, DECODE_OUT, tenant=thief), CTX)
    for label in ("user:2", None):  # relabelled as the thief's own (or as no one's): its pages are still keyed for user:1
        with pytest.raises(LLMUnitError, match="another tenant"):
            relabelled = msgspec.structs.replace(value, tenant_salt=label)
            await decode.execute(call("d", {"kv": relabelled}, DECODE_OUT, tenant="user:2"), CTX)
    assert decode.kv_store.metrics()["pull.pages"] == 0
    result = await decode.execute(call("d", {"kv": value}, DECODE_OUT, tenant="user:1"), CTX)
    assert result.outputs["tokens"] == reference(tiny_llama, prompt, 4)
    ended = (await prefill.execute(call("p", {"tokens": prompt}, ("kv",), {"max_new_tokens": 1}, tenant="user:1"),
                                   CTX)).outputs["kv"]  # nothing to hand off: still the tenant's own
    assert (await decode.execute(call("d", {"kv": ended}, DECODE_OUT, tenant="user:1"), CTX)).outputs["tokens"] == (
        reference(tiny_llama, prompt, 1))


# --- what a router computes -------------------------------------------------------------------------------


async def test_router_prompt_keys_are_the_engines_page_keys(make_unit, tiny_llama):
    unit = make_unit("llm")
    role = llm_role("llm")
    prompt = "a prompt long enough for a few pages"
    ids = unit.engine.encode(prompt)
    assert RoleTokenizers()(role, prompt) == ids
    out = await unit.execute(call("g", {"prompt": prompt}, ("text", "tokens", "kv"), tenant="t1"), CTX)
    cached = out.outputs["kv"].page_hashes
    meta = unit.kv_meta()
    by_text = prompt_pages(role, call("g", {"prompt": prompt}, (), tenant="t1"), meta, RoleTokenizers())
    by_ids = prompt_pages(role, call("g", {"tokens": ids}, (), tenant="t1"), meta)
    assert by_text == by_ids == tuple(cached[: (len(ids) - 1) // PAGE])
    assert prompt_pages(role, call("g", {"tokens": ids}, ()), meta)[0] != by_ids[0]  # tenants never share
    assert prompt_pages(role, call("g", {"prompt": prompt}, ()), meta) == ()  # text needs a tokenizer
    assert prompt_pages(role, call("g", {"tokens": ids}, (), {"session": "s"}), meta) == ()


def test_a_model_whose_tokenizer_cannot_load_routes_its_text_on_load(tmp_path, caplog):
    """The router's tokenizer failing costs the hint (no page keys: load decides), never the call;
    the failure is said once in the log, not at every call."""
    tokenizers = RoleTokenizers()
    role = RoleSpec(name="llm", kind="llm", model=str(tmp_path / "no-such-checkpoint"))
    with caplog.at_level("WARNING", logger="engine.compute.models.role_tokenizers"):
        assert tokenizers(role, "a prompt") == []
        assert tokenizers(role, "another prompt") == []
    assert len([r for r in caplog.records if "falls back to load" in r.getMessage()]) == 1


async def test_one_role_can_prefill_and_decode_itself(executor, tiny_llama):
    """Both nodes on the same workers: the decode finds every page at home and pulls none."""
    wf = Workflow("pd_one_role")
    role = wf.role("llm", kind="llm", model="tiny-llama", params={"page_size": PAGE})
    tokens = wf.input("prompt", "tokens")
    pre = wf.node("prefill", "llm.prefill", role=role, params={"max_new_tokens": 7})
    dec = wf.node("decode", "llm.decode", role=role)
    wf.edge(tokens, pre.inp("tokens"))
    wf.edge(pre, dec)
    wf.output("tokens", dec.out("tokens"), "tokens")
    wf.output("kv", dec.out("kv"), "kv")
    prompt = prompt_ids(75, 14)
    result = await (await executor.submit(wf.to_spec(), {"prompt": prompt})).wait()
    assert result.status == "done", result.error
    assert result.outputs["tokens"] == reference(tiny_llama, prompt, 7)
    assert result.outputs["kv"].pulled_pages == 0


def test_pd_chat_example_runs_and_matches_one_llm(capsys, tiny_llama, tmp_path: Path):
    """The example's graph on the tiny model (the shipped one runs smollm2-135m: tests/integration)."""
    doc = example_doc("pd_chat", tiny=True)
    path = tmp_path / "pd_chat.json"
    path.write_text(json.dumps(doc))
    assert cli_main(["run", str(path), "--workers", "inproc", "--json", "-q"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "done"
    prompt = load_workflow(path).node("prompt").params["default"]
    engine = LLMEngine(tiny_llama, EngineConfig(page_size=16))
    try:
        expected = engine.generate([prompt], SamplingParams(max_new_tokens=32))[0]
    finally:
        engine.close()
    assert doc["outputs"]["tokens"] == list(expected.output_ids)
    assert doc["outputs"]["text"] == expected.text
