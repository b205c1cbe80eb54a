"""The engine thread of an `llm` unit: one thread drives one `LLMEngine`.

Node executions run on an event loop; the engine runs in a thread of its own (torch releases
the GIL in its kernels). The two meet here: an execution `submit`s an `AddRequest` (the loop
names the request and gives it an inbox), the thread applies commands between steps (add,
abort, hold, release) and delivers each `RequestOutput` to the request's inbox, and the
execution reads them with `outputs` (leaving early aborts the request). Concurrent requests
are batched by the engine (continuous batching).

Holds: a prefill handoff's pages stay locked while its hold token lives in the worker's
tensor store (`Hold`); the thread looks every `HOLD_POLL_S` whether the decode side let go
(or the token's lease ran out) and releases the pages then.

Failure: if the engine raises, every request in flight fails with the reason, `failed` says
it (the worker's health check stops the worker, to be replaced), and every later command is
refused until `close`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.errors import LLMError, LLMUnitError, RequestError
from engine.compute.llm.sequence import FinishReason, RequestOutput
from engine.compute.llm.transfer import KVHandoff
from engine.compute.prefix.keys import MultimodalItem
from engine.compute.sampling import SamplingParams
from engine.data.kv.source import PageSource
from engine.data.tensor_store import RefNotFound, TensorStore

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0
"""How long an idle engine thread sleeps before it expires idle sessions."""
HOLD_POLL_S = 0.05
"""How often the engine thread looks whether a decode side let go of a handoff."""


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Admit a request (a session turn opens or refreshes its session first, see `apply_add`)."""

    request_id: str
    prompt: str | list[int] | None
    params: SamplingParams
    session_id: str | None
    tenant_salt: str | None
    stream_text: bool
    prefill_only: bool = False
    handoff: KVHandoff | None = None
    source: PageSource | None = None
    mm_items: tuple[MultimodalItem, ...] = ()
    history: str | list[int] | None = None
    turns: int | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Hold:
    """Keep handoff `handoff_id`'s pages locked while hold token `ref_id` lives in the tensor store."""

    handoff_id: str
    ref_id: str


@dataclass(frozen=True, slots=True)
class Release:
    handoff_id: str


_STOP = object()


