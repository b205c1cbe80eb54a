"""Building compute units with what their process shares: its `WeightStore` (roles of one
model hold one copy of its weights) and, for a worker, its KV store.

`build_unit(runner, role, **shared)` passes a unit only the shared things its constructor
takes (the `python` unit takes the process's `OpConfig`, `ops=`). `SharedUnits` builds the
units of an in-process dispatcher (`omniflow run --workers inproc`, the studio's runs without
a deployment) as a worker process builds its own, with one `WeightStore` for all of them: the
`llm` and `diffusion` roles of one model share its module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from engine.compute.weights.store import WeightStore
from engine.spec.calls import ComputeUnit
from engine.spec.graph import RoleSpec
from engine.spec.kinds import KindRegistry
from engine.spec.ops import OpConfig


def accepted_kwargs(runner: Callable[..., Any]) -> set[str]:
    """The keyword arguments `runner` (a unit class) takes: its `accepts` attribute if it has
    one, else the keyword-only or keyword parameters of its constructor."""
    declared = getattr(runner, "accepts", None)
    if declared is not None:
        return set(declared)
    try:
        params = inspect.signature(runner).parameters
    except (TypeError, ValueError):
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return {"shared", "kv_store"}
    return {name for name, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def build_unit(runner: Callable[..., Any], role: RoleSpec, **shared: Any) -> Any:
    """`runner(role, **shared)`, passing only what the unit accepts (and nothing that is None)."""
    accepted = accepted_kwargs(runner)
    return runner(role, **{k: v for k, v in shared.items() if v is not None and k in accepted})


class SharedUnits:
    """`(role) -> unit` for `InProcessDispatcher(build=...)`: every unit built with one
    `WeightStore` (in-process sharing only: no host segments, no CUDA IPC), and python units with
    `ops` (what the caller allows: the command line all, a studio its setting)."""

    def __init__(self, kinds: KindRegistry, *, ops: OpConfig) -> None:
        self._kinds = kinds
        self._ops = ops
        self.weights = WeightStore()

    def __call__(self, role: RoleSpec) -> ComputeUnit:
        return build_unit(self._kinds.role_kind(role.kind).load_runner(), role, shared=self.weights, ops=self._ops)
