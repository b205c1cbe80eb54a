"""Decode throughput against the weight-read limit, at batch 1, 4 and 16, in float32 and bfloat16.

A decode step reads every weight once, so at batch 1 it cannot beat
`limit_tok_s = weight bytes / read bandwidth`. Per dtype (`--dtypes`), measured in the
same run: `read_gb_s`, the median of `--repeats` sums of a buffer as large as that
dtype's weights; `tok_s_bN`, steady decode tokens per second at batch N through the
LLM runner (greedy, EOS ignored, prefill excluded: timed from the step after every
request has its first token to the last token), the median of `--repeats` runs;
`b1_vs_limit = tok_s_b1 / limit_tok_s`. Keys carry the dtype (`float32_tok_s_b1`, ...).
`bfloat16_b16_vs_float32` compares the two dtypes' batch-16 throughput, and
`b1_vs_llamacpp` each batch-1 figure with llama.cpp's (`--llamacpp-tok-s`: 74 tok/s,
llama-cpp-python 0.3.36 on the Q4_1 GGUF with 2 threads, on a machine like this one;
a recorded figure, not measured in this run).
Goals (issue 18): b1_vs_limit >= 0.8 in each dtype; bfloat16_b16_vs_float32 >= 2.
`--no-packed-float32` runs the engine with the role param of that name turned off (float32 decode
products by MKL's `F.linear` instead of oneDNN's over a packed copy of the weights).
`products_tok_s_b1`: the tokens per second of a batch-1 step's products alone (`products_seconds`:
every weight's product by the engine's kernels, nothing else), so `products_vs_limit` is how near
the kernels themselves read the weights to the limit and `b1_vs_products` what share of a step
the rest (attention, norms, rotary, the Python between) leaves them. `products_bN`: the kernel of each product (weight shape: one row, a decode batch, more), as the
engine chose them (`engine.compute.llm.products`: measured per engine in float32; the distinct
choices of the runs, `|`-separated). `bfloat16_native` says whether this CPU runs bfloat16 products natively (AVX512-BF16, AMX): the
bfloat16 goals assume it; without it bfloat16 products are emulated, several times slower than
float32's, and the bfloat16 figures measure that emulation.
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
from engine.compute.llm.layers import DecoderWeights
from engine.compute.llm.products import add_product, native_bfloat16, project
from engine.compute.models.loader import LoadedModel
from engine.compute.sampling import SamplingParams

LLAMACPP_B1_TOK_S = 74.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _llm.add_common(parser)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--packed-float32", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine's role param packed_float32 (on by default): oneDNN's products over packed"
                        " float32 weights")
    parser.add_argument("--llamacpp-tok-s", type=float, default=LLAMACPP_B1_TOK_S,
                        help="llama.cpp's batch-1 decode figure to compare with (recorded, not measured here)")


def _weight_bytes(model: LoadedModel) -> int:
    """Bytes of the distinct parameters (a tied embedding counts once: it is read as the LM head)."""
    return sum(p.numel() * p.element_size() for p in model.model.parameters())


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second of reading a float32 buffer of `nbytes` (median of `repeats`, after a warm-up)."""
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    buf.sum()  # touch every page before timing
    times = []
    for _ in range(max(repeats, 1)):
        started = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - started)
    return buf.numel() * 4 / statistics.median(times)


def decode_tok_s(model: LoadedModel, args: argparse.Namespace, batch: int, rng: random.Random) -> tuple[float, str]:
    """Steady decode tokens per second at `batch`, and the products' kernels the engine took."""
    vocab = model.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(batch)]
    config = EngineConfig(page_size=args.page_size, max_running=batch,
                          max_prefill_tokens=max(batch * args.prompt_tokens, 64), packed_float32=args.packed_float32)
    engine = LLMEngine(model, config)
    products = str(engine.forward.weights.plans)
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
    return decoded / elapsed, products