class EngineLoop:
    """The thread, its command queue and the requests' inboxes (see the module docstring).

    `holds_store` gives the tensor store hold tokens live in (the worker's seat on the transfer
    plane; None before it has one). A tensor-parallel rank 0 extends `apply`, `release`,
    `failure` and `refuse` with its own commands.
    """

    def __init__(self, engine: LLMEngine, name: str, holds_store: Callable[[], TensorStore | None]) -> None:
        self.engine = engine
        self.name = name
        self._holds_store = holds_store
        self._holds: dict[str, str] = {}  # handoff id -> hold token ref id (engine thread only)
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._inboxes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self.failed: str | None = None
        """Why the engine can serve no more calls (its thread failed); None while it can."""
        self.sessions_resumed = 0
        """Sessions opened here with the history a turn brought (`AddRequest.history`)."""
        self._thread = threading.Thread(target=self._main, name=f"omniflow-llm-{name}", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    # -- event loop side ----------------------------------------------------------------------------

    def open(self, call_id: str) -> tuple[str, asyncio.Queue[Any]]:
        """A request id for one request of call `call_id`, and the inbox its outputs arrive in."""
        if self.failed is not None:
            raise LLMUnitError(self.failed)
        with self._lock:
            self._counter += 1
            request_id = f"{call_id}#{self._counter}"
            inbox: asyncio.Queue[Any] = asyncio.Queue()
            self._inboxes[request_id] = (asyncio.get_running_loop(), inbox)
        return request_id, inbox

    def discard(self, request_id: str) -> None:
        """Forget an opened request that was never queued (its caller failed before)."""
        with self._lock:
            self._inboxes.pop(request_id, None)

    def put(self, command: Any) -> None:
        self._commands.put(command)

    async def outputs(self, node_id: str, request_id: str, inbox: asyncio.Queue[Any]) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one opened request; aborts it if the caller stops early."""
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    raise LLMUnitError(f"node {node_id!r}: {item}") from item
                if item.finished and item.finish_reason is FinishReason.ERROR:
                    raise LLMUnitError(f"node {node_id!r}: generation failed: {item.error}")
                yield item
                if item.finished:
                    return
        finally:
            with self._lock:
                done = self._inboxes.pop(request_id, None)
            if done is not None:
                self._commands.put(Abort(request_id))  # cancelled or failed mid-way: stop it

    async def close(self) -> None:
        self._commands.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # -- engine thread ------------------------------------------------------------------------------

    def deliver(self, request_id: str, item: Any) -> None:
        with self._lock:
            target = self._inboxes.get(request_id)
        if target is not None:
            loop, inbox = target
            loop.call_soon_threadsafe(inbox.put_nowait, item)

    def apply(self, command: Any) -> None:
        if isinstance(command, Abort):
            if self.engine.has_request(command.request_id):
                self.engine.abort(command.request_id)
        elif isinstance(command, Hold):
            self._holds[command.handoff_id] = command.ref_id
        elif isinstance(command, Release):
            self.release(command.handoff_id)
        else:
            self.apply_add(command)

    def apply_add(self, command: AddRequest) -> None:
        engine = self.engine
        try:
            prompt, mm_items, resumed = command.prompt, command.mm_items, False
            session_id = command.session_id
            if session_id is not None and command.turns is not None and engine.has_session(session_id):
                info = engine.session_info(session_id)
                # A stale copy (it moved away and back), or one opened for a resumed turn that then
                # failed (turns, but no history): the turn's history wins.
                stale = info.turns != command.turns or (info.turns > 0 and info.tokens == 0)
                if stale and not info.busy:
                    engine.close_session(session_id)
            if session_id is not None and not engine.has_session(session_id):
                engine.open_session(session_id, tenant_salt=command.tenant_salt,
                                    turns=command.turns if command.history and command.turns else 0)
                if command.history:
                    prompt, mm_items = _after_history(engine, command.history, prompt, mm_items)
                    resumed = True
            engine.add_request(
                prompt, command.params, request_id=command.request_id, session_id=session_id,
                tenant_salt=None if session_id else command.tenant_salt, stream_text=command.stream_text,
                prefill_only=command.prefill_only, handoff=command.handoff, source=command.source,
                mm_items=mm_items,
            )
            self.sessions_resumed += resumed
        except LLMError as exc:
            self.deliver(command.request_id, exc)

    def release(self, handoff_id: str) -> None:
        try:
            self.engine.release_handoff(handoff_id)
        except LLMError as exc:  # never let a bookkeeping slip stop the engine thread
            log.warning("releasing handoff %s: %s", handoff_id, exc)

    def failure(self, exc: Exception) -> str:
        return f"llm role {self.name!r}: the engine failed: {type(exc).__name__}: {exc}"

    def refuse(self, command: Any, error: LLMUnitError) -> None:
        """Answer a command the failed engine will not run."""
        if isinstance(command, AddRequest):
            self.deliver(command.request_id, error)

    def _check_holds(self) -> None:
        """Release every handoff whose hold token is gone (released by the decode side, or expired)."""
        store = self._holds_store()
        if not self._holds or store is None:
            return
        for handoff_id, ref_id in list(self._holds.items()):
            try:
                store.get(ref_id)  # type: ignore[arg-type]
            except RefNotFound:
                del self._holds[handoff_id]
                self.release(handoff_id)

    def _main(self) -> None:
        try:
            self._serve()
        except Exception as exc:
            log.exception("llm role %r: the engine thread failed", self.name)
            self._fail(self.failure(exc))

    def _fail(self, reason: str) -> None:
        """The engine cannot go on: fail every request in flight and, until stopped, every new command."""
        error = LLMUnitError(reason)
        with self._lock:
            pending = list(self._inboxes)
        for request_id in pending:
            self.deliver(request_id, error)
        self.failed = reason  # after: the worker's health check acts on it (new calls are refused below)
        while True:
            command = self._commands.get()
            if command is _STOP:
                return
            self.refuse(command, error)

    def _serve(self) -> None:
        engine = self.engine
        checked = time.monotonic()
        while True:
            idle = not engine.has_unfinished()
            now = time.monotonic()
            if now - checked >= HOLD_POLL_S:
                self._check_holds()
                checked = now
            try:
                # Idle: wait for work (waking now and then to expire idle sessions and to see
                # handoffs let go). Busy: take whatever was queued, so it joins the next step, then step.
                wait = HOLD_POLL_S if self._holds else IDLE_WAIT_S
                command = self._commands.get(timeout=wait) if idle else self._commands.get_nowait()
            except queue.Empty:
                if idle:
                    engine.expire_sessions()
                else:
                    for out in engine.step():
                        self.deliver(out.request_id, out)
                continue
            if command is _STOP:
                return
            self.apply(command)


def _after_history(engine: LLMEngine, history: str | list[int], prompt: str | list[int] | None,
                   items: tuple[MultimodalItem, ...]) -> tuple[list[int], tuple[MultimodalItem, ...]]:
    """A session turn's prompt when the session had to be opened here: `history`, then the
    turn (each encoded on its own, as a session's turns are), its items moved past the history."""
    head = engine.encode(history) if isinstance(history, str) else [int(t) for t in history]
    if prompt is None:
        raise RequestError("a request needs a prompt")
    tail = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return head + tail, tuple(item.shifted(len(head)) for item in items)
