"""Continuous batching throughput: 16 concurrent requests of 128 new tokens.

`tok_s_engine`: the LLM runner, all requests submitted at once (prompts of mixed
lengths), greedy, generated tokens per second of wall time. Anchors, same prompts:
`tok_s_hf_batched`, `transformers` `generate` on the 16 prompts left-padded into one
batch; `tok_s_hf_sequential`, `generate` on each prompt alone. After a warm-up the
engine and the batched anchor run in alternation `--repeats` times; throughputs are
medians, and `engine_vs_hf_batched` is the median of the ratios of runs taken side by
side (robust to load that comes and goes). Goal: engine_vs_hf_batched >= 1.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.models.loader import LoadedModel, load_builtin
from engine.compute.sampling import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [
        [rng.randrange(32, 127) for _ in range(rng.randrange(args.min_prompt, args.max_prompt + 1))]
        for _ in range(args.requests)
    ]


def _engine_once(model: LoadedModel, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, list]:
    engine = LLMEngine(model, EngineConfig(page_size=args.page_size, max_running=max(args.requests, 1)))
    try:
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        started = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - started
    finally:
        engine.close()
    return elapsed, [list(o.output_ids) for o in outs]


def _hf_batched_once(model: LoadedModel, args: argparse.Namespace, prompts: list[list[int]]) -> float:
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    started = time.perf_counter()
    with torch.no_grad():
        model.model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)
    return time.perf_counter() - started


def _hf_sequential_once(model: LoadedModel, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, list]:
    outs = []
    started = time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                       min_new_tokens=args.new_tokens, do_sample=False)
            outs.append(out[0, len(prompt):].tolist())
    return time.perf_counter() - started, outs


def run(args: argparse.Namespace) -> dict[str, float | int | bool]:
    torch.manual_seed(args.seed)
    model = load_builtin(args.model)
    prompts = _prompts(args)
    warm = argparse.Namespace(**{**vars(args), "new_tokens": 8})
    _engine_once(model, warm, prompts)
    _hf_batched_once(model, warm, prompts)
    tokens = args.requests * args.new_tokens
    engine_times, hf_batched_times = [], []
    engine_outputs: list = []
    for _ in range(args.repeats):
        elapsed, engine_outputs = _engine_once(model, args, prompts)
        engine_times.append(elapsed)
        hf_batched_times.append(_hf_batched_once(model, args, prompts))
    hf_seq_time, hf_seq_outputs = _hf_sequential_once(model, args, prompts)
    ratio = statistics.median(hf / eng for eng, hf in zip(engine_times, hf_batched_times, strict=True))
    return {
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "tok_s_engine": round(tokens / statistics.median(engine_times), 1),
        "tok_s_hf_batched": round(tokens / statistics.median(hf_batched_times), 1),
        "tok_s_hf_sequential": round(tokens / hf_seq_time, 1),
        "engine_vs_hf_batched": round(ratio, 3),
        "same_tokens_hf_sequential": hf_seq_outputs == engine_outputs,
        "goal_vs_hf_batched": ratio >= 1.0,
    }
