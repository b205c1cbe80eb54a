"""Greedy tokens of the LLM runner equal `transformers` `generate` on the same exported checkpoint.

The reference is independent: `AutoModelForCausalLM` loads the checkpoint that
`export_model` wrote and runs its own `generate` (its own attention and KV cache) on
each prompt alone; the runner loads the same directory separately and runs prompts
batched, from cache, in sessions and across a prefill/decode handoff.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.compute.llm import EngineConfig, FinishReason, LLMEngine
from engine.compute.models import LoadedModel, export_model, load_checkpoint
from engine.compute.sampling import SamplingParams
from engine.data.kv.source import StorePageSource
from tests.integration.hf_agreement import check_greedy

MODELS = ("tiny-llama", "tiny-qwen2")
NEW = 24


@pytest.fixture(scope="module", params=MODELS)
def checkpoint(request, tmp_path_factory) -> Path:
    return export_model(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()


@pytest.fixture(scope="module")
def ours(checkpoint: Path) -> LoadedModel:
    return load_checkpoint(checkpoint)


@pytest.fixture
def engine(ours: LoadedModel) -> Iterator[LLMEngine]:
    eng = LLMEngine(ours, EngineConfig(page_size=16, max_prefill_tokens=64))
    yield eng
    eng.close()


def hf_greedy(model: PreTrainedModel, prompt: list[int], new: int = NEW) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def text_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


GREEDY = SamplingParams(max_new_tokens=NEW)


def test_cold_prompts(engine, reference):
    rng = random.Random(1)
    for n in (1, 15, 16, 17, 40):
        prompt = text_ids(rng, n)
        out = engine.generate([prompt], GREEDY)[0]
        assert out.cached_tokens == 0
        assert list(out.output_ids) == hf_greedy(reference, prompt), n


def test_second_submission_served_from_cache(engine, reference):
    prompt = text_ids(random.Random(2), 50)
    first, second = engine.generate([prompt], GREEDY)[0], engine.generate([prompt], GREEDY)[0]
    assert second.cached_tokens == 48
    expected = hf_greedy(reference, prompt)
    assert list(first.output_ids) == expected and list(second.output_ids) == expected
    extended = prompt + list(first.output_ids) + text_ids(random.Random(3), 5)
    third = engine.generate([extended], GREEDY)[0]
    assert third.cached_tokens == 64
    assert list(third.output_ids) == hf_greedy(reference, extended)


def test_eight_prompts_of_mixed_lengths_batched(engine, reference):
    rng = random.Random(4)
    prompts = [text_ids(rng, n) for n in (3, 70, 16, 1, 33, 9, 48, 20)]
    prompts[6][:16] = prompts[1][:16]  # one shares a page with another in the same batch
    outs = engine.generate(prompts, GREEDY)
    assert engine.metrics()["llm.steps"] < 8 * NEW  # they really ran together
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.output_ids) == hf_greedy(reference, prompt)
    assert outs[6].cached_tokens == 16


def test_ten_turn_session(engine, reference):
    rng = random.Random(5)
    sid = engine.open_session()
    history: list[int] = []
    for turn in range(10):
        message = text_ids(rng, rng.randrange(5, 30))
        rid = engine.add_request(message, SamplingParams(max_new_tokens=12), session_id=sid)
        out = engine.run_until_finished([rid])[0]
        expected = hf_greedy(reference, history + message, 12)
        assert list(out.output_ids) == expected, turn
        if turn:
            # The whole history was cached (its last token was never fed, so it is computed).
            assert out.cached_tokens == len(history) - 1
        history += message + expected
    assert engine.session_history(sid) == history


def test_prefill_decode_disaggregation(checkpoint, reference):
    """Two engines loaded separately; the decode side gets the prompt's pages only through
    the page source (the prefill engine's store)."""
    prefill = LLMEngine(load_checkpoint(checkpoint), EngineConfig(page_size=16))
    decode = LLMEngine(load_checkpoint(checkpoint), EngineConfig(page_size=16))
    try:
        rng = random.Random(6)
        prompts = [text_ids(rng, n) for n in (37, 16, 5)]
        handoffs = [o.handoff for o in prefill.generate(prompts, GREEDY, prefill_only=True)]
        assert all(h is not None for h in handoffs)
        source = StorePageSource(prefill.store)
        ids = [decode.add_request(params=GREEDY, handoff=h, source=source) for h in handoffs]
        outs = decode.run_until_finished(ids)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.finish_reason is FinishReason.LENGTH
            assert list(out.output_ids) == hf_greedy(reference, prompt)
        assert decode.metrics()["pull.pages"] == sum(len(h.page_hashes) for h in handoffs) == 3
        assert decode.metrics()["llm.computed_prompt_tokens"] == 0
    finally:
        prefill.close()
        decode.close()


def test_seeded_sampling_is_reproducible_across_batch_compositions(engine):
    rng = random.Random(7)
    target = text_ids(rng, 21)
    params = SamplingParams(max_new_tokens=20, temperature=1.5, top_p=0.95, seed=42)
    alone = engine.generate([target], params)[0].output_ids
    others = [text_ids(rng, n) for n in (5, 30, 12)]
    mixed = [SamplingParams(max_new_tokens=25, temperature=1.0, seed=1), GREEDY,
             SamplingParams(max_new_tokens=7, temperature=0.7)]
    in_batch = engine.generate([others[0], target, others[1], others[2]], [mixed[0], params, mixed[1], mixed[2]])
    assert in_batch[1].output_ids == alone
    # Joining a batch that is already decoding.
    early = [engine.add_request(p, sp) for p, sp in zip(others, mixed, strict=True)]
    engine.step()
    engine.step()
    late = engine.add_request(target, params)
    assert engine.run_until_finished([*early, late])[-1].output_ids == alone
    greedy = engine.generate([target], SamplingParams(max_new_tokens=20))[0].output_ids
    reseeded = engine.generate([target], dataclasses.replace(params, seed=43))[0].output_ids
    assert alone != greedy and alone != reseeded  # sampling really samples


def test_bfloat16_batched_and_alone_agree_with_hf_in_bfloat16(checkpoint):
    """`dtype: bfloat16` end to end (weights, activations, KV pages) against HF run in bfloat16 on
    the same checkpoint: equal tokens, or a tie within bfloat16's rounding of HF's own logits."""
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True, dtype=torch.bfloat16).eval()
    ours = load_checkpoint(checkpoint, dtype="bfloat16")
    rng = random.Random(8)
    prompts = [text_ids(rng, n) for n in (3, 40, 17, 9)]
    engine = LLMEngine(ours, EngineConfig(page_size=16, max_prefill_tokens=64))
    try:
        alone = [list(engine.generate([p], GREEDY)[0].output_ids) for p in prompts]
        batched = [list(o.output_ids) for o in engine.generate(prompts, GREEDY)]
    finally:
        engine.close()
    for prompt, one, many in zip(prompts, alone, batched, strict=True):
        theirs = hf_greedy(reference, prompt)
        check_greedy(reference, prompt, one, theirs)
        check_greedy(reference, prompt, many, theirs)
