"""Tensor parallelism on the CPU (gloo): decode tokens/s and diffusion step time at TP=1 and TP=2.

A seeded Llama (`--hidden-size`, default 1024: 4 layers, 16 heads over 8 KV heads, MLP
2816), large enough that splitting matmuls matters on two cores. Every rank (the one of TP=1,
the two of TP=2) uses `--threads` torch threads (default 1): on a shared two-core machine,
TP=1 with two intra-op threads was badly oversubscribed (17 tok/s against 212 with one
thread), which would flatter TP=2 unfairly; pass `--tp1-threads 2` to measure that anyway. Decode: `--batch` sequences of `--prompt-tokens`, `--new-tokens` greedy
tokens after the prefill, best of `--repeats` after a warm-up; diffusion: seconds per
denoising step (64 image tokens over a reused prompt KV), best of `--repeats`.
`tok_s_tp1`/`tok_s_tp2`, `step_s_tp1`/`step_s_tp2` are the figures; `speedup_*` their
ratios (> 1: TP=2 is faster). Every forward of TP=2 pays two all_reduces per layer over
gloo (TCP on loopback): on small batches and a shared machine that cost can exceed the
halved matmuls, and the figures say so as they are.
"""

from __future__ import annotations

import argparse

from engine.compute.diffusion import DiffusionConfig
from engine.compute.llm.config import EngineConfig
from engine.compute.models.catalog import ModelConfig
from engine.compute.tp.role import RankSpec, TPRole


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--diffusion-steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--tp1-threads", type=int, default=None, help="torch threads of TP=1 (default --threads)")


def _model(args: argparse.Namespace) -> ModelConfig:
    hidden = args.hidden_size
    heads = max(2, hidden // 64)
    return ModelConfig(name=f"bench-tp-{hidden}", family="llama", hidden_size=hidden, num_layers=args.layers,
                       num_heads=heads, num_kv_heads=max(2, heads // 2),
                       intermediate_size=(hidden * 11 // 4 + 63) // 64 * 64, seed=99)


def run(args: argparse.Namespace) -> dict:
    model = _model(args)
    engine = EngineConfig(page_size=16, device_pages=1024, max_running=max(4, args.batch))
    diffusion = DiffusionConfig(page_size=16, latent_size=16, steps=args.diffusion_steps)
    out: dict = {"model": {"hidden_size": model.hidden_size, "layers": model.num_layers,
                           "heads": model.num_heads, "kv_heads": model.num_kv_heads,
                           "intermediate_size": model.intermediate_size},
                 "batch": args.batch, "new_tokens": args.new_tokens}
    for size in (1, 2):
        threads = args.tp1_threads if size == 1 and args.tp1_threads else args.threads
        spec = RankSpec(model=model, engine=engine, diffusion=diffusion, threads=threads, timeout_s=60.0)
        with TPRole(spec, size) as role:
            decode = role.call(("bench_decode", args.batch, args.prompt_tokens, args.new_tokens, args.repeats))
            step = role.call(("bench_diffusion", args.prompt_tokens, args.diffusion_steps, args.repeats))
        out[f"tok_s_tp{size}"] = round(decode["tok_s"], 2)
        out[f"step_s_tp{size}"] = round(step["step_s"], 5)
        out[f"threads_per_rank_tp{size}"] = threads
    out["speedup_decode"] = round(out["tok_s_tp2"] / out["tok_s_tp1"], 3)
    out["speedup_diffusion"] = round(out["step_s_tp1"] / out["step_s_tp2"], 3)
    return out