def products_seconds(weights: DecoderWeights, rows: int, repeats: int) -> float:
    """Seconds of a decode step's products alone at `rows` rows — every layer's four, in order, and
    the LM head — by the kernels `weights` are planned for; the fastest of `repeats` (after one)."""
    width = weights.layers[0].qkv_weight.shape[1]
    hidden = torch.randn(rows, width, dtype=weights.dtype)
    inner = torch.randn(rows, weights.layers[0].intermediate, dtype=weights.dtype)
    attn = torch.randn(rows, weights.num_heads * weights.head_dim, dtype=weights.dtype)
    best = float("inf")
    with torch.inference_mode():
        for attempt in range(max(repeats, 1) + 1):
            started = time.perf_counter()
            for layer in weights.layers:
                project(hidden, layer.qkv_weight, layer.qkv_bias, layer.qkv_packed, layer.plans)
                if layer.o_weight is not None:
                    add_product(hidden, attn, layer.o_weight, layer.o_packed, layer.plans)
                project(hidden, layer.gate_up_weight, layer.gate_up_bias, layer.gate_up_packed, layer.plans)
                if layer.down_weight is not None:
                    add_product(hidden, inner, layer.down_weight, layer.down_packed, layer.plans)
            project(hidden, weights.lm_weight, weights.lm_bias, weights.lm_packed, weights.plans)
            if attempt:
                best = min(best, time.perf_counter() - started)
    return best


def _one_dtype(args: argparse.Namespace, dtype: str, batches: list[int]) -> dict[str, float | bool | str]:
    model = _llm.load(args, dtype)
    weights = _weight_bytes(model)
    rng = random.Random(args.seed)
    decode_tok_s(model, argparse.Namespace(**{**vars(args), "new_tokens": 4}), 1, rng)  # warm-up
    bandwidth = read_bandwidth(weights, args.repeats)
    limit = bandwidth / weights
    out: dict[str, float | bool | str] = {
        "weight_mb": round(weights / 1e6, 1),
        "read_gb_s": round(bandwidth / 1e9, 2),
        "limit_tok_s": round(limit, 1),
    }
    for batch in batches:
        runs = [decode_tok_s(model, args, batch, rng) for _ in range(max(args.repeats, 1))]
        out[f"tok_s_b{batch}"] = round(statistics.median(tok_s for tok_s, _ in runs), 1)
        out[f"products_b{batch}"] = " | ".join(sorted({products for _, products in runs}))
    engine = LLMEngine(model, EngineConfig(packed_float32=args.packed_float32))
    try:
        kernels = 1 / products_seconds(engine.forward.weights, 1, args.repeats)
    finally:
        engine.close()
    out["products_tok_s_b1"] = round(kernels, 1)
    out["products_vs_limit"] = round(kernels / limit, 3)
    if 1 in batches:
        out["b1_vs_products"] = round(float(out["tok_s_b1"]) / kernels, 3)
        ratio = float(out["tok_s_b1"]) / limit
        out["b1_vs_limit"] = round(ratio, 3)
        out["b1_vs_llamacpp"] = round(float(out["tok_s_b1"]) / args.llamacpp_tok_s, 3)
        out["goal_b1_vs_limit"] = ratio >= 0.8
    return out


def run(args: argparse.Namespace) -> dict[str, float | int | bool | str]:
    context = _llm.setup(args)
    torch.manual_seed(args.seed)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    result: dict[str, float | int | bool | str] = {"model": args.model, **context,
                                                   "llamacpp_b1_tok_s": args.llamacpp_tok_s,
                                                   "packed_float32": args.packed_float32,
                                                   "bfloat16_native": native_bfloat16()}
    for dtype in dtypes:
        for key, value in _one_dtype(args, dtype, batches).items():
            result[f"{dtype}_{key}"] = value
    if {"float32", "bfloat16"} <= set(dtypes) and 16 in batches:
        ratio = float(result["bfloat16_tok_s_b16"]) / float(result["float32_tok_s_b16"])
        result["bfloat16_b16_vs_float32"] = round(ratio, 3)
        result["goal_bfloat16_b16_vs_float32"] = ratio >= 2.0
    result["load_1m_end"] = round(_llm.load_average(), 2)
    return result
