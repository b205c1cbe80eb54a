"""Sampling: the step after the forward that turns a batch's logits into next tokens.

`SamplingParams` says how one request samples; `Sampler.sample` applies, per row:
penalties (repetition over prompt and output, frequency and presence over the output),
the request's logits processors, then either greedy argmax (`temperature == 0`) or
temperature, top-k, top-p and min-p filtering and a draw.

A request with a `seed` draws from its own generator seeded by `(seed, step)`, where
`step` is the index of the token being drawn, so its tokens depend neither on the
other requests in the batch nor on how its steps were scheduled.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]
"""`(output_token_ids, logits[vocab]) -> logits[vocab]`, applied after the penalties."""


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops. `temperature == 0` means greedy."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logits_processors: tuple[LogitsProcessor, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        checks = (
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0: off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be > 0"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
        )
        for name, ok, why in checks:
            if not ok:
                raise SamplingParamsError(f"{name}={getattr(self, name)!r} {why}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingParamsError(f"seed={self.seed!r} must be in [0, 2**63)")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must not be empty")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logits_processors)
        )


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One row of a batch: its params and the tokens the penalties look at."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


def step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed for draw number `step` of a request seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Penalties and logits processors of one row (`logits` is one vocabulary row; not modified)."""
    params = row.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long)
        if seen.numel():
            picked = logits[seen]
            picked = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
            logits = logits.clone()
            logits[seen] = picked
    if (params.frequency_penalty or params.presence_penalty) and row.output_ids:
        counts = torch.bincount(torch.tensor(row.output_ids, dtype=torch.long), minlength=logits.shape[0])
        counts = counts[: logits.shape[0]].to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    for processor in params.logits_processors:
        logits = processor(list(row.output_ids), logits)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p: returns scaled logits with the rest at -inf."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    """Turns `(batch, vocab)` logits into one token per row. `seed` feeds unseeded requests."""

    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def _generator_for(self, params: SamplingParams, step: int) -> torch.Generator:
        if params.seed is None:
            return self._generator
        return torch.Generator().manual_seed(step_seed(params.seed, step))

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """Next token of every row; `logits` is `(len(rows), vocab)`, float32, left unmodified."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        tokens: list[int | None] = [None] * len(rows)
        plain_greedy = [i for i, r in enumerate(rows) if r.params.greedy and not r.params.has_penalties]
        if plain_greedy:
            index = torch.tensor(plain_greedy, dtype=torch.long)
            for i, token in zip(plain_greedy, logits[index].argmax(-1).tolist(), strict=True):
                tokens[i] = token
        for i, row in enumerate(rows):
            if tokens[i] is not None:
                continue
            params = row.params
            adjusted = apply_penalties(logits[i], row) if params.has_penalties else logits[i]
            if params.greedy:
                tokens[i] = int(adjusted.argmax())
                continue
            probs = filter_logits(adjusted.float(), params).softmax(-1)
            generator = self._generator_for(params, len(row.output_ids))
            tokens[i] = int(torch.multinomial(probs, 1, generator=generator))
        return [int(t) for t in tokens if t is not None]
