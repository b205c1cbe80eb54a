"""Building compute units in process with what the process shares (`UnitContext`).

`SharedUnits` builds the units of an in-process dispatcher (`omniflow run --workers inproc`,
the studio's runs without a deployment) as a worker process builds its own, with one
`WeightStore` for all of them (the `llm` and `diffusion` roles of one model share its module)
and the ops the caller allows.
"""

from __future__ import annotations

from engine.compute.context import UnitContext
from engine.compute.weights.store import WeightStore
from engine.spec.calls import ComputeUnit
from engine.spec.graph import RoleSpec
from engine.spec.kinds import KindRegistry
from engine.spec.ops import OpConfig
from engine.spec.userfiles import UsersRoot


class SharedUnits:
    """`(role) -> unit` for `InProcessDispatcher(build=...)`: every unit built with one
    `WeightStore` (in-process sharing only: no host segments, no CUDA IPC), and python units with
    `ops` (what the caller allows: the command line all, a studio its setting) and `users` (where
    this host keeps its owners' folders: a studio's `<data dir>/users`; None: the command line's)."""

    def __init__(self, kinds: KindRegistry, *, ops: OpConfig, users: UsersRoot | None = None) -> None:
        self._kinds = kinds
        self.weights = WeightStore()
        self._ctx = UnitContext(weights=self.weights, ops=ops, users=users)

    def __call__(self, role: RoleSpec) -> ComputeUnit:
        return self._kinds.role_kind(role.kind).load_runner()(role, self._ctx)
