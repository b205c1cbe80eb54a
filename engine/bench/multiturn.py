"""A long multi-turn conversation: server-side session with prefix reuse vs resubmitting history.

One session of `--turns` turns (each a new message in, `--out-tokens` greedy tokens out;
EOS is a token like any other). On a tiny seeded model (the default) a message is about
`--new-tokens` random bytes; on a real one (`--model smollm2-135m`) it is a user turn in the
model's chat template (the first one with the system prompt). The same conversation is timed three ways, side
by side in each of `--repeats` rounds after a warm-up (times are medians; the ratios
are medians of each round's ratio):

* `jct_s_session`: engine session; a turn sends only its new message and the
  history's KV stays cached (pinned) between turns;
* `jct_s_nocache`: the same engine code, prefix cache off, the whole history
  resubmitted every turn;
* `jct_s_hf`: `transformers` `generate` on the whole history every turn.

`hit_rate` is the share of prompt tokens the session served from the cache;
`oracle_hit_rate` the share that had been seen before (the history). Goals:
hit_rate >= 0.95 x oracle_hit_rate; jct_s_session <= 0.5 x jct_s_nocache and <= 0.5 x jct_s_hf.
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _llm.add_common(parser)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=40, help="new message tokens per turn (about)")
    parser.add_argument("--out-tokens", type=int, default=20, help="generated tokens per turn")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each variant; medians reported")


def _chat_turns(model: LoadedModel, turns: int) -> list[list[int]]:
    """Turn 0: a chat prompt of one user question; each later turn: what the model's template puts
    after the assistant's answer (its end marker), the next question and the generation prompt."""
    codec = model.codec
    questions = [_llm.QUESTIONS[i % len(_llm.QUESTIONS)] for i in range(turns)]
    first = codec.chat_prompt([{"role": "user", "content": questions[0]}])
    out = [codec.encode(first)]
    for question in questions[1:]:
        both = codec.chat_prompt([{"role": "user", "content": questions[0]}, {"role": "assistant", "content": "A"},
                                  {"role": "user", "content": question}])
        if not both.startswith(first + "A"):
            raise SystemExit(f"{model.name}: its chat template does not continue a conversation after the answer")
        out.append(codec.encode(both[len(first) + 1 :]))
    return out


def _messages(model: LoadedModel, args: argparse.Namespace) -> list[list[int]]:
    if _llm.is_real(args.model):
        return _chat_turns(model, args.turns)
    rng = random.Random(args.seed)
    low, high = max(1, args.new_tokens - 8), args.new_tokens + 8
    return [[rng.randrange(32, 127) for _ in range(rng.randrange(low, high + 1))] for _ in range(args.turns)]


def _config(args: argparse.Namespace, prefix_cache: bool) -> EngineConfig:
    return EngineConfig(page_size=args.page_size, max_running=4, max_prefill_tokens=4096, prefix_cache=prefix_cache)


def _session_run(model: LoadedModel, args, messages, params) -> tuple[float, list[list[int]], float]:
    engine = LLMEngine(model, _config(args, prefix_cache=True))
    try:
        sid = engine.open_session()
        outputs = []
        started = time.perf_counter()
        for message in messages:
            rid = engine.add_request(message, params, session_id=sid)
            outputs.append(list(engine.run_until_finished([rid])[0].output_ids))
        elapsed = time.perf_counter() - started
        hit_rate = engine.metrics()["llm.hit_rate"]
    finally:
        engine.close()
    return elapsed, outputs, hit_rate


def _nocache_run(model: LoadedModel, args, prompts, params) -> tuple[float, list[list[int]]]:
    engine = LLMEngine(model, _config(args, prefix_cache=False))
    try:
        outputs = []
        started = time.perf_counter()
        for prompt in prompts:
            outputs.append(list(engine.generate([prompt], params)[0].output_ids))
        return time.perf_counter() - started, outputs
    finally:
        engine.close()


def _hf_run(model: LoadedModel, prompts, out_tokens: int) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = [_llm.hf_generate(model, [prompt], out_tokens)[0] for prompt in prompts]
    return time.perf_counter() - started, outputs


def run(args: argparse.Namespace) -> dict[str, float | int | bool | str]:
    context = _llm.setup(args)
    torch.manual_seed(args.seed)
    model = _llm.load(args, args.dtype)
    messages = _messages(model, args)
    params = SamplingParams(max_new_tokens=args.out_tokens, ignore_eos=True)
    # Warm-up: fault in pages and let the kernels pick their paths.
    _session_run(model, args, messages[:3], params)
    _hf_run(model, [messages[0]], 4)

    jct_session_runs, nocache_times, hf_times = [], [], []
    outputs: list[list[int]] = []
    nocache_outputs: list[list[int]] = []
    hf_outputs: list[list[int]] = []
    hit_rate = 0.0
    prompts: list[list[int]] = []
    seen = total = 0
    for _ in range(args.repeats):
        # The three variants run side by side each round, so a burst of load hits one round.
        elapsed, outputs, hit_rate = _session_run(model, args, messages, params)
        jct_session_runs.append(elapsed)
        if not prompts:
            history: list[int] = []
            for message, output in zip(messages, outputs, strict=True):
                prompts.append(history + message)
                seen += len(history)
                total += len(history) + len(message)
                history = history + message + output
        elapsed, nocache_outputs = _nocache_run(model, args, prompts, params)
        nocache_times.append(elapsed)
        elapsed, hf_outputs = _hf_run(model, prompts, args.out_tokens)
        hf_times.append(elapsed)
    jct_session = statistics.median(jct_session_runs)
    jct_nocache, jct_hf = statistics.median(nocache_times), statistics.median(hf_times)
    vs_nocache = statistics.median(s / n for s, n in zip(jct_session_runs, nocache_times, strict=True))
    vs_hf = statistics.median(s / h for s, h in zip(jct_session_runs, hf_times, strict=True))
    oracle = seen / total
    return {
        "model": args.model,
        "dtype": args.dtype,
        **context,
        "turns": args.turns,
        "prompt_tokens": total,
        "jct_s_session": round(jct_session, 3),
        "jct_s_nocache": round(jct_nocache, 3),
        "jct_s_hf": round(jct_hf, 3),
        "hit_rate": round(hit_rate, 4),
        "oracle_hit_rate": round(oracle, 4),
        "session_vs_nocache": round(vs_nocache, 3),
        "session_vs_hf": round(vs_hf, 3),
        "same_tokens_nocache": nocache_outputs == outputs,
        "same_tokens_hf": hf_outputs == outputs,
        "goal_hit_rate": hit_rate >= 0.95 * oracle,
        "goal_vs_nocache": vs_nocache <= 0.5,
        "goal_vs_hf": vs_hf <= 0.5,
        "load_1m_end": round(_llm.load_average(), 2),
    }
