"""Time to first token of a long prompt whose beginning is cached, against the same prompt uncached.

A `--prompt-tokens` (2,048) token prompt whose first `--cached-tokens` (1,920) tokens an
earlier request left in the prefix cache: `ttft_s_cached`, the runner's time to first
token for it (it computes only the rest, attending over the cached pages);
`ttft_s_uncached`, the same prompt on an engine that has nothing cached (it computes all
of it). The two run side by side, alternated, `--repeats` times after a warm-up; times are
medians and `cached_vs_uncached` the median of the side-by-side ratios. Both produce the
same first token (`same_first_token`). Goal (issue 18): cached_vs_uncached <= 0.15.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from engine.bench import _llm
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.models.loader import LoadedModel
from engine.compute.sampling import SamplingParams

GOAL = 0.15
ONE = SamplingParams(max_new_tokens=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _llm.add_common(parser)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--cached-tokens", type=int, default=1920)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)


def _config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(page_size=args.page_size, max_running=2, max_prefill_tokens=args.prompt_tokens)


def _uncached(model: LoadedModel, args: argparse.Namespace, prompt: list[int]) -> tuple[float, int]:
    engine = LLMEngine(model, _config(args))
    try:
        out = engine.generate([prompt], ONE)[0]
    finally:
        engine.close()
    assert out.cached_tokens == 0
    return out.timings.ttft_s, out.output_ids[0]


def _cached(model: LoadedModel, args: argparse.Namespace, prompt: list[int]) -> tuple[float, int, int]:
    engine = LLMEngine(model, _config(args))
    try:
        engine.generate([prompt[: args.cached_tokens]], ONE)  # leaves the prefix's pages cached
        out = engine.generate([prompt], ONE)[0]
    finally:
        engine.close()
    return out.timings.ttft_s, out.output_ids[0], out.cached_tokens


def run(args: argparse.Namespace) -> dict[str, float | int | bool | str]:
    context = _llm.setup(args)
    if not 0 < args.cached_tokens < args.prompt_tokens:
        raise SystemExit("--cached-tokens must be between 0 and --prompt-tokens")
    torch.manual_seed(args.seed)
    model = _llm.load(args, args.dtype)
    rng = random.Random(args.seed)
    prompt = [rng.randrange(100, model.vocab_size) for _ in range(args.prompt_tokens)]
    warm = prompt[: 4 * args.page_size]
    _uncached(model, args, warm)
    cached_times, uncached_times, firsts = [], [], set()
    cached_tokens = 0
    for _ in range(max(args.repeats, 1)):
        elapsed, first, cached_tokens = _cached(model, args, prompt)
        cached_times.append(elapsed)
        firsts.add(first)
        elapsed, first = _uncached(model, args, prompt)
        uncached_times.append(elapsed)
        firsts.add(first)
    ratio = statistics.median(c / u for c, u in zip(cached_times, uncached_times, strict=True))
    return {
        "model": args.model,
        "dtype": args.dtype,
        **context,
        "prompt_tokens": args.prompt_tokens,
        "cached_tokens": cached_tokens,
        "ttft_s_cached": round(statistics.median(cached_times), 4),
        "ttft_s_uncached": round(statistics.median(uncached_times), 4),
        "cached_vs_uncached": round(ratio, 4),
        "same_first_token": len(firsts) == 1,
        "goal_cached_vs_uncached": ratio <= GOAL,
        "load_1m_end": round(_llm.load_average(), 2),
    }
