"""Dispatchers hand node executions to compute units.

The executor never runs a model itself: it asks a `Dispatcher` to execute a
`NodeCall` on a role. `InProcessDispatcher` hosts the units in this process (the
embedded mode and tests); the worker dispatcher sends them to role worker processes.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from engine.spec.calls import ComputeUnit, NodeCall, NodeContext, NodeResult, RanOn
from engine.spec.graph import RoleSpec
from engine.spec.kinds import KindRegistry


class Dispatcher(Protocol):
    async def execute(
        self, role: RoleSpec, call: NodeCall, ctx: NodeContext, started: Callable[[RanOn], None]
    ) -> NodeResult:
        """Run `call` on a unit of `role`; call `started(where)` when it leaves the queue."""
        ...

    def execute_stream(
        self, role: RoleSpec, call: NodeCall, ctx: NodeContext, started: Callable[[RanOn], None]
    ) -> AsyncIterator[dict[str, Any]]:
        """Run a streaming node: yields its frames (port -> value)."""
        ...

    async def close(self) -> None: ...


def loading_message(role: RoleSpec) -> str:
    """What a node queued for `role`'s unit, which loads its model, reports meanwhile."""
    return f"loading {role.model} (role {role.name})"


class InProcessDispatcher:
    """Runs every role's unit in this process. A role runs at most
    `replicas x capacity` node executions at once; the rest wait their turn (queued).
    A role's `tp_size` takes no processes here: its whole model runs in this one (the same
    tokens; tensor parallelism decides where the heads are computed, not what).

    A role's unit is built on its first call, on a thread of the loop's default executor: building
    one loads its model (seconds), and the loop runs every other run meanwhile (in the studio it
    also answers the metrics sampler and renews the runs' leases). Calls that come while it builds
    wait for that one build; a build that fails is not kept, so the role's next call builds again.
    A call of a role with a model that waits for its unit says so while it is queued: a progress
    report with no fraction, `loading_message(role)` (the run view shows what its nodes wait for)."""

    DEFAULT_CAPACITY = 64
    SEEN_ROLES = 1024

    def __init__(self, kinds: KindRegistry, *, build: Callable[[RoleSpec], ComputeUnit] | None = None) -> None:
        """`build(role)` makes a role's unit (default: its kind's runner, `runner(role)`, with no
        context: each unit its own weights, python units the command line's ops, every registered
        op plus `module:function` ops; `engine.worker.units.SharedUnits` builds units that share
        their weights and run only the ops it is given)."""
        self._kinds = kinds
        self._build = build if build is not None else self._runner
        self._units: dict[tuple[str, str], ComputeUnit] = {}
        self._slots: dict[tuple[str, str], asyncio.Semaphore] = {}
        self._building: dict[tuple[str, str], asyncio.Task[ComputeUnit]] = {}
        self._seen: dict[int, tuple[RoleSpec, ComputeUnit, asyncio.Semaphore]] = {}
        """By role object (a plan's, the same for each of its calls): its unit and slots, so that a
        call does not render the role again to find them. The role is held, so its id stays its own."""
        self.where = RanOn(worker=f"in-process:{os.getpid()}", host=socket.gethostname())
        """Where its calls run: this process."""

    def _runner(self, role: RoleSpec) -> ComputeUnit:
        return self._kinds.role_kind(role.kind).load_runner()(role)

    def _key(self, role: RoleSpec) -> tuple[str, str]:
        # Roles of different workflows may share a name; the spec itself tells them apart.
        return (role.name, repr(role))

    def _known(self, role: RoleSpec) -> tuple[ComputeUnit, asyncio.Semaphore] | None:
        """`role`'s unit and slots when a call of this very role object (a plan passes the same one
        to each of its calls) found them before: no rendering of the role, no coroutine."""
        seen = self._seen.get(id(role))
        return (seen[1], seen[2]) if seen is not None and seen[0] is role else None

    async def _unit(self, role: RoleSpec, ctx: NodeContext) -> tuple[ComputeUnit, asyncio.Semaphore]:
        key = self._key(role)
        unit = self._units.get(key)
        if unit is None:
            building = self._building.get(key)
            if building is None:
                building = self._building[key] = asyncio.get_running_loop().create_task(self._load(key, role))
            if role.model is not None:  # a model to load, for seconds (a python unit is built at once)
                ctx.progress(None, loading_message(role))
            # Shielded: a call cancelled while it waits leaves the build to the others (and the next call).
            unit = await asyncio.shield(building)
        if len(self._seen) >= self.SEEN_ROLES:  # a server planning runs afresh: keep the memory bounded
            self._seen.clear()
        self._seen[id(role)] = (role, unit, self._slots[key])
        return unit, self._slots[key]

    async def _load(self, key: tuple[str, str], role: RoleSpec) -> ComputeUnit:
        try:
            unit = await asyncio.to_thread(self._build, role)
        finally:
            del self._building[key]
        capacity = int(role.params.get("capacity", self.DEFAULT_CAPACITY))
        self._slots[key] = asyncio.Semaphore(role.replicas * capacity)
        self._units[key] = unit
        return unit

    async def execute(
        self, role: RoleSpec, call: NodeCall, ctx: NodeContext, started: Callable[[RanOn], None]
    ) -> NodeResult:
        unit, slots = self._known(role) or await self._unit(role, ctx)
        async with slots:
            started(self.where)
            return await unit.execute(call, ctx)

    async def execute_stream(
        self, role: RoleSpec, call: NodeCall, ctx: NodeContext, started: Callable[[RanOn], None]
    ) -> AsyncIterator[dict[str, Any]]:
        unit, slots = self._known(role) or await self._unit(role, ctx)
        async with slots:
            started(self.where)
            async for frame in unit.execute_stream(call, ctx):
                yield frame

    async def close(self) -> None:
        """Close every unit, those still being built once they are (a thread cannot be stopped mid-build)."""
        await asyncio.gather(*self._building.values(), return_exceptions=True)
        units, self._units = list(self._units.values()), {}
        self._slots = {}
        self._seen.clear()
        for unit in units:
            await unit.close()
