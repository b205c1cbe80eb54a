"""The SGLang role runner on a GPU: throughput, and prompts served again from our HiCache tier.

    omniflow bench sglang --json                   # a seeded model written to a temp dir
    omniflow bench sglang --model /models/x        # a local checkpoint (never downloaded)

Builds (or loads) a model, starts `engine.compute.sglang.runner.SGLangLLMUnit` (`sglang.Engine`
with our HiCache backend as its storage tier), runs the prompts (the anchor: a cold round),
drops the device cache, runs the same prompts again, and reports both rounds: tokens/s and the
share of prompt tokens served from cache (`hit_rate`), split into device, host and storage
(our backend), and `again_vs_cold` (tokens/s of the second round over the first). The seeded
model is a 4-layer Llama (head dim 64) over token-id prompts (`skip_tokenizer_init`): no
tokenizer, nothing fetched. A watchdog ends the run after `--timeout-s` (default 450 s).

Needs a CUDA GPU and a complete SGLang install (its CUDA kernels); on any other machine it
stops at once, saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SEEDED_SHAPE = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
                "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="a local checkpoint directory (default: a seeded model)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the seeded model and of the prompts")
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per round")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt")
    parser.add_argument("--shared-prefix", type=int, default=256, help="leading tokens every prompt shares")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--mem-fraction", type=float, default=0.3, help="mem_fraction_static of the engine")
    parser.add_argument("--attention-backend", help="SGLang attention backend (default: SGLang's choice)")
    parser.add_argument("--timeout-s", type=float, default=450.0, help="watchdog: the whole run, seconds")


def check_arguments(args: argparse.Namespace) -> None:
    """SystemExit naming the first option out of range."""
    if not 0 <= args.shared_prefix <= args.prompt_tokens:
        raise SystemExit("omniflow bench sglang: --shared-prefix must be between 0 and --prompt-tokens")
    for name in ("prompts", "prompt_tokens", "max_new_tokens", "page_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"omniflow bench sglang: --{name.replace('_', '-')} must be at least 1")
    if args.model is not None and not (args.model / "config.json").is_file():
        raise SystemExit(f"omniflow bench sglang: --model {args.model} is not a checkpoint directory (no config.json)")


def build_seeded_checkpoint(directory: Path, seed: int) -> Path:
    """A seeded random Llama written as a standard checkpoint (config + safetensors), no tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SEEDED_SHAPE, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def make_prompts(count: int, length: int, shared: int, vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts: `shared` common leading tokens, the rest per prompt (ids 3.. avoid specials)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(length - shared)] for _ in range(count)]


@dataclass(frozen=True, slots=True)
class RoundResult:
    name: str
    seconds: float
    output_tokens: int
    tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    device_hits: int
    host_hits: int
    storage_hits: int


async def run_round(unit: Any, name: str, prompts: list[list[int]], max_new_tokens: int) -> RoundResult:
    from engine.spec.calls import NodeCall, NodeContext

    def call(i: int) -> NodeCall:
        return NodeCall("bench", f"{name}-{i}", None, {"max_new_tokens": max_new_tokens, "ignore_eos": True},
                        {"tokens": prompts[i]}, ("tokens", "kv"), False, False, 0, 0)

    def context(i: int) -> NodeContext:
        return NodeContext("bench", f"{name}-{i}", 0, 0, lambda fraction, message: None)

    start = time.perf_counter()
    results = await asyncio.gather(*(unit.execute(call(i), context(i)) for i in range(len(prompts))))
    seconds = time.perf_counter() - start
    kvs = [r.outputs["kv"] for r in results]
    output_tokens = sum(len(r.outputs["tokens"]) for r in results)
    prompt_tokens = sum(kv.prompt_tokens for kv in kvs)
    cached = sum(kv.cached_tokens for kv in kvs)
    detail = {k: sum(kv.cached_tokens_details.get(k, 0) for kv in kvs) for k in ("device", "host", "storage")}
    return RoundResult(name, round(seconds, 3), output_tokens, round(output_tokens / seconds, 1), prompt_tokens,
                       cached, round(cached / prompt_tokens, 4), detail["device"], detail["host"], detail["storage"])


async def bench(args: argparse.Namespace, model_dir: Path) -> tuple[RoundResult, RoundResult]:
    from engine.compute.sglang.runner import SGLangLLMUnit
    from engine.spec.graph import RoleSpec

    sglang_args: dict[str, Any] = {"skip_tokenizer_init": True}
    if args.attention_backend:
        sglang_args["attention_backend"] = args.attention_backend
    role = RoleSpec(name="sglang", kind="llm", model=str(model_dir), device=args.device,
                    params={"page_size": args.page_size, "mem_fraction_static": args.mem_fraction, "seed": args.seed,
                            "sglang": sglang_args})
    vocab = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    prompts = make_prompts(args.prompts, args.prompt_tokens, args.shared_prefix, vocab, args.seed)
    started = time.perf_counter()
    unit = await asyncio.to_thread(SGLangLLMUnit, role)
    print(json.dumps({"engine_start_s": round(time.perf_counter() - started, 1)}), flush=True)
    try:
        first = await run_round(unit, "cold", prompts, args.max_new_tokens)
        print(json.dumps(asdict(first)), flush=True)
        # The device and host copies go; the pages stay in our storage tier.
        if not await unit.flush_device_cache():
            raise RuntimeError("SGLang refused to flush its cache: requests still running")
        second = await run_round(unit, "again", prompts, args.max_new_tokens)
        print(json.dumps(asdict(second)), flush=True)
        return first, second
    finally:
        await unit.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.compute.sglang.runner import GPURequired, require_gpu

    check_arguments(args)
    try:
        require_gpu(args.device)
    except GPURequired as exc:
        raise SystemExit(f"omniflow bench sglang: {exc}") from None
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)
    try:
        with tempfile.TemporaryDirectory(prefix="omniflow-sglang-bench-") as tmp:
            model_dir = args.model or build_seeded_checkpoint(Path(tmp) / "seeded-llama", args.seed)
            cold, again = asyncio.run(bench(args, model_dir))
    finally:
        faulthandler.cancel_dump_traceback_later()
    result: dict[str, Any] = {}
    for round_ in (cold, again):
        result.update({f"{round_.name}_{key}": value for key, value in asdict(round_).items() if key != "name"})
    result["again_vs_cold"] = round(again.tokens_per_s / cold.tokens_per_s, 3)
    return result
