"""Named tiny model configurations: seeded random decoders for tests, demos and benchmarks.

Each entry is an immutable `ModelConfig`; `BUILTIN_MODELS` maps names to them. The
weights are drawn from the seed with an initialisation chosen so that next-token
distributions are *peaked* (see `InitScales`): on a near-uniform random model two
correct implementations disagree on greedy tokens through rounding alone, which makes
greedy comparisons meaningless.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

Family = Literal["llama", "qwen2"]



class Weights(enum.StrEnum):
    """What a model's weights are: trained (`real`), or drawn from a seed (`random`: the tiny
    built-in models, for tests and quick runs). `label` is how the catalogues show it."""

    REAL = "real"
    RANDOM = "random"

    @property
    def label(self) -> str:
        return "real weights" if self is Weights.REAL else "random weights (for testing)"


@dataclass(frozen=True, slots=True)
class InitScales:
    """Standard deviations of the seeded weights, relative to `1/sqrt(fan_in)` for projections.

    Unit-scale projections keep every sub-layer's output O(1), so attention (and with it
    the context) moves the residual stream as much as the current token's embedding
    does; a large `lm_head` scale widens the gap between the top logits, which makes
    greedy decoding robust to rounding. Special tokens' output rows are shrunk so a
    random model does not end its output on a stray EOS, and those of bytes outside
    printable ASCII so that its text is (random but) readable.
    """

    embed: float = 0.5
    qk: float = 2.0
    vo: float = 2.0
    mlp: float = 1.0
    bias: float = 0.1
    lm_head: float = 10.0
    special_rows: float = 0.05
    unprintable_rows: float = 0.3


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """The architecture of a decoder, as the model catalogue shows it and tensor parallelism
    checks it: every built-in LLM, seeded (`ModelConfig`) or packaged (`PackagedModel`), is one."""

    family: Family
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


@dataclass(frozen=True, slots=True)
class ModelConfig(DecoderShape):
    """Shape and seed of a tiny built-in decoder (a `transformers` Llama or Qwen2)."""

    name: str
    seed: int
    max_positions: int = 8192
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    description: str = ""
    init: InitScales = field(default_factory=InitScales)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


BUILTIN_MODELS: MappingProxyType[str, ModelConfig] = MappingProxyType(
    {
        cfg.name: cfg
        for cfg in (
            ModelConfig(
                name="tiny-llama",
                family="llama",
                hidden_size=64,
                num_layers=4,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=176,
                seed=1234,
                description="4-layer Llama, hidden 64, GQA 4:2, byte-level vocabulary",
            ),
            ModelConfig(
                name="tiny-qwen2",
                family="qwen2",
                hidden_size=64,
                num_layers=2,
                num_heads=4,
                num_kv_heads=1,
                intermediate_size=128,
                seed=4321,
                rope_theta=1000000.0,
                description="2-layer Qwen2 (q/k/v biases), hidden 64, GQA 4:1, byte-level vocabulary",
            ),
        )
    }
)
"""Built-in model configs by name (read-only)."""
