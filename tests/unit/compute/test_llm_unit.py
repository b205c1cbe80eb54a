"""The `llm` kinds and compute unit, driven by the flow executor in process."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.compute.kinds import register
from engine.compute.llm import EngineConfig, LLMEngine
from engine.compute.llm.unit import LLMUnit, LLMUnitError
from engine.flow.dispatch import InProcessDispatcher
from engine.flow.dsl import Workflow
from engine.flow.events import NodeOutputEvent, NodeProgressEvent, NodeStateEvent
from engine.flow.executor import Executor
from engine.flow.plan import build_plan
from engine.flow.validate import GraphValidationError
from engine.spec.kinds import default_kinds
from engine.spec.usage import Usage
from tests.unit.compute.conftest import prompt_ids

LLM_IN = {"prompt": {"type": "text", "optional": True}, "tokens": {"type": "tokens", "optional": True}}
LLM_OUT = {"text": "text", "tokens": "tokens", "kv": "kv"}


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


def chat_workflow(params: dict | None = None, stream: bool = False, input_port: str = "prompt") -> Workflow:
    wf = Workflow("chat")
    llm = wf.role("llm", kind="llm", model="tiny-llama", params={"page_size": 4})
    source = wf.input("prompt", "text" if input_port == "prompt" else "tokens")
    gen = wf.node("gen", "llm", role=llm, inputs=LLM_IN, outputs=LLM_OUT, stream=stream,
                  params={"max_new_tokens": 8, **(params or {})})
    wf.edge(source, gen.inp(input_port))
    if stream:
        out = wf.node("text", "output", inputs={"value": {"type": "text", "join": "ordered"}})
        wf.edge(gen.out("text"), out.inp("value"))
    else:
        wf.output("text", gen.out("text"), "text")
        wf.output("tokens", gen.out("tokens"), "tokens")
        wf.output("kv", gen.out("kv"), "kv")
    return wf


def reference(tiny_llama, prompts: list[list[int]], max_new: int = 8) -> list[list[int]]:
    from engine.compute.sampling import SamplingParams

    engine = LLMEngine(tiny_llama, EngineConfig(page_size=4))
    try:
        outs = []
        for prompt in prompts:
            outs.append(list(engine.generate([prompt], SamplingParams(max_new_tokens=max_new))[0].output_ids))
        return outs
    finally:
        engine.close()


def test_kinds_register_the_llm_role_and_node(kinds):
    assert kinds.role_kind("llm").runner == "engine.compute.llm.unit:LLMUnit"
    node = kinds.node_kind("llm")
    assert set(node.inputs) == {"prompt", "tokens", "items", "embeds"}
    assert set(node.outputs) == {"text", "tokens", "kv", "usage"}
    assert node.to_dict()["outputs"]["kv"] == {"type": "kv", "optional": False}
    assert node.to_dict()["outputs"]["usage"] == {"type": "json", "optional": True}  # older graphs lack it
    build_plan(chat_workflow().to_spec(), kinds)
    with pytest.raises(GraphValidationError) as err:
        build_plan(chat_workflow({"temperature": -1, "bogus": 1}).to_spec(), kinds)
    assert {issue.code for issue in err.value.issues} == {"bad_param"}


async def test_a_workflow_generates_with_the_llm_node(executor, tiny_llama):
    prompt = "".join(chr(t) for t in prompt_ids(30, 12))
    result = await (await executor.submit(chat_workflow().to_spec(), {"prompt": prompt})).wait()
    assert result.status == "done", result.error
    expected = reference(tiny_llama, [list(prompt.encode())])[0]
    assert result.outputs["tokens"] == expected
    assert result.outputs["text"] == tiny_llama.tokenizer.decode(expected, skip_special_tokens=True)
    kv = result.outputs["kv"]
    assert kv.model_id == tiny_llama.model_id and kv.tokens == 20 and len(kv.page_hashes) == 4


@pytest.mark.parametrize("stream", [False, True])
async def test_the_usage_output_says_what_a_generation_took_and_why_it_ended(executor, tiny_llama, stream):
    prompt = "".join(chr(t) for t in prompt_ids(32, 10))
    expected = reference(tiny_llama, [list(prompt.encode())])[0]

    def usage_of(params: dict) -> Usage:
        wf = Workflow("usage")
        llm = wf.role("llm", kind="llm", model="tiny-llama", params={"page_size": 4})
        source = wf.input("prompt", "text")
        gen = wf.node("gen", "llm", role=llm, stream=stream, params={"max_new_tokens": 8, **params})
        wf.edge(source, gen.inp("prompt"))
        if stream:
            out = wf.node("usage", "output", inputs={"value": {"type": "json", "join": "ordered"}})
            wf.edge(gen.out("usage"), out.inp("value"))
        else:
            wf.output("usage", gen.out("usage"), "json")
        return wf.to_spec()

    by_length = await (await executor.submit(usage_of({}), {"prompt": prompt})).wait()
    assert by_length.status == "done", by_length.error
    value = by_length.outputs["usage"]
    (value,) = value if stream else [value]  # streamed: the last frame alone carries it
    assert Usage.from_value(value) == Usage(prompt_tokens=10, completion_tokens=8, cached_tokens=0,
                                            finish_reason="length")
    assert value["total_tokens"] == 18
    at = next(i for i in range(1, 8) if expected[i] not in expected[:i])  # the first token not seen before
    stopped = await (await executor.submit(usage_of({"stop_token_ids": [expected[at]]}), {"prompt": prompt})).wait()
    value = stopped.outputs["usage"]
    (value,) = value if stream else [value]
    usage = Usage.from_value(value)
    assert usage.finish_reason == "stop" and usage.completion_tokens == at + 1 and usage.cached_tokens == 8


def test_a_usage_value_of_another_shape_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"finish_reason"):
        Usage.from_value({"prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 0, "finish_reason": "abort"})


def tiered_workflow(**role_params) -> Workflow:
    wf = Workflow("tiered")
    llm = wf.role("llm", kind="llm", model="tiny-llama", params={"page_size": 4, **role_params})
    source = wf.input("prompt", "tokens")
    gen = wf.node("gen", "llm", role=llm, inputs=LLM_IN, outputs=LLM_OUT, params={"max_new_tokens": 8})
    wf.edge(source, gen.inp("tokens"))
    wf.output("tokens", gen.out("tokens"), "tokens")
    return wf


def test_kv_tier_params_are_checked_with_the_role(kinds, tmp_path):
    build_plan(tiered_workflow(host_pages=8, disk_path=str(tmp_path), disk_pages=8, eviction="lfu",
                               write_policy="write_through").to_spec(), kinds)
    for params in ({"disk_path": str(tmp_path)}, {"disk_pages": 8}, {"eviction": "mru"}, {"write_policy": "never"}):
        with pytest.raises(GraphValidationError) as err:
            build_plan(tiered_workflow(**params).to_spec(), kinds)
        assert {(issue.code, issue.role) for issue in err.value.issues} == {("bad_param", "llm")}, params


def test_the_dtype_param_is_checked_with_the_role(kinds):
    build_plan(tiered_workflow(dtype="bfloat16").to_spec(), kinds)
    for bad in ("float16", "fp32", 32):
        with pytest.raises(GraphValidationError) as err:
            build_plan(tiered_workflow(dtype=bad).to_spec(), kinds)
        issues = err.value.issues
        assert {(issue.code, issue.role) for issue in issues} == {("bad_param", "llm")}, bad
        assert any("dtype" in issue.message for issue in issues), [issue.message for issue in issues]


async def test_a_bfloat16_role_runs_its_model_and_kv_in_bfloat16():
    """The role's dtype reaches the model it loads and the KV layout of its engine; a dtype the unit
    does not know is refused by name (the catalogue refuses it first in a workflow)."""
    role = tiered_workflow(dtype="bfloat16").to_spec().roles[0]
    unit = LLMUnit(role)
    try:
        assert unit.engine.model.dtype == torch.bfloat16 and unit.engine.layout.dtype == "bfloat16"
        assert unit.kv_meta()["layout"].endswith("bfloat16")
    finally:
        await unit.close()
    with pytest.raises(LLMUnitError, match=r"dtype must be one of \['bfloat16', 'float32'\], got 'float16'"):
        LLMUnit(tiered_workflow(dtype="float16").to_spec().roles[0])


async def test_a_role_with_host_and_disk_tiers_keeps_its_pages_on_disk(kinds, tiny_llama, tmp_path):
    """The tiers a workflow asks for are the ones its llm role runs on: small device and host
    tiers, written through to a disk tier whose file holds the pages after the worker ends."""
    from engine.data.kv.disk import DiskTier

    prompts = [prompt_ids(60 + i, 40) for i in range(4)]
    executor = Executor(InProcessDispatcher(kinds), kinds)
    try:
        plan = executor.plan(tiered_workflow(device_pages=24, host_pages=16, disk_path=str(tmp_path), disk_pages=256,
                                             eviction="lfu", write_policy="write_through").to_spec())
        outs = [(await (await executor.submit(plan, {"prompt": p})).wait()).outputs["tokens"] for p in prompts]
    finally:
        await executor.aclose()
    assert outs == reference(tiny_llama, prompts)
    engine = LLMEngine(tiny_llama, EngineConfig(page_size=4))
    try:
        layout = engine.layout
    finally:
        engine.close()
    disk = DiskTier(layout, 256, tmp_path / "slot-0")
    try:
        assert disk.recovered_pages >= 4 * 40 // 4  # every prompt's full pages, at least
    finally:
        disk.close()


async def test_the_unit_reports_llm_counters_for_heartbeats(tiny_llama):
    from engine.compute.llm.unit import LLMUnit
    from engine.spec.calls import NodeCall, NodeContext

    role = chat_workflow().to_spec().role("llm")
    unit = LLMUnit(role)
    try:
        assert unit.metrics()["llm.generated_tokens"] == 0.0
        call = NodeCall(run_id="r", node_id="gen", op=None, params={"max_new_tokens": 5},
                        inputs={"tokens": prompt_ids(7, 9)}, output_ports=("text", "tokens", "kv"),
                        stream=False, router=False, iteration=1, attempt=1)
        ctx = NodeContext(run_id="r", node_id="gen", iteration=1, attempt=1, report_progress=lambda f, m: None)
        result = await unit.execute(call, ctx)
        assert len(result.outputs["tokens"]) == 5
        metrics = unit.metrics()
        assert metrics["llm.generated_tokens"] == 5.0 and metrics["llm.prompt_tokens"] == 9.0
        assert all(k.startswith("llm.") and isinstance(v, float) for k, v in metrics.items())
    finally:
        await unit.close()


async def test_an_engine_thread_that_fails_fails_its_calls_and_the_units_health(tiny_llama):
    """A step that raises (a defect, out of memory) must not leave calls waiting on a dead
    thread: the one in flight fails with the cause, later ones fail at once, and `health()`
    says why, so the worker stops and is replaced."""
    from engine.compute.llm.unit import LLMUnit, LLMUnitError
    from engine.spec.calls import NodeCall, NodeContext

    unit = LLMUnit(chat_workflow().to_spec().role("llm"))

    def broken_step():
        raise RuntimeError("CUDA out of memory (simulated)")

    unit.engine.step = broken_step  # the fault to inject: the engine's next step raises
    try:
        assert unit.health() is None
        call = NodeCall(run_id="r", node_id="gen", op=None, params={"max_new_tokens": 5},
                        inputs={"tokens": prompt_ids(7, 9)}, output_ports=("tokens",),
                        stream=False, router=False, iteration=1, attempt=1)
        ctx = NodeContext(run_id="r", node_id="gen", iteration=1, attempt=1, report_progress=lambda f, m: None)
        with pytest.raises(LLMUnitError, match="the engine failed: RuntimeError: CUDA out of memory"):
            await asyncio.wait_for(unit.execute(call, ctx), 10)
        with pytest.raises(LLMUnitError, match="the engine failed"):
            await asyncio.wait_for(unit.execute(call, ctx), 10)
        # Refused by the failed thread, or at once: either way `failed` is set by now.
        assert unit.health() == "llm role 'llm': the engine failed: RuntimeError: CUDA out of memory (simulated)"
    finally:
        await asyncio.wait_for(unit.close(), 10)


async def test_concurrent_runs_are_batched_and_correct(executor, tiny_llama):
    prompts = [prompt_ids(40 + i, 5 + 3 * i) for i in range(6)]
    plan = executor.plan(chat_workflow(input_port="tokens").to_spec())
    runs = [await executor.submit(plan, {"prompt": p}) for p in prompts]
    results = await asyncio.gather(*(run.wait() for run in runs))
    assert [r.outputs["tokens"] for r in results] == reference(tiny_llama, prompts)


async def test_streaming_node_yields_text_as_it_goes(executor, tiny_llama):
    prompt = "".join(chr(t) for t in prompt_ids(31, 9))
    run = await executor.submit(chat_workflow(stream=True).to_spec(), {"prompt": prompt})
    result = await run.wait()
    assert result.status == "done", result.error
    expected = reference(tiny_llama, [list(prompt.encode())])[0]
    deltas = [e.value for e in run.log.snapshot() if isinstance(e, NodeOutputEvent) and e.node == "gen"
              and e.port == "text" and e.frame is not None]
    assert len(deltas) == 8  # one frame per token
    # The `text` output that gathered them reads as text, not as a list of deltas.
    assert result.outputs["text"] == "".join(deltas) == tiny_llama.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_llm_node_reports_tokens_made_of_max_new_tokens(executor, tiny_llama, stream):
    prompt = "".join(chr(t) for t in prompt_ids(32, 9))
    run = await executor.submit(chat_workflow({"max_new_tokens": 8, "ignore_eos": True}, stream=stream).to_spec(),
                                {"prompt": prompt})
    result = await run.wait()
    assert result.status == "done", result.error
    events = run.log.snapshot()
    running = next(e for e in events if isinstance(e, NodeStateEvent) and e.node == "gen" and e.state == "running")
    assert running.worker.startswith("in-process:") and running.host
    at = events.index(running)
    # Queued, the node said what it waited for: its role's unit, loading the model (the dispatcher).
    waiting = [(e.progress, e.message) for e in events[:at] if isinstance(e, NodeProgressEvent)]
    assert waiting == [(None, "loading tiny-llama (role llm)")]
    progress = [(e.progress, e.message) for e in events[at:] if isinstance(e, NodeProgressEvent)]
    # Running, the bar starts at 0 before the first token and ends full; between them at most one
    # report a tenth of a second (ProgressMeter), however fast the tokens come.
    assert progress[0] == (0.0, "0/8 tokens") and progress[-1] == (1.0, "8/8 tokens")
    assert [p for p, _ in progress] == sorted(p for p, _ in progress)
    assert all(m == f"{round(p * 8)}/8 tokens" for p, m in progress)


async def test_session_param_keeps_history_server_side(executor, tiny_llama):
    plan = executor.plan(chat_workflow({"session": "s1"}, input_port="tokens").to_spec())
    first, second = prompt_ids(32, 10), prompt_ids(33, 6)
    out1 = (await (await executor.submit(plan, {"prompt": first})).wait()).outputs["tokens"]
    out2 = (await (await executor.submit(plan, {"prompt": second})).wait()).outputs["tokens"]
    assert [out1, out2] == reference(tiny_llama, [first, first + out1 + second])


async def test_a_turn_brings_the_history_of_a_session_this_worker_does_not_hold(executor, tiny_llama):
    """As when the session expired here, or began on a replica since lost: the worker opens it
    with the history the turn brings, then keeps it (a later turn's history is not used)."""
    first, second, third = prompt_ids(32, 10), prompt_ids(33, 6), prompt_ids(34, 5)
    (out1,) = reference(tiny_llama, [first])
    plan = executor.plan(chat_workflow({"session": "moved", "session_history": first + out1},
                                       input_port="tokens").to_spec())
    out2 = (await (await executor.submit(plan, {"prompt": second})).wait()).outputs["tokens"]
    out3 = (await (await executor.submit(plan, {"prompt": third})).wait()).outputs["tokens"]
    assert [out2, out3] == reference(tiny_llama, [first + out1 + second, first + out1 + second + out2 + third])


async def test_a_stale_copy_of_a_session_gives_way_to_the_history_the_turn_brings(executor, tiny_llama):
    """The session moved away and back, or a turn failed here: the worker's copy has another
    number of turns than the history, which wins."""
    first, second, third = prompt_ids(35, 8), prompt_ids(36, 5), prompt_ids(37, 4)
    plan = executor.plan(chat_workflow({"session": "back"}, input_port="tokens").to_spec())
    (out1,) = [(await (await executor.submit(plan, {"prompt": first})).wait()).outputs["tokens"]]
    (out2,) = reference(tiny_llama, [first + out1 + second])  # a turn served by another replica
    history = first + out1 + second + out2
    resumed = executor.plan(chat_workflow({"session": "back", "session_history": history, "session_turns": 2},
                                          input_port="tokens").to_spec())
    out3 = (await (await executor.submit(resumed, {"prompt": third})).wait()).outputs["tokens"]
    assert [out3] == reference(tiny_llama, [history + third])
    # A copy that agrees with the history is kept: the history is not sent to the model again.
    fourth = prompt_ids(38, 3)
    again = executor.plan(chat_workflow({"session": "back", "session_history": [1, 2, 3], "session_turns": 3},
                                        input_port="tokens").to_spec())
    out4 = (await (await executor.submit(again, {"prompt": fourth})).wait()).outputs["tokens"]
    assert [out4] == reference(tiny_llama, [history + third + out3 + fourth])


async def test_a_refused_resumed_turn_leaves_no_empty_copy_behind(executor, tiny_llama):
    """A resumed turn that fails (here: too long for the model) must not leave a copy of the
    session without its history that a later turn would take as held."""
    too_long = prompt_ids(39, 200) * 50  # past the model's 8192 positions
    bad = executor.plan(chat_workflow({"session": "lost", "session_history": too_long, "session_turns": 1},
                                      input_port="tokens").to_spec())
    failed = await (await executor.submit(bad, {"prompt": prompt_ids(40, 3)})).wait()
    assert failed.status == "failed" and "positions" in (failed.error or "")
    history, turn = prompt_ids(41, 9), prompt_ids(42, 4)
    good = executor.plan(chat_workflow({"session": "lost", "session_history": history, "session_turns": 1},
                                       input_port="tokens").to_spec())
    out = (await (await executor.submit(good, {"prompt": turn})).wait()).outputs["tokens"]
    assert [out] == reference(tiny_llama, [history + turn])


async def test_a_session_history_in_text_is_encoded_before_the_turn(executor, tiny_llama):
    history, turn = "the story so far", " and then"
    plan = executor.plan(chat_workflow({"session": "told", "session_history": history}).to_spec())
    out = (await (await executor.submit(plan, {"prompt": turn})).wait()).outputs["tokens"]
    encode = tiny_llama.tokenizer
    assert [out] == reference(tiny_llama, [list(encode(history).input_ids) + list(encode(turn).input_ids)])


def test_a_session_history_without_a_session_is_refused(kinds):
    for params, missing in (({"session_history": "alone"}, "session"),
                            ({"session": "s", "session_turns": 1}, "session_history")):
        with pytest.raises(GraphValidationError, match=f"'{missing}' is a dependency"):
            build_plan(chat_workflow(params).to_spec(), kinds)


async def test_bad_inputs_fail_the_node_with_a_clear_error(executor):
    result = await (await executor.submit(chat_workflow(input_port="tokens").to_spec(), {"prompt": [1, 99999]})).wait()
    assert result.status == "failed" and "outside the vocabulary" in (result.error or "")
