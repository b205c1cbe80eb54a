"""The `python` role kind: runs the Python functions python nodes name.

A node's `op` is a registered op's name (`engine.spec.ops`), looked up in the unit's
`OpRegistry` and nothing else: no import, no attribute walk. A `module:function` op is
imported only where the unit's `OpConfig` allows module ops (the command line's trusted
mode); elsewhere it is refused, naming the node and the op.

Input ports and node params become keyword arguments; a function that takes `ctx`
gets the `NodeContext`. Coroutine functions are awaited on the event loop; plain
functions run in the unit's bounded thread pool, never on the loop that other runs share
(a slow op of one run does not stall the others); generators stream frames (a plain
generator in a thread of the pool, at most `READ_AHEAD` frames ahead of its reader). A
stream-mode input arrives as an async iterator to a coroutine function, and as a blocking
iterator to a plain function.

A call with an owner (`NodeCall.owner`: a server's run) has its output folder params (`out_dir`,
and those its registered op declares: `@op(output_dirs=...)`) resolved here, under this
process's users root (`UnitContext.users`) and the owner's folder, before the function sees
them (`engine.spec.userfiles.output_params`): the process that writes decides where, with the
same refusals (absolute names, `..`, links) wherever it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engine.compute.context import UnitContext
from engine.spec.calls import ComputeUnit, NodeCall, NodeContext, NodeResult, Route, map_frame, map_outputs
from engine.spec.graph import RoleSpec
from engine.spec.ops import OpConfig, OpNotAllowedError, UnknownOpError, attribute_path_message, default_ops
from engine.spec.userfiles import OwnerId, UsersRoot, output_params


class OperationError(LookupError):
    """A python node's `module:function` op does not name an importable function, or a
    node's function does not fit the node (a generator on a plain node, a router without routes)."""


@dataclass(frozen=True, slots=True)
class _Function:
    fn: Callable[..., Any]
    takes_ctx: bool
    is_coroutine: bool
    is_generator: bool
    is_async_generator: bool
    output_dirs: tuple[str, ...] = ()
    """The params its op declares as output folders (a registered op's `output_dirs`)."""


def resolve_function(op: str) -> Callable[..., Any]:
    """Import `module:function` and return the function: one attribute of the module, never an
    attribute path (`module:a.b` is refused before anything is imported). Trusted mode only: the
    caller has checked that module ops are allowed (`OpConfig.allow_module_ops`)."""
    module_name, sep, name = op.partition(":")
    if not sep or not module_name or not name:
        raise OperationError(f"operation {op!r} is not of the form 'module:function'")
    if "." in name:
        raise OpNotAllowedError(attribute_path_message(op))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise OperationError(f"operation {op!r}: cannot import module {module_name!r}: {exc}") from exc
    try:
        target = getattr(module, name)
    except AttributeError:
        raise OperationError(f"operation {op!r}: module {module_name!r} has no {name!r}") from None
    if not callable(target):
        raise OperationError(f"operation {op!r} names a {type(target).__name__}, not a function")
    return target


class _BlockingIterator(Iterator[Any]):
    """Reads an async iterator that lives on `loop` from a worker thread."""

    def __init__(self, source: AsyncIterator[Any], loop: asyncio.AbstractEventLoop) -> None:
        self._source = source
        self._loop = loop

    def __next__(self) -> Any:
        future = asyncio.run_coroutine_threadsafe(self._source.__anext__(), self._loop)
        try:
            return future.result()
        except StopAsyncIteration:
            raise StopIteration from None


def _threadsafe(ctx: NodeContext, loop: asyncio.AbstractEventLoop) -> NodeContext:
    """`ctx` for a function running in a worker thread: its progress reports reach the
    executor on its loop (in order, before the function's result does)."""
    report = ctx.report_progress
    return dataclasses.replace(ctx, report_progress=lambda f, m: loop.call_soon_threadsafe(report, f, m))


_DONE = object()


