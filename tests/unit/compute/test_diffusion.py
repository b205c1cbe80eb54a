"""The diffusion runner on the LLM forward path: reused prompt KV against recomputation, KV from
the LLM role (shared store, pulled pages, prefill handoff), CFG as one batch."""

from __future__ import annotations

import random

import pytest
import torch

from engine.compute.diffusion import DiffusionConfig, DiffusionRunner, KVBatch, Prompt, patchify, unpatchify
from engine.compute.llm import EngineConfig, LLMEngine
from engine.compute.models.tokenizer import BOS_ID
from engine.compute.sampling import SamplingParams
from engine.data.kv.source import StorePageSource
from engine.data.kv.store import KVStore, KVStoreConfig
from engine.data.kv.tier import Capacity


def _prompt(seed: int, length: int) -> Prompt:
    rng = random.Random(seed)
    return Prompt.of([BOS_ID] + [rng.randrange(32, 127) for _ in range(length - 1)])


def _store(runner: DiffusionRunner, pages: int = 64) -> KVStore:
    return KVStore(KVStoreConfig(layout=runner.layout, device_capacity=Capacity(pages=pages), device="cpu"))


@pytest.fixture(scope="module")
def runner(tiny_llama) -> DiffusionRunner:
    return DiffusionRunner(tiny_llama, DiffusionConfig(page_size=4))


def test_patchify_round_trips():
    latents = torch.randn(2, 4, 16, 16)
    tokens = patchify(latents, 2)
    assert tokens.shape == (2, 64, 16)
    assert torch.equal(tokens[0, 1], latents[0, :, 0:2, 2:4].reshape(-1))  # row-major grid, channel-first patch
    assert torch.equal(unpatchify(tokens, 4, 16, 16, 2), latents)


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_qwen2"])
def test_reused_kv_equals_recomputing_the_prompt_every_step(model_name, request):
    """20 steps with CFG (prompts of different lengths, batched): the prompt KV computed once
    gives the latents that recomputing [prompt ; image tokens] at every step gives."""
    model = request.getfixturevalue(model_name)
    runner = DiffusionRunner(model, DiffusionConfig(page_size=4, steps=20, guidance_scale=4.0))
    cond, uncond = _prompt(1, 45), _prompt(2, 18)
    reused = runner.generate(cond, uncond, seed=7)
    recomputed = runner.generate(cond, uncond, seed=7, mode="recompute")
    assert reused.shape == (1, 4, 16, 16)
    assert (reused - recomputed).abs().max().item() <= 1e-5
    noise = runner.noise(7)
    assert (reused - noise).abs().max().item() > 0.5  # the steps moved the latents: the check is not vacuous
    assert runner.stats.prompt_tokens_computed == (45 + 18) + 20 * (45 + 18)  # once, then 20 times


def test_prompt_kv_is_the_llms_own(tiny_llama, runner: DiffusionRunner):
    """The K/V the runner attends to are those `transformers` computes for the prompt."""
    prompt = _prompt(3, 23)
    kv = runner.encode_prompt(prompt)
    with torch.no_grad():
        cache = tiny_llama.model(torch.tensor([list(prompt.token_ids)]), use_cache=True).past_key_values
    for layer in range(tiny_llama.num_layers):
        assert torch.allclose(kv.keys[layer], cache.layers[layer].keys[0].transpose(0, 1), atol=1e-5)
        assert torch.allclose(kv.values[layer], cache.layers[layer].values[0].transpose(0, 1), atol=1e-5)


def test_transformer_modules_are_the_llms(tiny_llama, runner: DiffusionRunner):
    """The image steps run the LLM's own tensors: each bound weight is the LLM modules' memory."""
    layers = tiny_llama.model.model.layers
    for bound, layer in zip(runner.transformer.weights.layers, layers, strict=True):
        assert bound.qkv_weight.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
        assert bound.gate_up_weight.data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
        assert bound.o_weight is layer.self_attn.o_proj.weight and bound.down_weight is layer.mlp.down_proj.weight
    assert runner.transformer.weights.lm_weight is tiny_llama.model.lm_head.weight
    assert runner.transformer.weights.lm_packed is runner.prefill.weights.lm_packed is None  # no float32 copy
    engine = LLMEngine(tiny_llama, EngineConfig(page_size=4))
    try:
        assert engine.forward.model is runner.prefill.model is tiny_llama.model  # one copy of the weights
    finally:
        engine.close()


