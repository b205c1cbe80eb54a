"""`LLMEngine`: the in-process LLM runner loop (schedule -> forward -> sample -> update).

Requests join the running batch as soon as there is room and leave it the step they
finish; what one step does is `engine.compute.llm.step`'s. The engine is single-threaded: one
owner calls `add_request`, `abort` and `step` (the `llm` compute unit runs it in its own thread).

Prefill/decode disaggregation: `add_request(..., prefill_only=True)` ends after the
first token with a `KVHandoff` on its output (its pages stay locked until
`release_handoff`); a decode engine admits it with `add_request(handoff=..., source=...)`.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TypeVar

from engine.compute.llm.cache import PagedKVCache
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.errors import RequestError, UnknownRequestError
from engine.compute.llm.forward import PagedForward
from engine.compute.llm.handoffs import Handoffs
from engine.compute.llm.requests import Prompt, SequenceBuilder
from engine.compute.llm.scheduler import Scheduler
from engine.compute.llm.sequence import FinishReason, RequestOutput, Sequence
from engine.compute.llm.sessions import SessionInfo, Sessions
from engine.compute.llm.step import EngineStats, EngineStep
from engine.compute.llm.transfer import KVHandoff
from engine.compute.models.loader import LoadedModel
from engine.compute.prefix.keys import MultimodalItem
from engine.compute.sampling import Sampler, SamplingParams
from engine.data.kv.disk import DiskTier
from engine.data.kv.errors import DiskTierBusy
from engine.data.kv.layout import KVLayout, dtype_name
from engine.data.kv.policy import EvictionPolicy
from engine.data.kv.source import PageSource
from engine.data.kv.store import DiskTierConfig, KVStore, KVStoreConfig, WritePolicy
from engine.data.kv.tier import Capacity

T = TypeVar("T")

DISK_SLOTS = 1024
"""The most engines that may share one `disk_path` (see `EngineConfig`)."""


def open_disk_slot(disk_path: str, layout: KVLayout, open_slot: Callable[[Path], T]) -> T:
    """`open_slot(directory)` of the first slot directory of `disk_path` no live process holds
    (the disk tier in it raises `DiskTierBusy` when one does)."""
    for slot in range(DISK_SLOTS):
        directory = Path(disk_path) / f"slot-{slot}"
        if DiskTier.held(directory, layout):
            continue  # another live engine holds it (probed first: a store costs its tiers' memory)
        try:
            return open_slot(directory)
        except DiskTierBusy:
            continue  # taken between the probe and the store
    raise DiskTierBusy(f"every one of the {DISK_SLOTS} disk slots in {disk_path} is held by a live process")


def own_store(config: EngineConfig, layout: KVLayout, device: str) -> KVStore:
    """The engine's KV store as `config` sizes it, its disk tier in the first free slot of
    `disk_path`."""

    def store(disk: DiskTierConfig | None) -> KVStore:
        return KVStore(KVStoreConfig(
            layout=layout,
            device_capacity=Capacity(pages=config.device_pages),
            host_capacity=Capacity(pages=config.host_pages) if config.host_pages else None,
            disk=disk,
            eviction=EvictionPolicy(config.eviction),
            write=WritePolicy(config.write_policy),
            device=device,
        ))

    if not config.disk_path:
        return store(None)
    return open_disk_slot(config.disk_path, layout,
                          lambda directory: store(DiskTierConfig(directory, Capacity(pages=config.disk_pages))))


def engine_layout(model: LoadedModel, config: EngineConfig) -> KVLayout:
    """The KV layout of `model`'s pages (a tensor-parallel shard's: its own KV heads)."""
    return KVLayout(config.page_size, model.num_layers, model.num_kv_heads, model.head_dim, dtype_name(model.dtype))


ForwardFactory = Callable[..., PagedForward]
"""Builds an engine's model runner as `PagedForward(model, layout, packed=..., packed_float32=...)` does."""


