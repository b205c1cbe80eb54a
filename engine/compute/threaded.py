"""`ThreadedUnit`: a compute unit whose node calls run one at a time in a thread of its own.

Model forwards block for milliseconds to seconds; running them on the event loop would
stall every other node of the worker. torch releases the GIL in its kernels, so a thread
is enough. Units that batch (the `llm` unit) have their own loop; the encoder, decoder
and diffusion units serve one call at a time through this.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.spec.calls import ComputeUnit, FinalNodeError, NodeCall
from engine.spec.graph import RoleSpec

T = TypeVar("T")


class UnitInputError(FinalNodeError, ValueError):
    """A node call whose inputs or params the unit cannot take; the message names the node.
    Final: the same call fails the same way on any replica, so it is never retried."""


class ThreadedUnit(ComputeUnit):
    def __init__(self, role: RoleSpec) -> None:
        self.role = role
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"omniflow-{role.name}")

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    @staticmethod
    async def joined_inputs(call: NodeCall) -> dict[str, Any]:
        """Inputs with stream-mode ones gathered: text frames joined, token frames concatenated,
        others listed."""
        inputs = dict(call.inputs)
        for name, value in call.inputs.items():
            if isinstance(value, AsyncIterator):
                frames = [frame async for frame in value]
                if frames and all(isinstance(f, str) for f in frames):
                    inputs[name] = "".join(frames)
                elif frames and all(isinstance(f, list | tuple) for f in frames):
                    inputs[name] = [t for f in frames for t in f]
                else:
                    inputs[name] = frames
        return inputs

    async def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