def test_cfg_batch_equals_branches_alone(runner: DiffusionRunner):
    """Padding the shorter prompt and masking it changes nothing: each branch of the batch
    gets what it gets alone."""
    kvs = [runner.encode_prompt(_prompt(4, 30)), runner.encode_prompt(_prompt(5, 9))]
    hidden = runner.head.embed(patchify(runner.noise(0), 2), torch.tensor(500.0))
    both = runner.transformer.image_step(hidden.expand(2, -1, -1), KVBatch.of(kvs, 64))
    for b, kv in enumerate(kvs):
        alone = runner.transformer.image_step(hidden, KVBatch.of([kv], 64))
        assert (both[b] - alone[0]).abs().max().item() <= 1e-5


def test_given_pages_are_reused_not_recomputed(runner: DiffusionRunner):
    prompt = _prompt(6, 22)
    full = runner.encode_prompt(prompt)
    pages = full.to_pages(runner.layout)
    computed = runner.stats.prompt_tokens_computed
    again = runner.encode_prompt(prompt, pages=list(pages[:3]))
    assert runner.stats.prompt_tokens_computed - computed == 22 - 12
    assert torch.allclose(again.keys, full.keys, atol=1e-5) and torch.allclose(again.values, full.values, atol=1e-5)


def test_store_keeps_prompt_pages_between_requests(runner: DiffusionRunner):
    store = _store(runner)
    try:
        prompt = _prompt(7, 21)
        first = runner.encode_cached(prompt, store)
        assert all(store.contains(key) for key in runner.page_keys(prompt))
        computed = runner.stats.prompt_tokens_computed
        second = runner.encode_cached(prompt, store)
        assert runner.stats.prompt_tokens_computed - computed == 1  # only the partial last page
        # The stored pages are read back bit for bit; the last token is prefilled over them.
        assert torch.equal(first.keys[:, :20], second.keys[:, :20])
        assert torch.allclose(first.values, second.values, atol=1e-5)
        assert all(store.lock_count(key) == 0 for key in runner.page_keys(prompt))
    finally:
        store.close()


def test_prompt_kv_from_the_llm_role(tiny_llama, runner: DiffusionRunner):
    """The LLM role computed the prompt: in a shared store its pages are read as they are; from
    another store they are pulled; a prefill handoff brings pages and tail."""
    prompt = _prompt(8, 26)
    expected = runner.encode_prompt(prompt)
    engine = LLMEngine(tiny_llama, EngineConfig(page_size=4))
    try:
        engine.generate([list(prompt.token_ids)], SamplingParams(max_new_tokens=1))
        keys = runner.page_keys(prompt)
        assert all(engine.store.contains(key) for key in keys)  # the llm role's keys are the runner's

        computed = runner.stats.prompt_tokens_computed
        shared = runner.encode_cached(prompt, engine.store)
        assert runner.stats.prompt_tokens_computed - computed == 26 - 24
        assert torch.allclose(shared.keys, expected.keys, atol=1e-5)

        own = _store(runner)
        try:
            computed = runner.stats.prompt_tokens_computed
            pulled = runner.encode_cached(prompt, own, source=StorePageSource(engine.store))
            assert runner.stats.prompt_tokens_computed - computed == 2
            assert all(own.contains(key) for key in keys)
            assert torch.allclose(pulled.values, expected.values, atol=1e-5)

            request = engine.add_request(list(prompt.token_ids), SamplingParams(max_new_tokens=4), prefill_only=True)
            handoff = engine.run_until_finished([request])[0].handoff
            assert handoff is not None and handoff.tail_len == 2
            from_handoff = runner.from_handoff(handoff, own, StorePageSource(engine.store))
            engine.release_handoff(handoff.handoff_id)
            assert torch.allclose(from_handoff.keys, expected.keys, atol=1e-5)
            assert torch.allclose(from_handoff.values, expected.values, atol=1e-5)
        finally:
            own.close()
    finally:
        engine.close()


def test_generation_is_seeded(runner: DiffusionRunner):
    prompt, negative = _prompt(9, 12), _prompt(10, 5)
    a = runner.generate(prompt, negative, seed=3, steps=4)
    assert torch.equal(a, runner.generate(prompt, negative, seed=3, steps=4))
    assert not torch.equal(a, runner.generate(prompt, negative, seed=4, steps=4))
    assert not torch.equal(a, runner.generate(_prompt(11, 12), negative, seed=3, steps=4))


def test_bench_reports_its_keys():
    import argparse

    from engine.bench import diffusion as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args(["--prompt-tokens", "24", "--negative-tokens", "8", "--steps", "2",
                                          "--repeats", "1", "--latent-size", "8"]))
    assert result["latent_tokens"] == 16 and result["ideal_ratio"] == (24 + 16) / 16
    assert result["s_reuse"] > 0 and result["s_recompute"] > 0 and result["max_abs_diff"] <= 1e-5
    assert {"speedup", "goal_speedup", "goal_max_abs_diff"} <= set(result)
