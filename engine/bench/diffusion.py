"""Diffusion on the LLM forward path: prompt KV computed once and reused vs recomputed every step.

A 256-token prompt and a 256-token negative prompt (classifier-free guidance: two
branches, one batch), 64 latent tokens (16x16x4 latents in 2x2 patches), 20
flow-matching Euler steps, on a built-in LLM's transformer. `s_reuse`: computing both
prompts' KV once (the LLM's paged prefill) and denoising over it; `s_recompute`: the
anchor, recomputing [prompt ; image tokens] at every step. After a warm-up the two run in
alternation `--repeats` times; times are medians and `speedup` (= s_recompute / s_reuse)
the median of side-by-side ratios. `ideal_ratio` is (prompt + latent tokens) / latent
tokens, what the saving would be if cost were linear in tokens and the one-time prompt
free; `max_abs_diff` compares the two variants' final latents (float32).
Goal: speedup >= 0.6 x ideal_ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine.bench import _llm
from engine.compute.diffusion import DiffusionConfig, DiffusionRunner, Prompt
from engine.compute.models.catalog import ModelConfig
from engine.compute.models.loader import LoadedModel, build_model, load_builtin
from engine.compute.models.tokenizer import BOS_ID, EOS_ID, build_byte_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _llm.add_common(parser)
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="instead of --model: a seeded 4-layer Llama of this width (head dim 16, GQA 2:1),"
                        " where compute rather than per-op overhead dominates")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--negative-tokens", type=int, default=256,
                        help="length of the unconditional (negative) prompt")
    parser.add_argument("--latent-size", type=int, default=16, help="latent height = width (4 channels)")
    parser.add_argument("--patch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)


def _prompt(rng: random.Random, length: int) -> Prompt:
    return Prompt.of([BOS_ID] + [rng.randrange(32, 127) for _ in range(max(length, 1) - 1)])


def _timed(fn) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def _model(args: argparse.Namespace) -> LoadedModel:
    if args.hidden_size is None:
        return load_builtin(args.model)
    width = args.hidden_size
    if width % 32:
        raise SystemExit("--hidden-size must be a multiple of 32")
    config = ModelConfig(name=f"bench-llama-{width}", family="llama", hidden_size=width, num_layers=4,
                         num_heads=width // 16, num_kv_heads=width // 32, intermediate_size=width * 11 // 4, seed=99)
    return LoadedModel(config.name, f"bench:{config.name}", build_model(config), build_byte_tokenizer(), (EOS_ID,))


def run(args: argparse.Namespace) -> dict[str, float | int | bool | str]:
    context = _llm.setup(args)
    rng = random.Random(args.seed)
    model = _model(args)
    config = DiffusionConfig(latent_size=args.latent_size, patch_size=args.patch_size, steps=args.steps,
                             guidance_scale=args.guidance_scale)
    runner = DiffusionRunner(model, config)
    prompt, negative = _prompt(rng, args.prompt_tokens), _prompt(rng, args.negative_tokens)

    def reuse() -> torch.Tensor:
        return runner.generate(prompt, negative, seed=args.seed)

    def recompute() -> torch.Tensor:
        return runner.generate(prompt, negative, seed=args.seed, mode="recompute")

    warm = DiffusionRunner(model, DiffusionConfig(latent_size=args.latent_size, patch_size=args.patch_size, steps=2))
    warm.generate(prompt, negative)
    warm.generate(prompt, negative, mode="recompute")
    reuse_times, recompute_times = [], []
    reused = recomputed = torch.zeros(0)
    for _ in range(max(args.repeats, 1)):
        elapsed, reused = _timed(reuse)
        reuse_times.append(elapsed)
        elapsed, recomputed = _timed(recompute)
        recompute_times.append(elapsed)
    speedup = statistics.median(rc / ru for ru, rc in zip(reuse_times, recompute_times, strict=True))
    latent_tokens = config.num_tokens
    ideal = (args.prompt_tokens + latent_tokens) / latent_tokens
    max_abs = (reused - recomputed).abs().max().item()
    return {
        "model": model.name,
        **context,
        "prompt_tokens": args.prompt_tokens,
        "latent_tokens": latent_tokens,
        "steps": args.steps,
        "cfg_branches": 2,
        "s_reuse": round(statistics.median(reuse_times), 4),
        "s_recompute": round(statistics.median(recompute_times), 4),
        "speedup": round(speedup, 3),
        "ideal_ratio": round(ideal, 3),
        "speedup_vs_ideal": round(speedup / ideal, 3),
        "max_abs_diff": max_abs,
        "max_abs_latent": round(reused.abs().max().item(), 3),
        "goal_speedup": speedup >= 0.6 * ideal,
        "goal_max_abs_diff": max_abs <= 1e-5,
        "load_1m_end": round(_llm.load_average(), 2),
    }
