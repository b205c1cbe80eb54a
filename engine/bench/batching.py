"""Continuous batching throughput: 16 concurrent requests, greedy, against HF `generate`.

`tok_s_engine`: the LLM runner, all requests submitted at once, generated tokens per
second of wall time (prefill included). On a real model (`--model smollm2-135m`) the
requests are chat prompts in the model's own template and each makes 64 new tokens; on
the tiny seeded models (the default, for quick runs) they are byte strings of mixed
lengths making 128. EOS is a token like any other in every variant (the runner's
`ignore_eos`, `generate` with no EOS), so all make the same number of tokens. Anchors,
same prompts: `tok_s_hf_batched`, `transformers` `generate` on the prompts left-padded
into one batch; `tok_s_hf_sequential`, `generate` on each prompt alone, whose tokens
the engine's must equal (`same_tokens_hf_sequential`). After a warm-up the engine and
the batched anchor run in alternation `--repeats` times; throughputs are medians, and
`engine_vs_hf_batched` is the median of the ratios of runs taken side by side (robust
to load that comes and goes). `--no-packed-float32` runs the engine with the role param of
that name turned off (no packed copy of the float32 weights for decode). Goal (issue 18, real model):
engine_vs_hf_batched >= 1.5.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine.bench import _llm
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.models.loader import LoadedModel
from engine.compute.sampling import SamplingParams

GOAL = 1.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _llm.add_common(parser)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 64 on a real model, 128 on a tiny one")
    parser.add_argument("--min-prompt", type=int, default=16, help="tiny models: shortest byte prompt")
    parser.add_argument("--max-prompt", type=int, default=64, help="tiny models: longest byte prompt")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--packed-float32", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine's role param packed_float32 (on by default): oneDNN's products over packed"
                        " float32 weights")


def _prompts(model: LoadedModel, args: argparse.Namespace) -> list[list[int]]:
    if _llm.is_real(args.model):
        return _llm.chat_prompts(model, args.requests)
    rng = random.Random(args.seed)
    return [
        [rng.randrange(32, 127) for _ in range(rng.randrange(args.min_prompt, args.max_prompt + 1))]
        for _ in range(args.requests)
    ]


def _engine_once(model: LoadedModel, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, list]:
    engine = LLMEngine(model, EngineConfig(page_size=args.page_size, max_running=max(args.requests, 1),
                                           packed_float32=args.packed_float32))
    try:
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        started = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - started
    finally:
        engine.close()
    return elapsed, [list(o.output_ids) for o in outs]


def _hf_batched_once(model: LoadedModel, args: argparse.Namespace, prompts: list[list[int]]) -> float:
    started = time.perf_counter()
    _llm.hf_generate(model, prompts, args.new_tokens)
    return time.perf_counter() - started


def _hf_sequential_once(model: LoadedModel, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, list]:
    started = time.perf_counter()
    outs = [_llm.hf_generate(model, [prompt], args.new_tokens)[0] for prompt in prompts]
    return time.perf_counter() - started, outs


def run(args: argparse.Namespace) -> dict[str, float | int | bool | str]:
    context = _llm.setup(args)
    torch.manual_seed(args.seed)
    if args.new_tokens is None:
        args.new_tokens = 64 if _llm.is_real(args.model) else 128
    model = _llm.load(args, args.dtype)
    prompts = _prompts(model, args)
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
        "model": args.model,
        "dtype": args.dtype,
        "packed_float32": args.packed_float32,
        **context,
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "tok_s_engine": round(tokens / statistics.median(engine_times), 1),
        "tok_s_hf_batched": round(tokens / statistics.median(hf_batched_times), 1),
        "tok_s_hf_sequential": round(tokens / hf_seq_time, 1),
        "engine_vs_hf_batched": round(ratio, 3),
        "same_tokens_hf_sequential": hf_seq_outputs == engine_outputs,
        "goal_vs_hf_batched": ratio >= GOAL,
        "load_1m_end": round(_llm.load_average(), 2),
    }
