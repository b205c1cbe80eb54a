"""The `llm` compute unit: hosts one `LLMEngine` for a role and serves `llm` nodes.

The engine loop runs in a thread of its own (torch releases the GIL in its kernels):
node executions on the event loop send it commands (add, abort) through a queue and
receive the engine's outputs through per-request asyncio queues. Concurrent node
executions are batched together by the engine (continuous batching).

Node inputs: `prompt` (text) or `tokens` (token ids), either may be a stream (its frames
are joined). Outputs: `text`, `tokens` and `kv` (a reference to the KV pages of prompt +
output: model id, layout and page keys; the pages stay cached in this worker, unpinned).
A streaming node yields one frame per token (`text` delta, `tokens`) and the `kv`
reference last. Param `session` runs the call as a turn of that server-side session
(opened on first use): only the new message is sent.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.errors import LLMError, RequestError
from engine.compute.llm.sequence import FinishReason, RequestOutput
from engine.compute.models.loader import load_model
from engine.compute.sampling import SamplingParams
from engine.spec.calls import ComputeUnit, NodeCall, NodeContext, NodeResult, map_frame, map_outputs
from engine.spec.graph import RoleSpec

SAMPLING_PARAMS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
)


class LLMUnitError(LLMError):
    """A node call the unit cannot run (bad inputs, a failed generation)."""


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    session_id: str | None
    tenant_salt: str | None
    stream_text: bool


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


_STOP = object()


class LLMUnit(ComputeUnit):
    """Constructed from a `RoleSpec` of kind `llm`: `model` is a built-in name or a checkpoint dir."""

    def __init__(self, role: RoleSpec) -> None:
        self.role = role
        ref = role.model
        if not ref:
            raise LLMUnitError(f"llm role {role.name!r} needs a model (a built-in name or a checkpoint directory)")
        model = load_model(path=ref) if Path(ref).is_dir() else load_model(name=ref)
        self.engine = LLMEngine(model, EngineConfig.from_params(role.params))
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._thread = threading.Thread(target=self._loop, name=f"omniflow-llm-{role.name}", daemon=True)
        self._thread.start()

    # -- engine thread --------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: Any) -> None:
        with self._lock:
            target = self._subscribers.get(request_id)
        if target is not None:
            loop, inbox = target
            loop.call_soon_threadsafe(inbox.put_nowait, item)

    def _apply(self, command: Any) -> None:
        engine = self.engine
        if isinstance(command, _Abort):
            if engine.has_request(command.request_id):
                engine.abort(command.request_id)
            return
        try:
            if command.session_id is not None and not engine.has_session(command.session_id):
                engine.open_session(command.session_id, tenant_salt=command.tenant_salt)
            engine.add_request(
                command.prompt,
                command.params,
                request_id=command.request_id,
                session_id=command.session_id,
                tenant_salt=None if command.session_id else command.tenant_salt,
                stream_text=command.stream_text,
            )
        except LLMError as exc:
            self._deliver(command.request_id, exc)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished()
            try:
                # Idle: wait for work (waking now and then to expire idle sessions). Busy: take
                # whatever was queued, so it joins the next step, then step.
                command = self._commands.get(timeout=1.0) if idle else self._commands.get_nowait()
            except queue.Empty:
                if idle:
                    engine.expire_sessions()
                else:
                    for out in engine.step():
                        self._deliver(out.request_id, out)
                continue
            if command is _STOP:
                return
            self._apply(command)

    # -- event loop side -------------------------------------------------------------------------

    def _prompt(self, call: NodeCall) -> str | list[int]:
        prompt, tokens = call.inputs.get("prompt"), call.inputs.get("tokens")
        if (prompt is None) == (tokens is None):
            raise LLMUnitError(f"node {call.node_id!r}: give exactly one of the inputs 'prompt' (text) or 'tokens'")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise LLMUnitError(f"node {call.node_id!r}: input 'prompt' must be text, not {type(prompt).__name__}")
            return prompt
        if not isinstance(tokens, list | tuple) or not all(isinstance(t, int) for t in tokens):
            raise LLMUnitError(f"node {call.node_id!r}: input 'tokens' must be a list of token ids")
        return list(tokens)

    async def _joined(self, call: NodeCall) -> NodeCall:
        """Stream-mode inputs arrive as async iterators: join their frames into one value."""
        inputs = dict(call.inputs)
        for name, value in call.inputs.items():
            if isinstance(value, AsyncIterator):
                frames = [frame async for frame in value]
                inputs[name] = "".join(frames) if all(isinstance(f, str) for f in frames) else [
                    t for f in frames for t in (f if isinstance(f, list | tuple) else [f])
                ]
        return NodeCall(call.run_id, call.node_id, call.op, call.params, inputs, call.output_ports, call.stream,
                        call.router, call.iteration, call.attempt)

    def _submit(self, call: NodeCall, stream: bool) -> tuple[str, asyncio.Queue[Any]]:
        params = {k: v for k, v in call.params.items() if k in SAMPLING_PARAMS}
        for key in ("stop", "stop_token_ids"):
            if key in params:
                params[key] = tuple(params[key])
        try:
            sampling = SamplingParams(**params)
        except (TypeError, ValueError) as exc:
            raise LLMUnitError(f"node {call.node_id!r}: {exc}") from exc
        prompt = self._prompt(call)
        with self._lock:
            self._counter += 1
            request_id = f"{call.run_id}:{call.node_id}:{call.iteration}:{call.attempt}:{self._counter}"
            inbox: asyncio.Queue[Any] = asyncio.Queue()
            self._subscribers[request_id] = (asyncio.get_running_loop(), inbox)
        self._commands.put(_Add(request_id, prompt, sampling, call.params.get("session"), call.params.get("tenant"),
                                stream_text=stream))
        return request_id, inbox

    def _kv_ref(self, out: RequestOutput) -> dict[str, Any]:
        return {
            "model_id": self.engine.model_id,
            "layout": self.engine.layout.to_dict(),
            "pages": list(out.kv_pages),
            "tokens": out.prompt_tokens + len(out.output_ids),
        }

    async def _outputs(self, call: NodeCall, stream: bool) -> AsyncIterator[RequestOutput]:
        request_id, inbox = self._submit(await self._joined(call), stream)
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    raise LLMUnitError(f"node {call.node_id!r}: {item}") from item
                if item.finished and item.finish_reason is FinishReason.ERROR:
                    raise LLMUnitError(f"node {call.node_id!r}: generation failed: {item.error}")
                yield item
                if item.finished:
                    return
        finally:
            with self._lock:
                done = self._subscribers.pop(request_id, None)
            if done is not None:
                self._commands.put(_Abort(request_id))  # cancelled or failed mid-way: stop it

    async def execute(self, call: NodeCall, ctx: NodeContext) -> NodeResult:
        final = None
        async for out in self._outputs(call, stream=False):
            final = out
        assert final is not None
        values = {"text": final.text, "tokens": list(final.output_ids), "kv": self._kv_ref(final)}
        ports = call.output_ports
        value = values[ports[0]] if len(ports) == 1 else {p: values[p] for p in ports if p in values}
        return NodeResult(outputs=map_outputs(value, ports, call.node_id))

    async def execute_stream(self, call: NodeCall, ctx: NodeContext) -> AsyncIterator[dict[str, Any]]:
        async for out in self._outputs(call, stream=True):
            frame: dict[str, Any] = {"text": out.text_delta, "tokens": list(out.new_token_ids)}
            if out.finished:
                frame["kv"] = self._kv_ref(out)
            yield map_frame({p: v for p, v in frame.items() if p in call.output_ports}, call.output_ports,
                            call.node_id)

    async def close(self) -> None:
        self._commands.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.engine.close()


__all__ = ["LLMUnit", "LLMUnitError", "RequestError"]