def _call_in_thread(loop: asyncio.AbstractEventLoop, holder: list[asyncio.Future[Any]], fn: Callable[..., Any],
                    kwargs: dict[str, Any]) -> None:
    """In a pool thread: `fn(**kwargs)`, its outcome handed to the future in `holder`, on its loop.
    The future leaves `holder` and this frame before the thread returns: a failure's traceback
    holds this frame and the pool's, and through them must not reach the future that holds the
    failure (a reference cycle: the run would wait for the cycle collector to be freed)."""
    done = holder.pop()
    try:
        value = fn(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - raised in the awaiting task instead
        loop.call_soon_threadsafe(_settle, done, None, exc)
    else:
        loop.call_soon_threadsafe(_settle, done, value, None)
    del done


def _settle(done: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    """Hand a pool call's outcome to its awaiting task (`PythonUnit._in_thread`), on the loop."""
    if done.cancelled():
        return
    if error is None:
        done.set_result(value)
    elif isinstance(error, concurrent.futures.CancelledError):
        done.set_exception(asyncio.CancelledError(*error.args))  # as `run_in_executor` hands it on
    elif isinstance(error, StopIteration):  # a future cannot hold one (PEP 479 wraps it alike)
        done.set_exception(RuntimeError(f"the function raised StopIteration: {error}"))
    else:
        done.set_exception(error)


class PythonUnit(ComputeUnit):
    READ_AHEAD = 2
    """Frames a plain generator makes beyond those its reader took."""

    def __init__(self, role: RoleSpec, ctx: UnitContext | None = None) -> None:
        """`ctx.ops`: the registered ops, and whether `module:function` ops may run (None: the
        command line's: every registered op and `module:function` ops, trusted code);
        `ctx.users`: where owners' folders are here (None: calls with an owner write nothing)."""
        self.role = role
        ops = ctx.ops if ctx else None
        self._ops = ops if ops is not None else OpConfig(default_ops(), allow_module_ops=True)
        self._users: UsersRoot | None = ctx.users if ctx else None
        self._functions: dict[str, _Function] = {}
        # A thread for every execution the role's replicas may run at once (one unit serves them
        # all in process): plain functions run here, off the loop other runs share, and a
        # generator waiting for its reader holds its thread (a reader left without one would
        # never free it).
        self._threads = ThreadPoolExecutor(
            max_workers=role.replicas * int(role.params.get("capacity", 64)), thread_name_prefix=f"omniflow-{role.name}"
        )

    def _function(self, call: NodeCall) -> _Function:
        op = call.op
        if op is None:
            raise UnknownOpError(f"node {call.node_id!r}: a python node needs an op (a registered op's name)")
        found = self._functions.get(op)
        if found is None:
            found = self._functions[op] = self._resolve(call.node_id, op)
        return found

    def _resolve(self, node_id: str, op: str) -> _Function:
        """The function `op` names: a registry lookup, or (module ops allowed) an import."""
        problem = self._ops.problem(op)
        if problem is not None:
            raise type(problem)(f"node {node_id!r}: {problem}")
        if op in self._ops.registry:
            entry = self._ops.registry.get(op)
            info = entry.info
            return _Function(fn=entry.fn, takes_ctx=info.takes_ctx, is_coroutine=info.is_coroutine,
                             is_generator=info.is_generator, is_async_generator=info.is_async_generator,
                             output_dirs=info.output_dirs)
        fn = resolve_function(op)
        try:
            takes_ctx = "ctx" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            takes_ctx = False
        # A module op naming a registered op's function writes where that op declares (as the
        # studio's path checks read it: `OpRegistry.find`).
        registered = self._ops.registry.find(op)
        return _Function(
            fn=fn,
            takes_ctx=takes_ctx,
            is_coroutine=inspect.iscoroutinefunction(fn),
            is_generator=inspect.isgeneratorfunction(fn),
            is_async_generator=inspect.isasyncgenfunction(fn),
            output_dirs=() if registered is None else registered.info.output_dirs,
        )

    def _kwargs(self, call: NodeCall, ctx: NodeContext, func: _Function, blocking: bool) -> dict[str, Any]:
        kwargs = dict(call.inputs)
        if blocking:
            loop = asyncio.get_running_loop()
            for name, value in kwargs.items():
                if isinstance(value, AsyncIterator):
                    kwargs[name] = _BlockingIterator(value, loop)
        owner = None if call.owner is None else OwnerId(call.owner)
        kwargs.update(output_params(call.params, func.output_dirs, self._users, owner, node_id=call.node_id))
        if func.takes_ctx:
            kwargs["ctx"] = _threadsafe(ctx, asyncio.get_running_loop()) if blocking else ctx
        return kwargs

    async def execute(self, call: NodeCall, ctx: NodeContext) -> NodeResult:
        func = self._function(call)
        if func.is_generator or func.is_async_generator:
            raise OperationError(f"node {call.node_id!r}: {call.op} is a generator; mark the node stream=True")
        if func.is_coroutine:
            value = await func.fn(**self._kwargs(call, ctx, func, blocking=False))
        else:
            value = await self._in_thread(func.fn, self._kwargs(call, ctx, func, blocking=True))
        route = None
        if isinstance(value, Route):
            if not call.router:
                raise OperationError(f"node {call.node_id!r} returned a Route but declares no routes")
            route, value = value.to, value.value
        elif call.router:
            raise OperationError(f"router node {call.node_id!r} must return Route(to=..., value=...)")
        return NodeResult(outputs=map_outputs(value, call.output_ports, call.node_id), route=route)

    async def _in_thread(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """`fn(**kwargs)` in the unit's pool, awaited here: `run_in_executor`'s contract (a call the
        awaiting task gave up before it started never runs; progress the function reported on the
        way arrives first), but the function's own thread wakes the loop as soon as it returns,
        before the pool's bookkeeping, and one future is settled instead of two chained."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        job = self._threads.submit(_call_in_thread, loop, [done], fn, kwargs)
        try:
            return await done
        except asyncio.CancelledError:
            job.cancel()  # not started: it never will be
            raise
        finally:
            del done  # a failure's traceback holds this frame, which must not hold the failure's future

    async def execute_stream(self, call: NodeCall, ctx: NodeContext) -> AsyncIterator[dict[str, Any]]:
        func = self._function(call)
        if func.is_async_generator:
            async for item in func.fn(**self._kwargs(call, ctx, func, blocking=False)):
                yield map_frame(item, call.output_ports, call.node_id)
            return
        if not func.is_generator:
            raise OperationError(f"streaming node {call.node_id!r}: {call.op} must be a generator function")
        loop = asyncio.get_running_loop()
        frames: asyncio.Queue[Any] = asyncio.Queue()
        kwargs = self._kwargs(call, ctx, func, blocking=True)
        # The generator runs in one thread, at most READ_AHEAD frames ahead of the frames taken
        # from it: a reader that stops taking them (back-pressure) stops the generator too.
        room = threading.Semaphore(self.READ_AHEAD)
        stop = threading.Event()

        def produce() -> None:
            try:
                items = func.fn(**kwargs)
                try:
                    while True:
                        room.acquire()
                        if stop.is_set():
                            return
                        try:
                            item = next(items)
                        except StopIteration:
                            break
                        loop.call_soon_threadsafe(frames.put_nowait, (item, None))
                finally:
                    items.close()
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
                loop.call_soon_threadsafe(frames.put_nowait, (_DONE, exc))
                return
            loop.call_soon_threadsafe(frames.put_nowait, (_DONE, None))

        loop.run_in_executor(self._threads, produce)
        try:
            while True:
                item, error = await frames.get()
                if item is _DONE:
                    if error is not None:
                        raise error
                    return
                room.release()
                yield map_frame(item, call.output_ports, call.node_id)
        finally:
            # A reader that leaves (cancelled, or done early) ends the generator at its next frame.
            stop.set()
            room.release()

    async def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
