"""`WeightedUnit`: a threaded unit whose one model lives in a `WeightStore` under one key.

The store is the worker's (`UnitContext.weights`, shared by every unit of the process, so
two roles of one model hold one copy) or, without a context, one of the unit's own. Closing
the unit releases its key, and closes the store when the store is its own.
"""

from __future__ import annotations

from engine.compute.context import UnitContext
from engine.compute.threaded import ThreadedUnit
from engine.compute.weights.store import WeightKey, WeightStore
from engine.spec.graph import RoleSpec


class WeightedUnit(ThreadedUnit):
    key: WeightKey
    """Set by the subclass's `__init__`: the store entry the unit holds until it closes."""

    def __init__(self, role: RoleSpec, ctx: UnitContext | None = None) -> None:
        super().__init__(role)
        shared = ctx.weights if ctx else None
        self._own_store = shared is None
        self.shared = shared if shared is not None else WeightStore()

    async def close(self) -> None:
        await super().close()
        self.shared.release(self.key)
        if self._own_store:
            self.shared.close()
