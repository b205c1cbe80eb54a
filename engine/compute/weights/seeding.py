"""Seeded construction of modules, without touching the process's global random state."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

M = TypeVar("M", bound=torch.nn.Module)


def build_seeded(factory: Callable[[], M], seed: int) -> M:
    """`factory()` run with torch's CPU generator seeded by `seed`, in eval mode.

    The libraries' own initialisers (`transformers`, `diffusers`, `torch.nn`) draw from the
    global generator; its state is saved and restored around the call, so building a model
    never changes what other code draws. Same seed, same weights, on any machine.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = factory()
    return module.eval()
