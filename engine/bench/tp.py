"""Tensor parallelism on the CPU (gloo): decode tokens/s and diffusion step time at TP=1 and TP=2.

A seeded Llama (`--hidden-size`, default 1024: 4 layers, 16 heads over 8 KV heads, MLP
2816), written once as a checkpoint, large enough that splitting matmuls matters on two cores.
TP=1 runs the engine (and the diffusion runner) in this process; TP=2 runs them the way a
tensor-parallel role does, rank 0 in this process (`engine.compute.tp.leader.lead`,
`TPDiffusionUnit`) and its follower a child process (`LocalRanks`), every forward broadcast as a
pass. Every rank uses `--threads` torch threads (default 1): on a shared two-core machine, TP=1
with two intra-op threads was badly oversubscribed (17 tok/s against 212 with one thread), which
would flatter TP=2 unfairly; pass `--tp1-threads 2` to measure that anyway. Decode: `--batch`
sequences of `--prompt-tokens`, `--new-tokens` greedy tokens after the prefill, best of
`--repeats` after a warm-up; diffusion: seconds per denoising step (64 image tokens, prompt
encoding included), best of `--repeats`. `tok_s_tp1`/`tok_s_tp2`, `step_s_tp1`/`step_s_tp2` are
the figures; `speedup_*` their ratios (> 1: TP=2 is faster). Every forward of TP=2 pays two
all_reduces per layer over gloo (TCP on loopback) and one pass message: on small batches and a
shared machine that cost can exceed the halved matmuls, and the figures say so as they are.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine.compute.diffusion import DiffusionRunner, Prompt
from engine.compute.diffusion.runner import DiffusionConfig
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.models.catalog import ModelConfig
from engine.compute.models.loader import LoadedModel, _eos_ids, build_model, load_checkpoint
from engine.compute.models.tokenizer import build_byte_tokenizer
from engine.compute.sampling import SamplingParams
from engine.compute.tp.diffusion_unit import TPDiffusionUnit
from engine.compute.tp.leader import lead
from engine.compute.tp.local import LocalRanks
from engine.compute.tp.messages import TPDiffuse
from engine.spec.graph import RoleSpec


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


def _checkpoint(config: ModelConfig, directory: Path) -> Path:
    """The seeded model written as a checkpoint, which every rank loads."""
    model = build_model(config)
    tokenizer = build_byte_tokenizer()
    LoadedModel(name=config.name, model_id=config.name, model=model, tokenizer=tokenizer,
                eos_token_ids=_eos_ids(model, tokenizer))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _decode_tok_s(engine: LLMEngine, args: argparse.Namespace) -> float:
    """Decode tokens/s (after prefill) of `--batch` sequences; the best of `--repeats`."""
    best = 0.0
    for r in range(args.repeats + 1):
        prompts = [[(7 * r + 13 * i + j) % 200 + 3 for j in range(args.prompt_tokens)] for i in range(args.batch)]
        params = SamplingParams(max_new_tokens=args.new_tokens + 1, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        engine.step()  # prefill (+ first token)
        started = time.perf_counter()
        engine.run_until_finished(ids)
        if r:  # the first round warms up
            best = max(best, args.batch * args.new_tokens / (time.perf_counter() - started))
    return best


def _step_s(diffuse: Callable[[TPDiffuse], torch.Tensor], args: argparse.Namespace) -> float:
    """Seconds per denoising step of one prompt; the best of `--repeats` after a warm-up."""
    message = TPDiffuse([[(5 * j) % 200 + 3 for j in range(args.prompt_tokens)]], 0, args.diffusion_steps, 1.0)
    diffuse(TPDiffuse(message.prompts, 0, 1, 1.0))  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        started = time.perf_counter()
        diffuse(message)
        best = min(best, (time.perf_counter() - started) / args.diffusion_steps)
    return best


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _tp1(checkpoint: Path, engine: EngineConfig, diffusion: DiffusionConfig, args: argparse.Namespace) -> tuple[float, float]:
    loaded = load_checkpoint(checkpoint)
    llm = LLMEngine(loaded, engine)
    try:
        tok_s = _decode_tok_s(llm, args)
    finally:
        llm.close()
    runner = DiffusionRunner(loaded, diffusion)

    def diffuse(message: TPDiffuse) -> torch.Tensor:
        kv = runner.encode_prompt(Prompt.of(message.prompts[0]))
        return runner.denoise([kv], seed=message.seed, steps=message.steps)

    return tok_s, _step_s(diffuse, args)


def _tp2(checkpoint: Path, params: dict, diffusion: dict, args: argparse.Namespace) -> tuple[float, float]:
    llm = RoleSpec(name="bench", kind="llm", model=str(checkpoint), tp_size=2, params=params)
    with LocalRanks(llm, threads=args.threads) as ranks:
        leader = lead(llm, load_checkpoint(checkpoint), EngineConfig.from_params(params), ranks.seat)
        try:
            tok_s = _decode_tok_s(leader.engine, args)
        finally:
            leader.close()
    role = RoleSpec(name="bench", kind="diffusion", model=str(checkpoint), tp_size=2, params=diffusion)
    with LocalRanks(role, threads=args.threads) as ranks:
        unit = TPDiffusionUnit(role, tp=ranks.seat)
        try:
            step_s = _step_s(unit.diffuse, args)
        finally:
            asyncio.run(unit.close())
    return tok_s, step_s


def run(args: argparse.Namespace) -> dict:
    model = _model(args)
    params = {"page_size": 16, "device_pages": 1024, "max_running": max(4, args.batch), "tp_timeout_s": 60.0}
    diffusion = {"page_size": 16, "latent_size": 16, "steps": args.diffusion_steps, "tp_timeout_s": 60.0}
    out: dict = {"model": {"hidden_size": model.hidden_size, "layers": model.num_layers,
                           "heads": model.num_heads, "kv_heads": model.num_kv_heads,
                           "intermediate_size": model.intermediate_size},
                 "batch": args.batch, "new_tokens": args.new_tokens}
    tp1_threads = args.tp1_threads or args.threads
    with tempfile.TemporaryDirectory(prefix="omniflow-bench-tp-") as tmp:
        checkpoint = _checkpoint(model, Path(tmp))
        with _threads(tp1_threads):
            engine = EngineConfig.from_params({k: v for k, v in params.items() if k != "tp_timeout_s"})
            config = DiffusionConfig(page_size=16, latent_size=16, steps=args.diffusion_steps)
            out["tok_s_tp1"], out["step_s_tp1"] = _tp1(checkpoint, engine, config, args)
        with _threads(args.threads):
            out["tok_s_tp2"], out["step_s_tp2"] = _tp2(checkpoint, params, diffusion, args)
    out["tok_s_tp1"], out["tok_s_tp2"] = round(out["tok_s_tp1"], 2), round(out["tok_s_tp2"], 2)
    out["step_s_tp1"], out["step_s_tp2"] = round(out["step_s_tp1"], 5), round(out["step_s_tp2"], 5)
    out["threads_per_rank_tp1"], out["threads_per_rank_tp2"] = tp1_threads, args.threads
    out["speedup_decode"] = round(out["tok_s_tp2"] / out["tok_s_tp1"], 3)
    out["speedup_diffusion"] = round(out["step_s_tp1"] / out["step_s_tp2"], 3)
    return out
