"""The `llm` compute unit: hosts one `LLMEngine` for a role and serves the `llm` node kinds.

The engine loop runs in a thread of its own (torch releases the GIL in its kernels):
node executions on the event loop send it commands (add, abort, hold) through a queue and
receive the engine's outputs through per-request asyncio queues. Concurrent node
executions are batched together by the engine (continuous batching).

Node kinds (`engine.compute.kinds`), told apart by their fixed ports (see `node_mode`):

* `llm`: `prompt` (text) or `tokens` in, either possibly a stream (its frames are
  joined); `text`, `tokens` and `kv` out (a `KVRef` to the KV pages of prompt + output:
  model id, layout, page keys, and the worker caching them; unpinned). A streaming node yields
  one frame per token (`text` delta, `tokens`) and the `kv` reference last. Param `session`
  runs the call as a turn of that server-side session (opened on first use). With
  `session_history` (text or token ids: what the session holds before this turn, re-encoded
  from text where given as text) and `session_turns` (how many turns that is), a worker that
  does not hold the session (it began on a replica since lost) opens it with that history
  before the turn, instead of without it; and one whose copy has another number of turns
  (the session moved away and back, or a turn failed here) replaces its copy so.
* `llm.prefill`: the prompt in, `kv` out: a `KVRef` with a `KVHold` (computed prompt KV held
  for a decode node, and the first token).
* `llm.decode`: a handoff in as `kv`; pulls the prompt's pages and its partial last page
  from the prefill worker over the transfer plane (off the engine thread), lets the
  prefill worker go (releases the hold token once the pages are locked here), then decodes:
  `text`, `tokens`, `kv` out, like `llm`. A handoff feeds one decode node: the first one
  ends the hold, so a second one fails unless its prompt ends on a page boundary and the
  pages are still cached (fan-out sampling belongs in one decode request).

Tenants: a call's `tenant` (`NodeCall.tenant`, the run's) salts every page key it computes (the
engine's prefix tree has a root per model and tenant) and scopes its session (`session` of
tenant A and `session` of tenant B are two sessions, `NodeCall.session_key`); a decode node
takes only its own tenant's handoffs. So one tenant's KV is never a hit for another's prompt, and
`cached_tokens` tells a caller only about its own tenant's pages.

The transfer plane: a worker process hands the unit its `Peer` (`bind_transfer`) and serves
the unit's `kv_store` to other workers; a unit that was not given one (in-process dispatch)
starts its own the first time a prefill or decode node needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import msgspec
import torch

from engine.compute.encoders.items import PLACEHOLDER_IDS, splice_prompt
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.errors import LLMError, LLMUnitError, RequestError
from engine.compute.llm.media import encoded_items, splice_marked, splice_marked_text
from engine.compute.llm.sequence import FinishReason, RequestOutput
from engine.compute.llm.transfer import KVHandoff, handoff_of
from engine.compute.models.loader import MODEL_DTYPES, LoadedModel, load_model
from engine.compute.prefix.keys import MultimodalItem
from engine.compute.sampling import SamplingParams
from engine.compute.weights.store import WeightKey, WeightStore
from engine.data.channel import RefGone, TransferError
from engine.data.kv.errors import KVTransferError
from engine.data.kv.keys import ExtraKeys, page_hashes
from engine.data.kv.layout import KVLayout
from engine.data.kv.pull import KVHolderIndex, KVPageServer, fetch_pages
from engine.data.kv.ref import KVHold, KVHolder, KVRef, KVRefError
from engine.data.kv.source import HolderPageSource, IndexPageSource, PageSource
from engine.data.kv.store import KVStore
from engine.data.peer import Peer, PeerConfig
from engine.data.tensor_store import RefNotFound
from engine.data.wire import ReleaseRequest, TensorRef
from engine.spec.calls import ComputeUnit, NodeCall, NodeContext, NodeResult, map_frame, map_outputs
from engine.spec.graph import RoleSpec
from engine.spec.progress import ProgressMeter
from engine.spec.usage import Usage

log = logging.getLogger(__name__)

SAMPLING_PARAMS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
)
HANDOFF_LEASE_S = 60.0
KV_PULL_TIMEOUT_S = 10.0
_IDLE_WAIT_S = 1.0
_HOLD_POLL_S = 0.05
"""How often the engine thread looks whether a decode side let go of a handoff."""
_RELEASE_TIMEOUT_S = 5.0


class NodeMode(StrEnum):
    """The llm node kind a call comes from."""

    GENERATE = "llm"
    PREFILL = "llm.prefill"
    DECODE = "llm.decode"


def check_handoff_tenant(call: NodeCall, ref: KVRef, page_size: int) -> None:
    """A decode call takes only its own tenant's handoffs: the pages a handoff names must be
    the page keys of its prompt under the call's tenant (under the handoff's own tenant when the
    call has none: the command line), so a handoff of another tenant's run, however relabelled,
    never reads that run's KV."""
    tenant = call.tenant if call.tenant is not None else ref.tenant_salt
    count = len(ref.page_hashes)
    own = (ref.tenant_salt == tenant and count * page_size <= len(ref.key_ids)
           and page_hashes(list(ref.key_ids[: count * page_size]), page_size,
                           extra_keys=ExtraKeys(model_id=ref.model_id, tenant_salt=tenant)) == list(ref.page_hashes))
    if not own:
        raise LLMUnitError(f"node {call.node_id!r}: input 'kv': the handoff belongs to another tenant's run")


