"""What one rank runs: its model shard, its LLM engine and diffusion runner, and the commands.

Commands are tuples `(name, *args)`; every rank runs the same ones in the same order
(`engine.compute.tp.role`). Results that are per-rank (KV pages) are gathered on rank 0,
as raw tensors or msgpack bytes (nothing is pickled). A command's return annotation is the
type its result travels to the driver as (msgspec, tensors as `TPTensor`).
"""

from __future__ import annotations

import time
from typing import Any, TypedDict

import msgspec
import torch

from engine.compute.llm.config import EngineConfig
from engine.compute.llm.transfer import KVHandoff
from engine.compute.models.catalog import ModelConfig
from engine.compute.models.loader import LoadedModel, _eos_ids, build_model, load_builtin
from engine.compute.models.tokenizer import build_byte_tokenizer
from engine.compute.sampling import SamplingParams
from engine.compute.tp.engine import TPEngine
from engine.compute.tp.group import TPError, TPGroup
from engine.compute.tp.shard import shard_model


def load_spec_model(model: str | ModelConfig) -> LoadedModel:
    """A built-in model by name, or the seeded model of a `ModelConfig` (benchmarks' larger shapes)."""
    if isinstance(model, str):
        return load_builtin(model)
    hf = build_model(model)
    tokenizer = build_byte_tokenizer()
    return LoadedModel(name=model.name, model_id=f"seeded:{model.name}:seed{model.seed}", model=hf,
                       tokenizer=tokenizer, eos_token_ids=_eos_ids(hf, tokenizer))


class PrefillShards(TypedDict):
    """`cmd_prefill`'s result: the handoff (its layout and tail are rank 0's) and every rank's
    head shard of its full pages (None without full pages) and partial last page (None without one)."""

    handoff: KVHandoff
    pages: list[torch.Tensor | None]
    tails: list[torch.Tensor | None]


class RankState:
    def __init__(self, spec: Any, group: TPGroup) -> None:
        self.group = group
        self.spec = spec
        self.shard = shard_model(load_spec_model(spec.model), group)
        self.engine = TPEngine(self.shard, group, spec.engine or EngineConfig())
        self._diffusion = None

    def close(self) -> None:
        self.engine.close()

    @property
    def diffusion(self):
        if self._diffusion is None:
            from engine.compute.diffusion import DiffusionConfig, DiffusionRunner

            self._diffusion = DiffusionRunner(self.shard, self.spec.diffusion or DiffusionConfig())
        return self._diffusion

    def run(self, cmd: tuple) -> Any:
        name, *args = cmd
        handler = getattr(self, f"cmd_{name}", None)
        if handler is None:
            raise TPError(f"unknown tensor-parallel command {name!r}")
        return handler(*args)

    # -- commands ------------------------------------------------------------------------------

    def cmd_info(self) -> dict[str, Any]:
        mine = msgspec.msgpack.encode({"rank": self.group.rank, "layout": self.engine.layout.to_dict(),
                                       "threads": torch.get_num_threads()})
        infos = self.group.gather_bytes(mine)
        return {"size": self.group.size, "ranks": [msgspec.msgpack.decode(i) for i in infos or ()]}

    def cmd_generate(self, prompts: list, max_new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        return [list(out.output_ids) for out in self.engine.generate(prompts, params)]

    def cmd_generate_stats(self, prompts: list, max_new_tokens: int) -> dict[str, Any]:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        outs = self.engine.generate(prompts, params)
        return {"tokens": [list(o.output_ids) for o in outs], "cached": [o.cached_tokens for o in outs]}

    def cmd_prefill(self, prompt: list[int]) -> PrefillShards | None:
        """Prefill `prompt` (prefill-only request); every rank's head shard of its full pages and
        tail, gathered on rank 0 with the handoff's fields. The hold is released at once."""
        out = self.engine.generate([prompt], SamplingParams(max_new_tokens=2, ignore_eos=True), prefill_only=True)[0]
        handoff = out.handoff
        assert handoff is not None
        pages = [self.engine.store.get(page) for page in handoff.page_hashes]
        self.engine.release_handoff(handoff.handoff_id)
        # Every rank prefilled the same prompt: all have full pages, or none, and a tail, or none.
        size = self.group.size
        shards = self.group.gather_tensor(torch.stack(pages)) if pages else [None] * size
        tails = self.group.gather_tensor(handoff.tail) if handoff.tail is not None else [None] * size
        if not self.group.is_leader or shards is None or tails is None:
            return None
        return {"handoff": handoff, "pages": list(shards), "tails": list(tails)}

    def cmd_diffuse(self, prompt: list[int], negative: list[int] | None, seed: int, steps: int) -> torch.Tensor:
        from engine.compute.diffusion import Prompt

        runner = self.diffusion
        neg = Prompt.of(negative) if negative is not None else None
        return runner.generate(Prompt.of(prompt), neg, seed=seed, steps=steps)

    def cmd_drop_pages(self, rank: int) -> int:
        """Tests: rank `rank` loses every unlocked KV page (as an eviction would); returns how many."""
        dropped = 0
        if self.group.rank == rank:
            store = self.engine.store
            for page in list(store.resident_pages()):
                if not store.lock_count(page):
                    store.remove(page)
                    dropped += 1
        counts = self.group.gather_tensor(torch.tensor([dropped], dtype=torch.int64))  # every rank joins
        return int(counts[rank].item()) if counts is not None else 0

    def cmd_crash(self, rank: int) -> None:
        """Tests: rank `rank` exits abruptly (as a killed process would)."""
        if self.group.rank == rank:
            import os

            os._exit(9)

    def cmd_bench_decode(self, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict[str, float]:
        """Decode tokens/s (after prefill) of `batch` sequences; the best of `repeats`."""
        best = 0.0
        for r in range(repeats + 1):
            prompts = [[(7 * r + 13 * i + j) % 200 + 3 for j in range(prompt_len)] for i in range(batch)]
            ids = [self.engine.add_request(p, SamplingParams(max_new_tokens=new_tokens + 1, ignore_eos=True))
                   for p in prompts]
            self.engine.step()  # prefill (+ first token)
            self.group.min_int(0)  # start together
            started = time.perf_counter()
            self.engine.run_until_finished(ids)
            seconds = time.perf_counter() - started
            if r:  # the first round warms up
                best = max(best, batch * new_tokens / seconds)
        return {"tok_s": best}

    def cmd_bench_diffusion(self, prompt_len: int, steps: int, repeats: int) -> dict[str, float]:
        from engine.compute.diffusion import Prompt

        runner = self.diffusion
        kv = runner.encode_prompt(Prompt.of([(5 * j) % 200 + 3 for j in range(prompt_len)]))
        runner.denoise([kv], seed=0, steps=1)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            self.group.min_int(0)
            started = time.perf_counter()
            runner.denoise([kv], seed=0, steps=steps)
            best = min(best, (time.perf_counter() - started) / steps)
        return {"step_s": best}
