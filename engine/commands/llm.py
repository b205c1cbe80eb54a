"""`omniflow models` and `omniflow generate`: the LLM runner from the command line.

    omniflow models list [--json]
    omniflow models export NAME DIR
    omniflow generate (--model NAME | --model-path DIR) (--prompt TEXT | --input-ids 1,2,3)...
                      --max-new-tokens N [--temperature T --top-p P --top-k K --seed S] [--json]

Several `--prompt`/`--input-ids` run together in one engine, submitted in command-line
order as one batch. Bad input exits 1 with a message naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.compute.sampling import SamplingParams

# The model stack (torch, transformers) is imported inside the handlers: every `omniflow`
# command builds this parser, and most never touch a model.


class _UsageError(Exception):
    """Bad input: printed as `error: ...`, exit status 1."""


class _AppendInput(argparse.Action):
    """Collects `--prompt` and `--input-ids` in command-line order as (flag, value) pairs."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = list(getattr(namespace, self.dest) or [])
        items.append((option_string, values))
        setattr(namespace, self.dest, items)


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="list the built-in models or export one as a checkpoint")
    msub = models.add_subparsers(dest="models_command", required=True)
    p = msub.add_parser("list", help="the built-in model names, shapes and kinds of weights")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_models_list)
    p = msub.add_parser("export", help="write a built-in model as a Hugging Face checkpoint directory")
    p.add_argument("name", help="a built-in model name (see `omniflow models list`)")
    p.add_argument("dir", help="directory to write config, safetensors weights and tokenizer into")
    p.set_defaults(handler=cmd_models_export)

    p = subparsers.add_parser("generate", help="generate text with the LLM runner")
    p.add_argument("--model", help="a built-in model name")
    p.add_argument("--model-path", help="a local Hugging Face checkpoint directory")
    p.add_argument("--prompt", action=_AppendInput, dest="inputs", metavar="TEXT", help="a text prompt; repeatable")
    p.add_argument("--input-ids", action=_AppendInput, dest="inputs", metavar="1,2,3",
                   help="a prompt as comma-separated token ids; repeatable")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-request seed (same seed, same tokens)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string; repeatable")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--page-size", type=int, default=16, help="KV page size in tokens")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the weights, activations and KV cache")
    p.add_argument("--json", action="store_true", help="print one JSON object with every result and timings")
    p.set_defaults(handler=cmd_generate, inputs=None)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def cmd_models_list(args: argparse.Namespace) -> int:
    from engine.compute.builtin_models import model_catalogue

    rows = [row.to_dict() for row in model_catalogue()]
    if args.json:
        print(json.dumps({"models": rows}))
        return 0
    for row in rows:
        if row["family"] is not None:
            shape = (f"{row['family']:<6} {row['layers']} layers, hidden {row['hidden']},"
                     f" {row['heads']}:{row['kv_heads']} heads")
        else:
            shape = ", ".join(row["role_kinds"])
        print(f"{row['name']:<18} {shape}  [{row['weights_label']}]  {row['description']}")
    return 0


def cmd_models_export(args: argparse.Namespace) -> int:
    from engine.compute.models.loader import ModelLoadError, export_model

    try:
        path = export_model(args.name, args.dir)
    except ModelLoadError as exc:
        return _fail(f"models export {args.name}: {exc}")
    except OSError as exc:
        return _fail(f"models export: cannot write {args.dir!r}: {exc}")
    print(f"exported {args.name} to {path}")
    return 0


def _parse_ids(raw: str) -> list[int]:
    try:
        ids = [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise _UsageError(f"--input-ids {raw!r}: not a comma-separated list of token ids") from None
    if not ids:
        raise _UsageError(f"--input-ids {raw!r}: no token ids")
    if any(i < 0 for i in ids):
        raise _UsageError(f"--input-ids {raw!r}: token ids must be >= 0")
    return ids


def _sampling(args: argparse.Namespace) -> SamplingParams:
    from engine.compute.sampling import SamplingParams, SamplingParamsError

    flags = {
        "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
        "top_k": "--top-k", "min_p": "--min-p", "repetition_penalty": "--repetition-penalty", "seed": "--seed",
    }
    try:
        return SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
    except SamplingParamsError as exc:
        name = str(exc).split("=", 1)[0]
        raise _UsageError(f"{flags.get(name, name)}: {exc}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except _UsageError as exc:
        return _fail(str(exc))


def _generate(args: argparse.Namespace) -> int:
    from engine.compute.llm.config import EngineConfig, EngineConfigError
    from engine.compute.llm.engine import LLMEngine
    from engine.compute.llm.errors import RequestError
    from engine.compute.models.loader import ModelLoadError, load_model

    if (args.model is None) == (args.model_path is None):
        raise _UsageError("give exactly one of --model NAME or --model-path DIR")
    if not args.inputs:
        raise _UsageError("give at least one --prompt TEXT or --input-ids 1,2,3")
    params = _sampling(args)
    prompts: list[tuple[str, str | list[int]]] = []
    for flag, raw in args.inputs:
        prompts.append((flag, _parse_ids(raw) if flag == "--input-ids" else raw))
    try:
        config = EngineConfig(page_size=args.page_size, max_running=max(len(prompts), 1))
    except EngineConfigError as exc:
        raise _UsageError(f"--page-size: {exc}") from None
    started = time.perf_counter()
    try:
        model = load_model(name=args.model, path=args.model_path, dtype=args.dtype)
    except ModelLoadError as exc:
        raise _UsageError(f"{'--model' if args.model else '--model-path'} {args.model or args.model_path!r}: {exc}") from None
    loaded = time.perf_counter()
    engine = LLMEngine(model, config)
    try:
        ids = []
        for index, (flag, prompt) in enumerate(prompts):
            try:
                ids.append(engine.add_request(prompt, params, request_id=f"prompt-{index}"))
            except RequestError as exc:
                raise _UsageError(f"{flag} #{index + 1}: {exc}") from None
        results = engine.run_until_finished(ids)
    finally:
        engine.close()
    done = time.perf_counter()
    generated = sum(len(r.output_ids) for r in results)
    if args.json:
        report: dict[str, Any] = {
            "model": model.name,
            "model_id": model.model_id,
            "results": [
                {
                    "index": index,
                    "output_ids": list(r.output_ids),
                    "text": r.text,
                    "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens,
                    "finish_reason": str(r.finish_reason),
                    "timings": {
                        "queue_s": r.timings.queue_s,
                        "ttft_s": r.timings.ttft_s,
                        "total_s": r.timings.total_s,
                    } if r.timings else None,
                }
                for index, r in enumerate(results)
            ],
            "timings": {"load_s": loaded - started, "generate_s": done - loaded},
            "tok_s": generated / (done - loaded) if done > loaded else 0.0,
        }
        print(json.dumps(report))
        return 0
    for index, r in enumerate(results):
        print(f"[{index}] {r.text!r} ({len(r.output_ids)} tokens, {r.cached_tokens} cached, {r.finish_reason})")
    print(f"{generated} tokens in {done - loaded:.3f} s ({generated / max(done - loaded, 1e-9):.1f} tok/s)",
          file=sys.stderr)
    return 0
