"""A SGLang sampling backend that draws with our `engine.compute.sampling.Sampler`.

`register()` (also the `sglang.srt.plugins` entry point) calls
`sglang.srt.layers.sampler.register_sampler_backend("omniflow", OmniFlowSampler)`;
SGLang then uses it with `--sampling-backend omniflow`.

How SGLang's batch maps onto our rows: SGLang applies penalties, grammar masks and
bias before the sampler, so each row is only temperature, top-k, top-p and min-p. A
row with `top_k <= 1` is greedy (SGLang turns `temperature == 0` into `top_k = 1`);
`top_k` at or above the vocabulary means no top-k. A row with a `sampling_seed` draws
from our per-request generator with the token's *position* as the step
(`step_seed(seed, position)`), so a seeded token depends on neither the batch nor the
schedule. Logprobs, when asked for, are the log-softmax of the logits (as SGLang's
greedy path reports them). Tensor parallel ranks are not synchronised: run it with
tp_size 1, or with seeded requests only.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.sampler import Sampler as SGLangSampler
from sglang.srt.layers.sampler import register_sampler_backend

from engine.compute.sampling import Sampler, SamplingParams, SamplingRow

BACKEND_NAME = "omniflow"


def rows_from_sampling_info(sampling_info: Any, positions: torch.Tensor | None) -> list[SamplingRow]:
    """Our sampling rows for a SGLang `SamplingBatchInfo` (see the module docstring for the rules)."""
    temperatures = sampling_info.temperatures.reshape(-1).tolist()
    top_ks = sampling_info.top_ks.reshape(-1).tolist()
    top_ps = sampling_info.top_ps.reshape(-1).tolist()
    min_ps = sampling_info.min_ps.reshape(-1).tolist()
    seeds = (
        sampling_info.sampling_seed.reshape(-1).tolist() if sampling_info.sampling_seed is not None else None
    )
    steps = positions.reshape(-1).tolist() if positions is not None else [0] * len(temperatures)
    vocab = int(sampling_info.vocab_size)
    rows = []
    for i, temperature in enumerate(temperatures):
        top_k = int(top_ks[i])
        if top_k <= 1:
            params = SamplingParams(temperature=0.0)
        else:
            params = SamplingParams(
                temperature=float(temperature),
                top_k=0 if top_k >= vocab else top_k,
                top_p=float(top_ps[i]),
                min_p=float(min_ps[i]),
                seed=int(seeds[i]) % 2**63 if seeds is not None else None,
            )
        # The draw index is the token's position: only its length is read (no penalties here).
        rows.append(SamplingRow(params=params, prompt_ids=(), output_ids=range(int(steps[i]))))
    return rows


class OmniFlowSampler(SGLangSampler):
    """SGLang's sampler interface, drawing with Omni-Flow's sampler."""

    def __init__(self, seed: int | None = None) -> None:
        torch.nn.Module.__init__(self)  # not SGLang's: it needs the parallel state only its kernels use
        self.sampler = Sampler(seed)

    def forward(
        self,
        logits_output: Any,
        sampling_info: Any,
        return_logprob: bool,
        top_logprobs_nums: list[int],
        token_ids_logprobs: list[list[int]],
        positions: torch.Tensor,
        *,
        logprob_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        logits = self._preprocess_logits(logits_output.next_token_logits, sampling_info)
        rows = rows_from_sampling_info(sampling_info, positions)
        tokens = self.sampler.sample(logits.detach().float().cpu(), rows)
        next_ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        if return_logprob:
            from sglang.srt.layers.logprob_processor import OutputLogprobProcessor

            source = logprob_logits if logprob_logits is not None else logits
            logprobs = torch.log_softmax(source.float(), dim=-1)
            result = OutputLogprobProcessor().compute_logprobs(
                logprobs, top_logprobs_nums, token_ids_logprobs, next_ids
            )
            result.write_output_to(logits_output)
        return next_ids


def register(name: str = BACKEND_NAME) -> None:
    """Make `--sampling-backend omniflow` (or `name`) available in this process."""
    register_sampler_backend(name, OmniFlowSampler)
