"""The `llm` compute unit: hosts one `LLMEngine` for a role and serves the `llm` node kinds.

The unit turns node calls into engine requests; the engine runs in a thread of its own
(`loop.py`), which batches concurrent calls (continuous batching); the prefill/decode kinds
live in `pd.py`, and what a call asks (kind, prompt, sampling) is read by `nodes.py`.

Node kinds (`engine.compute.kinds`; `nodes.node_mode`):

* `llm`: `prompt` (text) or `tokens` in, either possibly a stream (its frames are
  joined); `text`, `tokens`, `usage` and `kv` out (a `KVRef` to the KV pages of prompt + output:
  model id, layout, page keys, and the worker caching them; unpinned). A streaming node yields
  one frame per token (`text` delta, `tokens`) and the `kv` reference and usage last. Param
  `session` runs the call as a turn of that server-side session (opened on first use). With
  `session_history` (text or token ids: what the session holds before this turn, re-encoded
  from text where given as text) and `session_turns` (how many turns that is), a worker that
  does not hold the session (it began on a replica since lost) opens it with that history
  before the turn, instead of without it; and one whose copy has another number of turns
  (the session moved away and back, or a turn failed here) replaces its copy so.
* `llm.prefill` and `llm.decode`: prefill/decode disaggregation (`pd.py`).

Tenants: a call's `tenant` (`NodeCall.tenant`, the run's) salts every page key it computes (the
engine's prefix tree has a root per model and tenant) and scopes its session (`session` of
tenant A and `session` of tenant B are two sessions, `NodeCall.session_key`); a decode node
takes only its own tenant's handoffs. So one tenant's KV is never a hit for another's prompt, and
`cached_tokens` tells a caller only about its own tenant's pages.

The transfer plane: a worker process hands the unit its seat (`UnitContext.seat`: its `Peer`,
worker id and KV index) and serves the unit's `kv_store` to other workers; a unit that was not
given one (in-process dispatch) starts its own peer the first time a prefill or decode node needs it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from engine.compute.context import UnitContext
from engine.compute.encoders.items import PLACEHOLDER_IDS, splice_prompt
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.errors import LLMUnitError, RequestError
from engine.compute.llm.loop import AddRequest, EngineLoop
from engine.compute.llm.media import encoded_items, splice_marked, splice_marked_text
from engine.compute.llm.nodes import NodeMode, joined, node_mode, node_prompt, node_sampling, usage
from engine.compute.llm.pd import HANDOFF_LEASE_S, KV_PULL_TIMEOUT_S, NOTHING_PULLED, PrefillDecode, Pulled
from engine.compute.llm.products import native_bfloat16
from engine.compute.llm.sequence import RequestOutput
from engine.compute.models.loader import MODEL_DTYPES, LoadedModel, load_model
from engine.compute.prefix.keys import MultimodalItem
from engine.compute.weights.store import WeightKey, WeightStore
from engine.data.kv.pull import KVPageServer
from engine.data.kv.ref import KVHolder, KVRef
from engine.data.kv.source import IndexPageSource, PageSource
from engine.data.kv.store import KVStore
from engine.data.peer import Peer, PeerConfig
from engine.data.tensor_store import TensorStore
from engine.spec.calls import ComputeUnit, NodeCall, NodeContext, NodeResult, map_frame, map_outputs
from engine.spec.graph import RoleSpec
from engine.spec.progress import ProgressMeter

log = logging.getLogger(__name__)


def _positive(role: RoleSpec, name: str, default: float) -> float:
    value = role.params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise LLMUnitError(f"llm role {role.name!r}: {name} must be a positive number, got {value!r}")
    return float(value)


class LLMUnit(ComputeUnit):
    """Constructed from a `RoleSpec` of kind `llm`: `model` is a built-in name or a checkpoint dir.

    Worker integration (duck-typed by `engine.worker.kv`): `kv_store` is the engine's store
    (the worker serves it to other workers and publishes it to the KV index), `kv_meta()`
    what a router needs to hash prompts like this engine; the worker's seat on the transfer
    plane comes in the `UnitContext`.
    """

    def __init__(self, role: RoleSpec, ctx: UnitContext | None = None) -> None:
        ctx = ctx or UnitContext()
        self.role = role
        ref = role.model
        if not ref:
            raise LLMUnitError(f"llm role {role.name!r} needs a model (a built-in name or a checkpoint directory)")
        lease_s = _positive(role, "handoff_lease_s", HANDOFF_LEASE_S)
        self.pull_timeout_s = _positive(role, "kv_pull_timeout_s", KV_PULL_TIMEOUT_S)
        self.shared = shared = ctx.weights
        self._weight_key: WeightKey | None = None
        dtype = role.params.get("dtype", "float32")
        if dtype not in MODEL_DTYPES:
            raise LLMUnitError(f"llm role {role.name!r}: dtype must be one of {sorted(MODEL_DTYPES)}, got {dtype!r}")
        if dtype == "bfloat16" and role.device == "cpu" and not native_bfloat16():
            log.warning("llm role %r runs in bfloat16 on a CPU without native bfloat16 (AVX512-BF16, AMX): its"
                        " products are emulated, several times slower than in float32", role.name)
        if shared is not None:  # the worker's per-process store: roles of one model share its weights
            model_ref = str(Path(ref).resolve()) if Path(ref).is_dir() else ref
            model = shared.llm(model_ref, role.device, dtype)
            self._weight_key = WeightStore.llm_key(model_ref, role.device, dtype)
        else:
            model = load_model(path=ref, dtype=dtype) if Path(ref).is_dir() else load_model(name=ref, dtype=dtype)
        seat = ctx.seat
        # On a worker with a KV index, a prefix miss also pulls the pages other workers hold.
        config = EngineConfig.from_params(role.params)
        if self._weight_key is not None and shared is not None:
            config = config.for_weights(host_shared=shared.origin(self._weight_key) in ("published", "attached"))
            log.info("llm role %r: weights %s; packed copies: bfloat16 %s, float32 %s", role.name,
                     shared.origin(self._weight_key), config.packed_weights, config.packed_float32)
        peers = [IndexPageSource(seat.peer, seat.index)] if seat and seat.index and config.prefix_cache else []
        self.engine = self._build_engine(model, config, ctx.kv_store, peers)
        # Whether the tokenizer has the media markers as tokens of their own (the tiny built-in models'
        # byte tokenizer does): only then are they found among a token prompt's ids.
        self._id_markers = all(model.tokenizer.convert_ids_to_tokens(token) == f"<|{kind}|>"
                               for kind, token in PLACEHOLDER_IDS.items())
        self.engine.cache.pull_timeout_s = self.pull_timeout_s
        self.worker_id: str | None = seat.worker_id if seat else None
        self._peer: Peer | None = seat.peer if seat else None
        self._own_peer = False
        self._page_server: KVPageServer | None = None
        self._lock = threading.Lock()
        self.loop = self._make_loop().start()
        self.pd = self._make_pd(lease_s)

    def _build_engine(self, model: LoadedModel, config: EngineConfig, kv_store: KVStore | None,
                      peers: list[PageSource]) -> LLMEngine:
        """The engine the unit drives (a tensor-parallel unit builds its rank's engine here)."""
        return LLMEngine(model, config, store=kv_store, peers=peers)

    def _make_loop(self) -> EngineLoop:
        """The engine thread (a tensor-parallel unit's has commands of its own)."""
        return EngineLoop(self.engine, self.role.name, self._holds_store)

    def _make_pd(self, lease_s: float) -> PrefillDecode:
        """The prefill and decode node kinds (a tensor-parallel unit's work on every rank)."""
        return PrefillDecode(self.engine, self.loop, self._transfer, lambda: self.worker_id,
                             lease_s=lease_s, pull_timeout_s=self.pull_timeout_s)

    @property
    def failed(self) -> str | None:
        """Why the engine can serve no more calls (its thread failed); None while it can."""
        return self.loop.failed

    def health(self) -> str | None:
        return self.loop.failed

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

    def _transfer(self) -> Peer:
        """The transfer plane: the worker's, or (in-process dispatch) one of the unit's own."""
        with self._lock:
            if self._peer is None:
                self._peer = Peer.start(PeerConfig())
                self._own_peer = True
                self._page_server = KVPageServer(self.engine.store, self._peer.server)
            return self._peer

    def _holds_store(self) -> TensorStore | None:
        """Where prefill hold tokens live: the transfer plane's store (None before there is one)."""
        peer = self._peer
        return peer.store if peer is not None else None

    # -- node calls ------------------------------------------------------------------------------

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

    async def _outputs(self, call: NodeCall, stream: bool) -> AsyncIterator[tuple[RequestOutput, Pulled]]:
        """Engine outputs of a generating call (`llm` or `llm.decode`), each with what a decode pulled."""
        call = await joined(call)
        if node_mode(call) is NodeMode.DECODE:
            async for item in self.pd.decode(call, stream):
                yield item
            return
        prompt, items = self._multimodal(call, node_prompt(call))
        session = call.session_key()
        history, turns = call.params.get("session_history"), call.params.get("session_turns")
        if history is not None and session is None:
            raise LLMUnitError(f"node {call.node_id!r}: param 'session_history' needs param 'session'")
        if turns is not None and history is None:
            raise LLMUnitError(f"node {call.node_id!r}: param 'session_turns' needs param 'session_history'")
        sampling = node_sampling(call.node_id, call.params)
        request_id, inbox = self.loop.open(call.call_id)
        self.loop.put(AddRequest(request_id, prompt, sampling, session, call.tenant, stream_text=stream,
                                 mm_items=items, history=history, turns=turns))
        async for out in self.loop.outputs(call.node_id, request_id, inbox):
            yield out, NOTHING_PULLED

    def _holder(self) -> KVHolder | None:
        """This worker as the holder of pages it computed (None: not on a transfer plane yet)."""
        return KVHolder(self._peer.address, self.worker_id) if self._peer is not None else None

    def _kv_ref(self, out: RequestOutput, pulled: Pulled) -> KVRef:
        layout = self.engine.layout
        return KVRef(
            # The layout its holder serves the pages in (a tensor-parallel unit's: the whole model's).
            model_id=self.engine.model_id, page_size=layout.page_size, layout=self.pd.layout(),
            page_hashes=tuple(out.kv_pages), prompt_ids=out.prompt_ids, output_ids=out.output_ids,
            key_ids=out.key_ids, tenant_salt=out.tenant_salt, tokens=out.prompt_tokens + len(out.output_ids),
            prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens, holder=self._holder(),
            pulled_pages=pulled.pages, pulled_from=pulled.source,
        )

    def _meter(self, call: NodeCall, ctx: NodeContext) -> ProgressMeter:
        """Tokens generated out of the node's `max_new_tokens`, reported as the engine makes them."""
        return ProgressMeter(ctx.progress, node_sampling(call.node_id, call.params).max_new_tokens, "tokens").start()

    async def execute(self, call: NodeCall, ctx: NodeContext) -> NodeResult:
        if node_mode(call) is NodeMode.PREFILL:
            ref = await self.pd.prefill(await joined(call))
            return NodeResult(outputs=map_outputs(ref, call.output_ports, call.node_id))
        last = None
        meter = self._meter(call, ctx)
        async for item in self._outputs(call, stream=False):
            meter.advance(len(item[0].new_token_ids))
            last = item
        assert last is not None
        final, pulled = last
        values = {"text": final.text, "tokens": list(final.output_ids), "kv": self._kv_ref(final, pulled),
                  "usage": usage(final)}
        ports = call.output_ports
        value = values[ports[0]] if len(ports) == 1 else {p: values[p] for p in ports if p in values}
        return NodeResult(outputs=map_outputs(value, ports, call.node_id))

    async def execute_stream(self, call: NodeCall, ctx: NodeContext) -> AsyncIterator[dict[str, Any]]:
        if node_mode(call) is NodeMode.PREFILL:
            yield map_frame(await self.pd.prefill(await joined(call)), call.output_ports, call.node_id)
            return
        meter = self._meter(call, ctx)
        async for out, pulled in self._outputs(call, stream=True):
            meter.advance(len(out.new_token_ids))
            frame: dict[str, Any] = {"text": out.text_delta, "tokens": list(out.new_token_ids)}
            if out.finished:
                frame["kv"] = self._kv_ref(out, pulled)
                frame["usage"] = usage(out)
            yield map_frame({p: v for p, v in frame.items() if p in call.output_ports}, call.output_ports,
                            call.node_id)

    def metrics(self) -> dict[str, float]:
        """The engine's `llm.*` counters (generated tokens, hit rate, queue sizes); the KV
        store's tier metrics are reported by the worker's KV hosting."""
        metrics = {k: float(v) for k, v in self.engine.metrics().items() if k.startswith("llm.")}
        metrics["llm.sessions_resumed"] = float(self.loop.sessions_resumed)
        return metrics

    def refused(self) -> int:
        """What the unit's own transfer seat refused (on a worker the seat is the worker's, which
        counts its refusals itself)."""
        peer = self._peer
        return peer.server.refused if self._own_peer and peer is not None else 0

    # -- shutdown ------------------------------------------------------------------------------------

    async def close(self) -> None:
        await self.loop.close()
        if self._page_server is not None:
            self._page_server.close()
        if self._own_peer and self._peer is not None:
            self._peer.close()
        self.engine.close()
        if self.shared is not None and self._weight_key is not None:
            self.shared.release(self._weight_key)


__all__ = ["LLMUnit", "LLMUnitError", "NodeMode", "RequestError", "node_mode"]
