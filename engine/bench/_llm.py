"""What the LLM benchmarks share: the model under test, its chat prompts, HF's `generate` as an
anchor, the thread count and the machine's load (a helper module: not a benchmark itself)."""

from __future__ import annotations

import argparse
import copy
import os

import torch

from engine.compute.models.loader import LoadedModel, load_builtin
from engine.compute.models.packaged import PACKAGED_MODELS
from engine.compute.threads import WAIT_POLICY_ENV

QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis to a child.",
    "Write a short poem about the sea.",
    "How do I make a cup of tea?",
    "What are the planets of the solar system?",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
    "Describe a cat in two sentences.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "How does a bicycle stay upright?",
    "List some healthy breakfast ideas.",
    "What is machine learning?",
    "Tell me a fun fact about octopuses.",
    "How do airplanes fly?",
    "What should I pack for a weekend hike?",
)
"""User messages of the chat benchmarks on a real model (cycled when more are asked for)."""


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for the whole run, anchors included (default: torch's own)")


def setup(args: argparse.Namespace) -> dict[str, float | int | str]:
    """Apply `--threads`; the run's context for its result: threads, OpenMP's wait policy (the command
    line sets it, `engine.compute.threads`) and the load average."""
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    return {"threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get(WAIT_POLICY_ENV, "default"),
            "load_1m": round(load_average(), 2)}


def load_average() -> float:
    """The machine's 1-minute load average (benchmarks report it: 2 shared cores make timings noisy)."""
    return os.getloadavg()[0]


def is_real(name: str) -> bool:
    return name in PACKAGED_MODELS


def load(args: argparse.Namespace, dtype: str = "float32") -> LoadedModel:
    return load_builtin(args.model, dtype=dtype)


def chat_prompts(model: LoadedModel, count: int) -> list[list[int]]:
    """`count` single-question chat prompts in the model's own template, as token ids."""
    codec = model.codec
    return [codec.encode(codec.chat_prompt([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
            for i in range(count)]


def no_eos(model: LoadedModel, new_tokens: int):
    """A greedy generation config under which `generate` ends only after `new_tokens`, and an EOS is
    a token like any other: what the runner's `ignore_eos` does (`min_new_tokens` instead
    would forbid EOS, and so change the tokens). Everything is set on the config: given with
    keyword arguments as well, `generate` merges the model's EOS back in; with no EOS at all it
    falls back to the model config's, so the EOS it watches for is an id past the vocabulary."""
    config = copy.deepcopy(model.model.generation_config)
    config.eos_token_id = [model.vocab_size]
    config.max_new_tokens = new_tokens
    config.do_sample = False
    if config.pad_token_id is None:
        config.pad_token_id = model.eos_token_ids[0] if model.eos_token_ids else 0
    return config


def hf_generate(model: LoadedModel, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF `generate`, greedy, on the prompts left-padded into one batch; the new tokens of each."""
    config = no_eos(model, new_tokens)
    width = max(len(p) for p in prompts)
    pad = int(config.pad_token_id)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.model.generate(ids, attention_mask=mask, generation_config=config)
    return out[:, width:].tolist()
