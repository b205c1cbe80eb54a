"""The SGLang role runner on a GPU machine: throughput, and prompts served again from the HiCache.

    python bench/sglang_engine.py                      # a seeded model written to a temp dir
    python bench/sglang_engine.py --model /models/x    # a local checkpoint (never downloaded)

Builds (or loads) a model, starts `engine.compute.sglang.runner.SGLangLLMUnit` (`sglang.Engine`
with our HiCache backend as its storage tier), runs the prompts, drops the device cache, runs
the same prompts again, and prints one JSON line per round: tokens/s and the share of prompt
tokens served from cache (`hit_rate`), split into device, host and storage (our backend).
The seeded model is a 4-layer Llama (head dim 64) over token-id prompts
(`skip_tokenizer_init`): no tokenizer, nothing fetched. A watchdog ends the run after
`--timeout-s` (default 450 s, inside the 8 minutes the bench is allowed).

Needs a CUDA GPU and a complete SGLang 0.5.23 install (its CUDA kernels); on any other
machine it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EXIT_NO_GPU = 2
SEEDED_SHAPE = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
                "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = parser.parse_args(argv)
    if not 0 <= args.shared_prefix <= args.prompt_tokens:
        parser.error("--shared-prefix must be between 0 and --prompt-tokens")
    for name in ("prompts", "prompt_tokens", "max_new_tokens", "page_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model} is not a checkpoint directory (no config.json)")
    return args


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
    prompt_tokens = sum(kv["prompt_tokens"] for kv in kvs)
    cached = sum(kv["cached_tokens"] for kv in kvs)
    detail = {k: sum(kv["cached_tokens_details"].get(k, 0) for kv in kvs) for k in ("device", "host", "storage")}
    return RoundResult(name, round(seconds, 3), output_tokens, round(output_tokens / seconds, 1), prompt_tokens,
                       cached, round(cached / prompt_tokens, 4), detail["device"], detail["host"], detail["storage"])


async def bench(args: argparse.Namespace, model_dir: Path) -> list[RoundResult]:
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
        return [first, second]
    finally:
        await unit.close()


def main(argv: list[str] | None = None) -> int:
    from engine.compute.sglang.runner import GPURequired, require_gpu

    args = parse_args(argv)
    try:
        require_gpu(args.device)
    except GPURequired as exc:
        print(f"sglang_engine: {exc}", file=sys.stderr)
        return EXIT_NO_GPU
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)
    try:
        with tempfile.TemporaryDirectory(prefix="omniflow-sglang-bench-") as tmp:
            model_dir = args.model or build_seeded_checkpoint(Path(tmp) / "seeded-llama", args.seed)
            rounds = asyncio.run(bench(args, model_dir))
    finally:
        faulthandler.cancel_dump_traceback_later()
    cold, again = rounds
    print(f"tokens/s: {cold.tokens_per_s} cold, {again.tokens_per_s} again; "
          f"hit rate again: {again.hit_rate:.1%} (storage {again.storage_hits} of {again.prompt_tokens} tokens)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: import `engine`
    sys.exit(main())
