"""Decode throughput against the weight-read limit, at batch 1, 4 and 16.

A decode step reads every weight once, so at batch 1 it cannot beat
`limit_tok_s = weight bytes / read bandwidth`. `read_gb_s` is measured in the same run:
the best of `--repeats` sums of a float32 buffer as large as the weights. `tok_s_bN`:
steady decode tokens per second at batch N through the LLM runner (greedy, EOS ignored,
prefill excluded: timed from the step after every request has its first token to the
last token), best of `--repeats`; `b1_vs_limit = tok_s_b1 / limit_tok_s`.
Goal (issue 18): b1_vs_limit >= 0.8.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.models.loader import LoadedModel, load_builtin
from engine.compute.sampling import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)


def _weight_bytes(model: LoadedModel) -> int:
    """Bytes of the distinct parameters (a tied embedding counts once: it is read as the LM head)."""
    return sum(p.numel() * p.element_size() for p in model.model.parameters())


def _read_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second of reading a float32 buffer of `nbytes` (best of `repeats`)."""
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    buf.sum()  # touch every page before timing
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - started)
    return buf.numel() * 4 / best


def _decode_tok_s(model: LoadedModel, args: argparse.Namespace, batch: int, rng: random.Random) -> float:
    vocab = model.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(batch)]
    config = EngineConfig(page_size=args.page_size, max_running=batch,
                          max_prefill_tokens=max(batch * args.prompt_tokens, 64))
    engine = LLMEngine(model, config)
    try:
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        ids = {engine.add_request(p, params) for p in prompts}
        started_all: set[str] = set()
        while started_all != ids:  # prefill: every request samples its first token
            started_all.update(o.request_id for o in engine.step() if o.new_token_ids)
        decoded, started = 0, time.perf_counter()
        while engine.has_unfinished():
            decoded += sum(len(o.new_token_ids) for o in engine.step())
        elapsed = time.perf_counter() - started
    finally:
        engine.close()
    return decoded / elapsed


def run(args: argparse.Namespace) -> dict[str, float | int | bool | str]:
    torch.manual_seed(args.seed)
    model = load_builtin(args.model)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    weights = _weight_bytes(model)
    bandwidth = _read_bandwidth(weights, args.repeats)
    limit = bandwidth / weights
    rng = random.Random(args.seed)
    _decode_tok_s(model, argparse.Namespace(**{**vars(args), "new_tokens": 4}), 1, rng)  # warm-up
    result: dict[str, float | int | bool | str] = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "weight_mb": round(weights / 1e6, 1),
        "read_gb_s": round(bandwidth / 1e9, 2),
        "limit_tok_s": round(limit, 1),
    }
    for batch in batches:
        result[f"tok_s_b{batch}"] = round(max(_decode_tok_s(model, args, batch, rng) for _ in range(args.repeats)), 1)
    if 1 in batches:
        ratio = float(result["tok_s_b1"]) / limit
        result["b1_vs_limit"] = round(ratio, 3)
        result["goal_b1_vs_limit"] = ratio >= 0.8
    return result