class LLMEngine:
    """Continuous-batching LLM runner over paged KV. See the module docstring."""

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig | None = None,
        *,
        store: KVStore | None = None,
        peers: Seq[PageSource] = (),
        clock: Callable[[], float] = time.monotonic,
        make_cache: Callable[[KVStore, KVLayout], PagedKVCache] | None = None,
        make_forward: ForwardFactory = PagedForward,
    ) -> None:
        """`make_cache`: the page bookkeeping over the store (default: a `PagedKVCache` with
        `peers`); `make_forward`: the model runner (default: `PagedForward`). A tensor-parallel
        rank 0 passes both: its cache and runner tell the follower ranks what to mirror
        (`engine.compute.tp`)."""
        self.model = model
        # Packed copies left unset are for weights this process holds alone (a worker whose host
        # shares them decides so before: `EngineConfig.for_weights`).
        self.config = config = (config or EngineConfig()).for_weights(host_shared=False)
        self.clock = clock
        self.layout = engine_layout(model, config)
        device = str(next(model.model.parameters()).device)
        self._own_store = store is None
        if store is None:
            store = own_store(config, self.layout, device)
        elif store.layout != self.layout:
            raise RequestError(f"store layout {store.layout.fingerprint()} is not {self.layout.fingerprint()}")
        self.store = store
        self.forward = make_forward(model.model, self.layout, packed=bool(config.packed_weights),
                                    packed_float32=bool(config.packed_float32))
        if make_cache is None:
            self.cache = PagedKVCache(store, self.layout, config.max_running, config.prefix_cache, peers)
        else:
            self.cache = make_cache(store, self.layout)
        capacity = int(store.metrics()["device.capacity_pages"])
        self.scheduler = Scheduler(config.page_size, config.max_running, config.max_prefill_tokens, capacity)
        self.sampler = Sampler(config.seed)
        self.stats = EngineStats()
        self._requests: dict[str, Sequence] = {}
        self.sessions = Sessions(self.cache, model.model_id, config.session_ttl_s, clock)
        self.handoffs = Handoffs(self.cache, model.model_id, self.layout)
        self._ids = itertools.count()
        self._builder = SequenceBuilder(model, self.layout, config, self.sessions)
        self._step = EngineStep(
            config=config, store=store, cache=self.cache, scheduler=self.scheduler, sessions=self.sessions,
            handoffs=self.handoffs, forward=self.forward, sampler=self.sampler, stats=self.stats,
            requests=self._requests, eos=frozenset(model.eos_token_ids), clock=clock,
            decode_text=self.decode_text, outbox=[])

    @property
    def model_id(self) -> str:
        return self.model.model_id

    # -- requests ----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self._builder.encode(text)

    def decode_text(self, token_ids: Seq[int]) -> str:
        return self._builder.decode(token_ids)

    def add_request(
        self,
        prompt: Prompt | None = None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        tenant_salt: str | None = None,
        mm_items: Seq[MultimodalItem] = (),
        prefill_only: bool = False,
        handoff: KVHandoff | None = None,
        source: PageSource | None = None,
        stream_text: bool = False,
    ) -> str:
        """Queue a request; returns its id. Its outputs come from `step()`.

        `prompt` is text (tokenized here) or token ids; in a session it is only the new
        message. `mm_items` place multimodal items (positions relative to `prompt`).
        With `handoff` (from a prefill engine) the prompt is the handoff's and `source`
        is where the pages this engine lacks are pulled from.
        """
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq, session = self._builder.build(
            request_id, prompt, params, arrival=self.clock(), session_id=session_id, tenant_salt=tenant_salt,
            mm_items=mm_items, prefill_only=prefill_only, handoff=handoff, source=source, stream_text=stream_text)
        if session is not None:
            session.busy = True
            session.last_used = seq.arrival
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        self.stats.prompt_tokens += seq.prompt_len
        return request_id

    def abort(self, request_id: str) -> None:
        """End a request now; its final output (reason `abort`) comes with the next step."""
        seq = self._requests.get(request_id)
        if seq is None:
            raise UnknownRequestError(request_id)
        self._step.finish(seq, FinishReason.ABORT, None, self._step.outbox)

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` is waiting or running."""
        return request_id in self._requests

    def has_session(self, session_id: str) -> bool:
        return session_id in self.sessions

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._step.outbox)

    # -- the loop --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, run one forward per running sequence, sample, and report what changed
        (`engine.compute.llm.step`)."""
        return self._step.run()

    # -- driving helpers ---------------------------------------------------------------------------

    def iter_outputs(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding outputs as they come (streaming)."""
        while self.has_unfinished():
            yield from self.step()

    def generate(
        self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None, **kwargs
    ) -> list[RequestOutput]:
        """Submit `prompts` in order as one batch, run them to the end; their final outputs in order."""
        per = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise RequestError(f"{len(per)} sampling params for {len(prompts)} prompts")
        ids = [self.add_request(p, sp, **kwargs) for p, sp in zip(prompts, per, strict=True)]
        return self.run_until_finished(ids)

    def run_until_finished(self, request_ids: Seq[str]) -> list[RequestOutput]:
        wanted = set(request_ids)
        final: dict[str, RequestOutput] = {}
        while wanted - set(final):
            if not self.has_unfinished():
                raise UnknownRequestError(sorted(wanted - set(final)))
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[i] for i in request_ids]

    # -- sessions ------------------------------------------------------------------------------------

    def open_session(self, session_id: str | None = None, *, tenant_salt: str | None = None,
                     ttl_s: float | None = None, turns: int = 0) -> str:
        """Open a session (`turns`: how many turns it holds already, when its first turn here
        brings the history of turns served elsewhere)."""
        return self.sessions.open(session_id, tenant_salt, ttl_s, turns)

    def session_info(self, session_id: str) -> SessionInfo:
        return SessionInfo.of(self.sessions.get(session_id))

    def session_history(self, session_id: str) -> list[int]:
        return list(self.sessions.get(session_id).token_ids)

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id)

    def expire_sessions(self, now: float | None = None) -> list[str]:
        """Unpin sessions idle for longer than their TTL; returns their ids."""
        return self.sessions.expire(now)

    # -- prefill/decode handoff -------------------------------------------------------------------------

    def release_handoff(self, handoff_id: str) -> None:
        """The decode side has the pages: drop the hold the handoff kept on them."""
        self.handoffs.release(handoff_id)

    # -- metrics and shutdown -------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        s = self.stats
        out: dict[str, float] = {
            "llm.steps": s.steps,
            "llm.prompt_tokens": s.prompt_tokens,
            "llm.cached_tokens": s.cached_tokens,
            "llm.hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "llm.computed_prompt_tokens": s.computed_prompt_tokens,
            "llm.generated_tokens": s.generated_tokens,
            "llm.preemptions": s.preemptions,
            "llm.running": len(self.scheduler.running),
            "llm.waiting": len(self.scheduler.waiting),
            "llm.sessions": len(self.sessions),
            "llm.pulled_pages": self.cache.pulled_pages,
        }
        out.update(self.store.metrics())
        return out

    def close(self) -> None:
        for request_id in list(self._requests):
            self.abort(request_id)
        self._step.outbox.clear()
        self.sessions.close_all()
        self.handoffs.release_all()
        self.cache.close()
        if self._own_store:
            self.store.close()
