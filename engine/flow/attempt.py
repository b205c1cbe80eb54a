"""One attempt of one node: the `NodeCall` a run sends its dispatcher, and how the attempt ended.

`attempt` runs a node once through a `Dispatcher` within the node's `timeout_s` and says how it
ended: a `NodeResult`, or an `AttemptFailed` naming why (a `FinalNodeError` is final: retrying
cannot help). A streaming node's frames go to `on_frame` as they come; its result has no
outputs (they went out as frames). Whether to try again is the run's to decide (`retries`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from engine.flow.dispatch import Dispatcher
from engine.spec.calls import FinalNodeError, NodeCall, NodeContext, NodeResult, RanOn, node_tenant
from engine.spec.graph import NodeSpec, RoleSpec


@dataclass(frozen=True, slots=True)
class AttemptFailed:
    message: str
    final: bool = False
    """Retrying cannot help (the node said so with a `FinalNodeError`)."""


def node_call(run_id: str, tenant: str | None, spec: NodeSpec, inputs: dict[str, Any], *, iteration: int,
              attempt: int, owner: str | None = None) -> NodeCall:
    """The call for `spec`'s `iteration`-th activation, try `attempt`, in run `run_id` of `tenant`
    (None: the node's `tenant` param, if any) and `owner` (whose folder its output names are in)."""
    return NodeCall(
        run_id=run_id,
        node_id=spec.id,
        op=spec.op,
        params=spec.params,
        inputs=inputs,
        output_ports=tuple(spec.outputs),
        stream=spec.stream,
        router=spec.routes is not None,
        iteration=iteration,
        attempt=attempt,
        tenant=node_tenant(tenant, spec.params),
        kind=spec.kind,
        owner=owner,
    )


async def attempt(
    dispatcher: Dispatcher,
    role: RoleSpec,
    call: NodeCall,
    ctx: NodeContext,
    *,
    timeout_s: float | None,
    started: Callable[[RanOn], None],
    on_frame: Callable[[int, dict[str, Any]], Awaitable[None]],
) -> NodeResult | AttemptFailed:
    """Run `call` once on `role` (see the module docstring). A cancellation of the calling task
    propagates; one the node raised itself is a failed attempt."""
    try:
        if timeout_s is None and not call.stream:  # the common case: no deadline scope to enter (~2 us)
            return await dispatcher.execute(role, call, ctx, started)
        async with asyncio.timeout(timeout_s):
            if not call.stream:
                return await dispatcher.execute(role, call, ctx, started)
            frames = 0
            async for frame in dispatcher.execute_stream(role, call, ctx, started):
                await on_frame(frames, frame)
                frames += 1
            return NodeResult(outputs={})
    except asyncio.CancelledError:
        if _cancelling():
            raise
        return AttemptFailed("CancelledError raised by the node itself")
    except TimeoutError:
        return AttemptFailed(f"timed out after {timeout_s} s")
    except Exception as exc:  # noqa: BLE001 - a node's exception is its failure, reported in the run
        return AttemptFailed(f"{type(exc).__name__}: {exc}", final=isinstance(exc, FinalNodeError))


def _cancelling() -> bool:
    """Whether the calling task is being cancelled. (Not asked inline: a frame of the cancellation's
    traceback holding the task, which holds the cancellation, would be a reference cycle.)"""
    current = asyncio.current_task()
    return current is not None and current.cancelling() > 0
