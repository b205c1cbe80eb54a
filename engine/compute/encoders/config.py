"""What the built-in encoders share: a small seeded transformer behind a front end of their own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """A built-in encoder's transformer: `num_layers` layers of width `hidden_size`, `num_heads`
    heads and `intermediate_size` MLPs, its weights drawn from `seed` (`build_seeded`). What feeds
    it (mel frames, image patches) is the subclass's."""

    name: str
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 64
    seed: int = 0
    description: str = ""
