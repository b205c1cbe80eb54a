"""Greedy agreement with Hugging Face, where a batched kernel's rounding may flip a near-tie.

`check_greedy(reference, prompt, ours, theirs, tie)` passes when our greedy tokens equal HF's,
or when they first differ at a step where HF's own logits (the reference model run on the
prompt and HF's tokens so far) hold our token and HF's as its top two, less than `tie`
apart: a tie that rounding decides, not an error. Returns the step it forgave (None if
the sequences are equal), so a test can say how many ties it met.

`tie` is 1e-4 in float32. In bfloat16 the logits themselves are rounded to 8 significant bits
(a step of 2^-7 relative: 0.0625 at a logit of 10), so two correct implementations that round
differently disagree about ties that close; there `tie` is a few of those steps.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

FLOAT32_TIE = 1e-4


def bfloat16_tie(logit: float) -> float:
    """Four bfloat16 steps at the magnitude of `logit`."""
    return 4 * 2.0 ** (torch.tensor(abs(logit) or 1.0).log2().floor().item() - 7)


def check_greedy(reference: PreTrainedModel, prompt: list[int], ours: list[int], theirs: list[int],
                 tie: float | None = None) -> int | None:
    if ours == theirs:
        return None
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    assert step < min(len(ours), len(theirs)), f"lengths differ: {len(ours)} vs {len(theirs)} tokens"
    with torch.no_grad():
        ids = torch.tensor([prompt + theirs[:step]])
        logits = reference(ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
    top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    limit = tie if tie is not None else (FLOAT32_TIE if reference.dtype == torch.float32
                                         else bfloat16_tie(float(top.values[0])))
    assert {ours[step], theirs[step]} == set(top.indices.tolist()) and gap < limit, (
        f"greedy tokens differ at step {step} ({ours[step]} vs HF's {theirs[step]}) where HF's top two"
        f" {top.indices.tolist()} are {gap:.3g} apart (a near-tie is under {limit:.3g})")
    return step