def node_mode(call: NodeCall) -> NodeMode:
    """Which llm node kind `call` belongs to.

    A `NodeCall` does not carry its node's kind, but the llm kinds fix their ports and
    validation holds every node to them exactly, so the port sets tell them apart: only
    `llm.decode` has an input `kv`, only `llm.prefill` has `kv` as its only output.
    """
    if "kv" in call.inputs:
        return NodeMode.DECODE
    if tuple(call.output_ports) == ("kv",):
        return NodeMode.PREFILL
    return NodeMode.GENERATE


@dataclass(frozen=True, slots=True)
class _Add:
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
class _Pulled:
    """What a decode call pulled for its handoff: how many pages, from which prefill worker."""

    pages: int = 0
    source: KVHolder | None = None


_NOTHING_PULLED = _Pulled()


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Hold:
    """Keep handoff `handoff_id`'s pages locked while hold token `ref_id` lives in the tensor store."""

    handoff_id: str
    ref_id: str


@dataclass(frozen=True, slots=True)
class _Release:
    handoff_id: str


_STOP = object()


def _positive(role: RoleSpec, name: str, default: float) -> float:
    value = role.params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise LLMUnitError(f"llm role {role.name!r}: {name} must be a positive number, got {value!r}")
    return float(value)


class LLMUnit(ComputeUnit):
    """Constructed from a `RoleSpec` of kind `llm`: `model` is a built-in name or a checkpoint dir.

    Worker integration (duck-typed by `engine.worker.kv`): `kv_store` is the engine's store
    (the worker serves it to other workers and publishes it to the KV index), `kv_meta()`
    what a router needs to hash prompts like this engine, `bind_transfer()` hands the unit
    the worker's seat on the transfer plane.
    """

    def __init__(self, role: RoleSpec, *, shared: WeightStore | None = None,
                 kv_store: KVStore | None = None) -> None:
        self.role = role
        ref = role.model
        if not ref:
            raise LLMUnitError(f"llm role {role.name!r} needs a model (a built-in name or a checkpoint directory)")
        self.handoff_lease_s = _positive(role, "handoff_lease_s", HANDOFF_LEASE_S)
        self.pull_timeout_s = _positive(role, "kv_pull_timeout_s", KV_PULL_TIMEOUT_S)
        self.shared = shared
        self._weight_key: WeightKey | None = None
        dtype = role.params.get("dtype", "float32")
        if dtype not in MODEL_DTYPES:
            raise LLMUnitError(f"llm role {role.name!r}: dtype must be one of {sorted(MODEL_DTYPES)}, got {dtype!r}")
        if shared is not None:  # the worker's per-process store: roles of one model share its weights
            model_ref = str(Path(ref).resolve()) if Path(ref).is_dir() else ref
            model = shared.llm(model_ref, role.device, dtype)
            self._weight_key = WeightStore.llm_key(model_ref, role.device, dtype)
        else:
            model = load_model(path=ref, dtype=dtype) if Path(ref).is_dir() else load_model(name=ref, dtype=dtype)
        self.engine = self._build_engine(model, EngineConfig.from_params(role.params), kv_store)
        # Whether the tokenizer has the media markers as tokens of their own (the tiny built-in models'
        # byte tokenizer does): only then are they found among a token prompt's ids.
        self._id_markers = all(model.tokenizer.convert_ids_to_tokens(token) == f"<|{kind}|>"
                               for kind, token in PLACEHOLDER_IDS.items())
        self.engine.cache.pull_timeout_s = self.pull_timeout_s
        self.worker_id: str | None = None
        self._peer: Peer | None = None
        self._own_peer = False
        self._page_server: KVPageServer | None = None
        self._holds: dict[str, str] = {}  # handoff id -> hold token ref id (engine thread only)
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self.failed: str | None = None
        """Why the engine can serve no more calls (its thread failed); None while it can."""
        self.sessions_resumed = 0
        """Sessions opened here with the history a turn brought (`session_history`)."""
        self._thread = threading.Thread(target=self._loop, name=f"omniflow-llm-{role.name}", daemon=True)
        self._thread.start()

    def _build_engine(self, model: LoadedModel, config: EngineConfig, kv_store: KVStore | None) -> LLMEngine:
        """The engine the unit drives (a tensor-parallel unit builds its rank's engine here)."""
        return LLMEngine(model, config, store=kv_store)

    # -- worker integration ---------------------------------------------------------------------

    @property
    def kv_store(self) -> KVStore:
        return self.engine.store

    def kv_meta(self) -> dict[str, Any]:
        """How this engine names its pages: a router hashes token ids with these to find holders."""
        return {
            "model_id": self.engine.model_id,
            "page_size": self.engine.layout.page_size,
            "layout": self.engine.layout.fingerprint(),
            "prefix_cache": self.engine.config.prefix_cache,
        }

    def bind_transfer(self, peer: Peer, worker_id: str, index: KVHolderIndex | None = None) -> None:
        """Use the worker's `peer` (which serves `kv_store`); with `index`, prefix matching also
        pulls pages that other workers hold. Call once, before the first node call."""
        if self._peer is not None:
            raise LLMUnitError(f"llm role {self.role.name!r}: the unit is already bound to a transfer plane")
        self._peer, self.worker_id = peer, worker_id
        if index is not None and self.engine.config.prefix_cache:
            self.engine.cache.peers.append(IndexPageSource(peer, index))

    def _transfer(self) -> Peer:
        """The transfer plane: the worker's, or (in-process dispatch) one of the unit's own."""
        with self._lock:
            if self._peer is None:
                self._peer = Peer.start(PeerConfig())
                self._own_peer = True
                self._page_server = KVPageServer(self.engine.store, self._peer.server)
            return self._peer

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
        if isinstance(command, _Hold):
            self._holds[command.handoff_id] = command.ref_id
            return
        if isinstance(command, _Release):
            self._release(command.handoff_id)
            return
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
                prompt,
                command.params,
                request_id=command.request_id,
                session_id=command.session_id,
                tenant_salt=None if command.session_id else command.tenant_salt,
                stream_text=command.stream_text,
                prefill_only=command.prefill_only,
                handoff=command.handoff,
                source=command.source,
                mm_items=mm_items,
            )
            self.sessions_resumed += resumed
        except LLMError as exc:
            self._deliver(command.request_id, exc)

    def _check_holds(self) -> None:
        """Release every handoff whose hold token is gone (released by the decode side, or expired)."""
        peer = self._peer
        if not self._holds or peer is None:
            return
        for handoff_id, ref_id in list(self._holds.items()):
            try:
                peer.store.get(ref_id)  # type: ignore[arg-type]
            except RefNotFound:
                del self._holds[handoff_id]
                self._release(handoff_id)

    def _release(self, handoff_id: str) -> None:
        try:
            self.engine.release_handoff(handoff_id)
        except LLMError as exc:  # never let a bookkeeping slip stop the engine thread
            log.warning("releasing handoff %s: %s", handoff_id, exc)

    def _loop(self) -> None:
        try:
            self._serve()
        except Exception as exc:
            log.exception("llm role %r: the engine thread failed", self.role.name)
            self._fail(self._failure(exc))

    def _failure(self, exc: Exception) -> str:
        return f"llm role {self.role.name!r}: the engine failed: {type(exc).__name__}: {exc}"

    def _fail(self, reason: str) -> None:
        """The engine cannot go on: fail every request in flight and, until stopped, every new
        command (the worker's health check sees `failed` and stops the worker, to be replaced)."""
        error = LLMUnitError(reason)
        with self._lock:
            pending = list(self._subscribers)
        for request_id in pending:
            self._deliver(request_id, error)
        self.failed = reason  # after: the worker's health check acts on it (new calls are refused below)
        while True:
            command = self._commands.get()
            if command is _STOP:
                return
            self._refuse(command, error)

    def _refuse(self, command: Any, error: LLMUnitError) -> None:
        if isinstance(command, _Add):
            self._deliver(command.request_id, error)

    def health(self) -> str | None:
        return self.failed

    def _serve(self) -> None:
        engine = self.engine
        checked = time.monotonic()
        while True:
            idle = not engine.has_unfinished()
            now = time.monotonic()
            if now - checked >= _HOLD_POLL_S:
                self._check_holds()
                checked = now
            try:
                # Idle: wait for work (waking now and then to expire idle sessions and to see
                # handoffs let go). Busy: take whatever was queued, so it joins the next step, then step.
                wait = _HOLD_POLL_S if self._holds else _IDLE_WAIT_S
                command = self._commands.get(timeout=wait) if idle else self._commands.get_nowait()
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

    def _multimodal(self, call: NodeCall, prompt: str | list[int]) -> tuple[str | list[int],
                                                                           tuple[MultimodalItem, ...]]:
        """Splice the optional `items`/`embeds` inputs into the prompt (see `encoded_items`)."""
        encoded = encoded_items(call.node_id, call.inputs.get("items"), call.inputs.get("embeds"))
        if not encoded:
            return prompt, ()
        try:
            if isinstance(prompt, str):
                spliced = splice_marked_text(prompt, encoded, self.engine.encode)
            elif self._id_markers:
                spliced = splice_marked(list(prompt), encoded, self.engine.encode)
            else:  # a real model's ids 259/260 are ordinary tokens, never markers: the items go first
                spliced = splice_prompt([*encoded, list(prompt)], self.engine.encode)
        except ValueError as exc:
            raise LLMUnitError(f"node {call.node_id!r}: {exc}") from None
        return spliced.token_ids, tuple(spliced.items)

    async def _joined(self, call: NodeCall) -> NodeCall:
        """Stream-mode inputs arrive as async iterators: join their frames into one value."""
        inputs = dict(call.inputs)
        for name, value in call.inputs.items():
            if isinstance(value, AsyncIterator):
                frames = [frame async for frame in value]
                inputs[name] = "".join(frames) if all(isinstance(f, str) for f in frames) else [
                    t for f in frames for t in (f if isinstance(f, list | tuple) else [f])
                ]
        return dataclasses.replace(call, inputs=inputs)

    @staticmethod
    def _sampling(node_id: str, params: dict[str, Any]) -> SamplingParams:
        picked = {k: v for k, v in params.items() if k in SAMPLING_PARAMS}
        for key in ("stop", "stop_token_ids"):
            if key in picked:
                picked[key] = tuple(picked[key])
        try:
            return SamplingParams(**picked)
        except (TypeError, ValueError) as exc:
            raise LLMUnitError(f"node {node_id!r}: {exc}") from exc

    def _submit(self, call: NodeCall, stream: bool, *, prompt: str | list[int] | None,
                sampling: SamplingParams, prefill_only: bool = False, handoff: KVHandoff | None = None,
                source: PageSource | None = None,
                mm_items: tuple[MultimodalItem, ...] = ()) -> tuple[str, asyncio.Queue[Any]]:
        if self.failed is not None:
            raise LLMUnitError(self.failed)
        with self._lock:
            self._counter += 1
            request_id = f"{call.call_id}#{self._counter}"
            inbox: asyncio.Queue[Any] = asyncio.Queue()
            self._subscribers[request_id] = (asyncio.get_running_loop(), inbox)
        session = None if handoff is not None else call.session_key()
        history, turns = call.params.get("session_history"), call.params.get("session_turns")
        if history is not None and session is None:
            raise LLMUnitError(f"node {call.node_id!r}: param 'session_history' needs param 'session'")
        if turns is not None and history is None:
            raise LLMUnitError(f"node {call.node_id!r}: param 'session_turns' needs param 'session_history'")
        self._commands.put(_Add(request_id, prompt, sampling, session, call.tenant,
                                stream_text=stream, prefill_only=prefill_only, handoff=handoff, source=source,
                                mm_items=mm_items, history=history, turns=turns))
        return request_id, inbox

    async def _run(self, call: NodeCall, request_id: str, inbox: asyncio.Queue[Any]) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one submitted request; aborts it if the caller stops early."""
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

    def _holder(self) -> KVHolder | None:
        """This worker as the holder of pages it computed (None: not on a transfer plane yet)."""
        return KVHolder(self._peer.address, self.worker_id) if self._peer is not None else None

    def _kv_ref(self, out: RequestOutput, pulled: _Pulled) -> KVRef:
        layout = self.engine.layout
        return KVRef(
            model_id=self.engine.model_id, page_size=layout.page_size, layout=layout.to_dict(),
            page_hashes=tuple(out.kv_pages), prompt_ids=out.prompt_ids, output_ids=out.output_ids,
            tokens=out.prompt_tokens + len(out.output_ids),
            prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens, holder=self._holder(),
            pulled_pages=pulled.pages, pulled_from=pulled.source,
        )

    # -- generate (`llm`) and decode (`llm.decode`) -----------------------------------------------

    async def _outputs(self, call: NodeCall, stream: bool) -> AsyncIterator[tuple[RequestOutput, _Pulled]]:
        """Engine outputs of a generating call (`llm` or `llm.decode`), each with what a decode pulled."""
        call = await self._joined(call)
        if node_mode(call) is NodeMode.DECODE:
            async for item in self._decode(call, stream):
                yield item
            return
        prompt, items = self._multimodal(call, self._prompt(call))
        request_id, inbox = self._submit(call, stream, prompt=prompt, mm_items=items,
                                         sampling=self._sampling(call.node_id, call.params))
        async for out in self._run(call, request_id, inbox):
            yield out, _NOTHING_PULLED

    def _meter(self, call: NodeCall, ctx: NodeContext) -> ProgressMeter:
        """Tokens generated out of the node's `max_new_tokens`, reported as the engine makes them."""
        return ProgressMeter(ctx.progress, self._sampling(call.node_id, call.params).max_new_tokens, "tokens").start()

    async def execute(self, call: NodeCall, ctx: NodeContext) -> NodeResult:
        if node_mode(call) is NodeMode.PREFILL:
            ref = await self._prefill(await self._joined(call))
            return NodeResult(outputs=map_outputs(ref, call.output_ports, call.node_id))
        last = None
        meter = self._meter(call, ctx)
        async for item in self._outputs(call, stream=False):
            meter.advance(len(item[0].new_token_ids))
            last = item
        assert last is not None
        final, pulled = last
        values = {"text": final.text, "tokens": list(final.output_ids), "kv": self._kv_ref(final, pulled),
                  "usage": _usage(final)}
        ports = call.output_ports
        value = values[ports[0]] if len(ports) == 1 else {p: values[p] for p in ports if p in values}
        return NodeResult(outputs=map_outputs(value, ports, call.node_id))

    async def execute_stream(self, call: NodeCall, ctx: NodeContext) -> AsyncIterator[dict[str, Any]]:
        if node_mode(call) is NodeMode.PREFILL:
            yield map_frame(await self._prefill(await self._joined(call)), call.output_ports, call.node_id)
            return
        meter = self._meter(call, ctx)
        async for out, pulled in self._outputs(call, stream=True):
            meter.advance(len(out.new_token_ids))
            frame: dict[str, Any] = {"text": out.text_delta, "tokens": list(out.new_token_ids)}
            if out.finished:
                frame["kv"] = self._kv_ref(out, pulled)
                frame["usage"] = _usage(out)
            yield map_frame({p: v for p, v in frame.items() if p in call.output_ports}, call.output_ports,
                            call.node_id)

    # -- prefill/decode disaggregation --------------------------------------------------------------

    async def _prefill(self, call: NodeCall) -> KVRef:
        """Compute the prompt's KV and first token; hold the pages for a decode node (see `KVHold`)."""
        peer = self._transfer()
        sampling = self._sampling(call.node_id, call.params)
        request_id, inbox = self._submit(call, False, prompt=self._prompt(call), sampling=sampling,
                                         prefill_only=True)
        final = None
        async for out in self._run(call, request_id, inbox):
            final = out
        assert final is not None
        engine = self.engine
        handoff = final.handoff
        layout = self._handoff_layout()
        sampling = {k: v for k, v in call.params.items() if k in SAMPLING_PARAMS}
        ref = KVRef(model_id=engine.model_id, page_size=int(layout["page_size"]), layout=layout,
                    tokens=final.prompt_tokens, prompt_tokens=final.prompt_tokens,
                    cached_tokens=final.cached_tokens, tenant_salt=call.tenant,
                    holder=KVHolder(peer.address, self.worker_id))
        if handoff is None:  # the first token ended the generation: nothing to hand off
            prompt = self._prompt(call)
            ids = tuple(engine.encode(prompt) if isinstance(prompt, str) else prompt)
            hold = KVHold(handoff_id=request_id, first_token=final.output_ids[0],
                          finish_reason=str(final.finish_reason), sampling=sampling)
            return msgspec.structs.replace(ref, prompt_ids=ids, key_ids=ids, hold=hold)
        with contextlib.ExitStack() as undo:
            undo.callback(self._commands.put, _Release(handoff.handoff_id))  # no hold token: free the pages
            tail = await self._handoff_tail(handoff)
            token = tail if handoff.tail_len else torch.tensor([handoff.first_token])
            held = peer.put(token, self.handoff_lease_s)
            undo.pop_all()
        self._commands.put(_Hold(handoff.handoff_id, held.id))
        hold = KVHold(handoff_id=handoff.handoff_id, first_token=handoff.first_token, tail_len=handoff.tail_len,
                      token=held, sampling=sampling)
        return msgspec.structs.replace(ref, page_hashes=tuple(handoff.page_hashes), prompt_ids=handoff.prompt_ids,
                                       key_ids=handoff.key_ids, tenant_salt=handoff.tenant_salt, hold=hold)

    def _handoff_layout(self) -> dict[str, Any]:
        """The KV layout a handoff's pages are served in (a tensor-parallel unit: the whole model's)."""
        return self.engine.layout.to_dict()

    async def _handoff_tail(self, handoff: KVHandoff) -> torch.Tensor | None:
        """The partial last page as the decode side pulls it (a tensor-parallel unit gathers it and
        the pages from its ranks first); if it raises, the handoff is released."""
        return handoff.tail

    def _handoff_ref(self, call: NodeCall) -> tuple[KVRef, KVHold]:
        """The call's input `kv`, checked to be a prefill hand-off of this role's model, layout
        (`_handoff_layout`) and tenant."""
        layout = KVLayout.from_dict(self._handoff_layout())
        try:
            ref = KVRef.for_role(call.inputs["kv"], self.engine.model_id, layout)
            hold = ref.handoff
        except KVRefError as exc:
            raise LLMUnitError(f"node {call.node_id!r}: input 'kv': {exc}") from None
        check_handoff_tenant(call, ref, layout.page_size)
        return ref, hold

    def _pull_handoff(self, peer: Peer, ref: KVRef, holder: KVHolder, hold: KVHold,
                      node_id: str) -> tuple[int, torch.Tensor | None]:
        """Blocking (run in a thread): bring the handoff's pages into the store and fetch its tail.
        Returns (pages pulled, tail)."""
        pages = list(ref.page_hashes)
        deadline = time.monotonic() + self.pull_timeout_s
        where = f"prefill worker {holder.worker_id or '?'} at {holder.address}"
        try:
            have = self.engine.store.resident_run(pages)
            pulled = 0
            if have < len(pages):
                got = fetch_pages(self.engine.store, peer, holder.address, pages[have:], self.pull_timeout_s).pages
                pulled = len(got)
                if have + pulled < len(pages):
                    raise LLMUnitError(f"node {node_id!r}: {where} holds only {have + pulled} of the prompt's"
                                       f" {len(pages)} KV pages (its hold on them ended?)")
            tail = None
            if hold.tail_len:
                assert hold.token is not None
                remaining = max(0.001, deadline - time.monotonic())
                tail = peer.pull(hold.token, remaining).torch().clone()  # a shared-memory view is the holder's
        except RefGone as exc:
            # One handoff feeds one decode node: the first to take it ends the hold.
            raise LLMUnitError(f"node {node_id!r}: {where} no longer holds this handoff (another llm.decode"
                               f" node took it, or its handoff_lease_s ran out): {exc}") from exc
        except (KVTransferError, TransferError) as exc:
            raise LLMUnitError(f"node {node_id!r}: cannot pull the prompt's KV from {where} within"
                               f" {self.pull_timeout_s} s: {exc}") from exc
        return pulled, tail

    def _let_go(self, peer: Peer, ref: TensorRef) -> None:
        """Release the hold token at the prefill worker without waiting (its lease ends it anyway)."""
        if ref.owner == peer.address:
            peer.store.release(ref.id)
            return
        peer.client.call(ref.owner, lambda rid: ReleaseRequest(rid, ref.id), _RELEASE_TIMEOUT_S)

    async def _decode(self, call: NodeCall, stream: bool) -> AsyncIterator[tuple[RequestOutput, _Pulled]]:
        ref, hold = self._handoff_ref(call)
        sampling = self._sampling(call.node_id, {**hold.sampling, **call.params})
        if hold.finish_reason is not None:
            yield self._finished_at_prefill(ref, hold), _Pulled(0, ref.holder)
            return
        if hold.token is None or ref.holder is None:
            raise LLMUnitError(f"node {call.node_id!r}: input 'kv': a handoff without a hold token or holder")
        token, holder = hold.token, ref.holder
        peer = self._transfer()
        released = False
        try:
            count, tail = await asyncio.to_thread(self._pull_handoff, peer, ref, holder, hold, call.node_id)
            pulled = _Pulled(count, holder)
            request_id, inbox = self._submit(call, stream, prompt=None, sampling=sampling,
                                             handoff=handoff_of(ref, tail),
                                             source=HolderPageSource(peer, holder.address))
            async for out in self._run(call, request_id, inbox):
                if not released:  # admitted: the pages are locked here now
                    released = True
                    self._let_go(peer, token)
                yield out, pulled
        finally:
            if not released:
                self._let_go(peer, token)

    def _finished_at_prefill(self, ref: KVRef, hold: KVHold) -> RequestOutput:
        token = hold.first_token
        return RequestOutput(
            request_id=hold.handoff_id, new_token_ids=(token,), text_delta=self.engine.decode_text([token]),
            finished=True, finish_reason=FinishReason(hold.finish_reason), output_ids=(token,),
            text=self.engine.decode_text([token]), prompt_tokens=len(ref.prompt_ids),
            cached_tokens=ref.cached_tokens, prompt_ids=ref.prompt_ids,
        )

    def metrics(self) -> dict[str, float]:
        """The engine's `llm.*` counters (generated tokens, hit rate, queue sizes); the KV
        store's tier metrics are reported by the worker's KV hosting."""
        metrics = {k: float(v) for k, v in self.engine.metrics().items() if k.startswith("llm.")}
        metrics["llm.sessions_resumed"] = float(self.sessions_resumed)
        return metrics

    # -- shutdown ------------------------------------------------------------------------------------

    async def close(self) -> None:
        self._commands.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self._page_server is not None:
            self._page_server.close()
        if self._own_peer and self._peer is not None:
            self._peer.close()
        self.engine.close()
        if self.shared is not None and self._weight_key is not None:
            self.shared.release(self._weight_key)


def _usage(out: RequestOutput) -> dict[str, Any]:
    """The `usage` output of a finished generation (see `engine.spec.usage`)."""
    reason = out.finish_reason
    if reason not in (FinishReason.STOP, FinishReason.LENGTH):
        raise LLMUnitError(f"request {out.request_id}: a generation that ended as {reason} has no usage")
    return Usage(prompt_tokens=out.prompt_tokens, completion_tokens=len(out.output_ids),
                 cached_tokens=out.cached_tokens, finish_reason=str(reason)).to_value()


def _after_history(engine: LLMEngine, history: str | list[int], prompt: str | list[int] | None,
                   items: tuple[MultimodalItem, ...]) -> tuple[list[int], tuple[MultimodalItem, ...]]:
    """A session turn's prompt when the session had to be opened here: `history`, then the
    turn (each encoded on its own, as a session's turns are), its items moved past the history."""
    head = engine.encode(history) if isinstance(history, str) else [int(t) for t in history]
    if prompt is None:
        raise RequestError("a request needs a prompt")
    tail = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return head + tail, tuple(item.shifted(len(head)) for item in items)


__all__ = ["LLMUnit", "LLMUnitError", "NodeMode", "RequestError", "node_mode"]
