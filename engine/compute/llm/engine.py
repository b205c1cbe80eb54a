"""`LLMEngine`: the in-process LLM runner loop (schedule -> forward -> sample -> update).

Requests join the running batch as soon as there is room and leave it the step they
finish; every step runs one forward over the prefill chunks of all sequences with prompt
left to compute and one decode forward for all the others, then one sampling pass for every sequence that
produced logits. The engine is single-threaded: one owner calls `add_request`, `abort`
and `step` (the `llm` compute unit runs it in its own thread).

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
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.compute.llm.cache import PagedKVCache
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.errors import (
    HandoffError,
    RequestError,
    UnknownRequestError,
)
from engine.compute.llm.forward import DecodeBatch, DecodeBuffer, PagedForward, PrefillChunk
from engine.compute.llm.handoffs import Handoffs
from engine.compute.llm.requests import Prompt, SequenceBuilder
from engine.compute.llm.scheduler import Scheduler
from engine.compute.llm.sequence import FinishReason, RequestOutput, Sequence, take_token
from engine.compute.llm.sessions import SessionInfo, Sessions
from engine.compute.llm.transfer import KVHandoff
from engine.compute.models.loader import LoadedModel
from engine.compute.prefix.keys import MultimodalItem
from engine.compute.prefix.radix import Namespace
from engine.compute.sampling import Sampler, SamplingParams, SamplingRow
from engine.data.kv.disk import DiskTier
from engine.data.kv.errors import DiskTierBusy, KVCapacityError
from engine.data.kv.layout import KVLayout, dtype_name
from engine.data.kv.policy import EvictionPolicy
from engine.data.kv.source import PageSource
from engine.data.kv.store import DiskTierConfig, KVStore, KVStoreConfig, WritePolicy
from engine.data.kv.tier import Capacity

_PULL_WAIT_S = 0.01
"""How long a step with nothing to run but sequences waiting for peers' pages waits for them."""

DISK_SLOTS = 1024
"""The most engines that may share one `disk_path` (see `EngineConfig`)."""


def _own_store(config: EngineConfig, layout: KVLayout, device: str) -> KVStore:
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
    for slot in range(DISK_SLOTS):
        directory = Path(config.disk_path) / f"slot-{slot}"
        if DiskTier.held(directory, layout):
            continue  # another live engine holds it (probed first: a store costs its tiers' memory)
        try:
            return store(DiskTierConfig(directory, Capacity(pages=config.disk_pages)))
        except DiskTierBusy:
            continue  # taken between the probe and the store
    raise DiskTierBusy(f"every one of the {DISK_SLOTS} disk slots in {config.disk_path} is held by a live process")


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0


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
    ) -> None:
        """`make_cache`: the page bookkeeping over the store (default: a `PagedKVCache` with
        `peers`; a tensor-parallel rank's agrees its prefix hits with the group)."""
        self.model = model
        self.config = config = config or EngineConfig()
        self.clock = clock
        self.layout = KVLayout(config.page_size, model.num_layers, model.num_kv_heads, model.head_dim,
                               dtype_name(model.dtype))
        device = str(next(model.model.parameters()).device)
        self._own_store = store is None
        if store is None:
            store = _own_store(config, self.layout, device)
        elif store.layout != self.layout:
            raise RequestError(f"store layout {store.layout.fingerprint()} is not {self.layout.fingerprint()}")
        self.store = store
        self.forward = PagedForward(model.model, self.layout)
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
        self._outbox: list[RequestOutput] = []
        self._decode_buffer: DecodeBuffer | None = None
        self._ids = itertools.count()
        self._eos = frozenset(model.eos_token_ids)
        self._builder = SequenceBuilder(model, self.layout, config, self.sessions)

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
        self._finish(seq, FinishReason.ABORT, None, self._outbox)

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` is waiting or running."""
        return request_id in self._requests

    def has_session(self, session_id: str) -> bool:
        return session_id in self.sessions

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._outbox)

    # -- the loop --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, run one forward per running sequence, sample, and report what changed."""
        outputs, self._outbox = self._outbox, []
        self.expire_sessions()
        self._admit(outputs)
        plan = self.scheduler.plan()
        if plan.empty:
            return outputs
        self.stats.steps += 1
        ready: list[Sequence] = []
        logits: list[torch.Tensor] = []
        prefill = self._matched_prefill(plan.prefill, outputs)
        decode = [seq for seq in plan.decode if seq.request_id in self._requests]
        for seq, row in self._prefill(prefill, outputs, hand_over=not decode):
            ready.append(seq)
            logits.append(row[None])
        for seq in decode:
            seq.matched = True  # one token left: nothing to match
            seq.first_match = False
        if decode:
            logits.append(self._decode(decode))
            ready.extend(decode)
        if not ready:
            if self.cache.pulling:  # all there is waits for peers' pages: wait for one, briefly
                self.cache.wait_pulls(_PULL_WAIT_S)
            return outputs
        rows = [SamplingRow(seq.params, seq.prompt_ids, seq.output_ids) for seq in ready]
        tokens = self.sampler.sample(torch.cat(logits), rows)
        for seq, token in zip(ready, tokens, strict=True):
            if seq.request_id in self._requests:
                self._append(seq, token, outputs)
        return outputs

    def _admit(self, outputs: list[RequestOutput]) -> None:
        while True:
            pinned = self.sessions.pinned_pages + self.handoffs.pinned_pages
            seq = self.scheduler.next_admissible(self.cache.free_tail_slots, pinned)
            if seq is None:
                return
            self.scheduler.start(seq)
            self.cache.attach(seq)
            if seq.admitted is None:
                seq.admitted = self.clock()
            if seq.handoff is None:
                continue
            seq.first_match = False
            try:
                self.cache.import_handoff(seq, seq.handoff, seq.source)
            except KVCapacityError as exc:
                if not self._preempt(seq, outputs, str(exc)):
                    return
                continue
            except HandoffError as exc:
                self._finish(seq, FinishReason.ERROR, None, outputs, error=str(exc))
                continue
            if not seq.output_ids:
                self._append(seq, seq.handoff.first_token, outputs)

    def _preempt(self, seq: Sequence, outputs: list[RequestOutput], error: str) -> bool:
        """Give up `seq`'s KV (the device tier is full) and requeue it to recompute later; when
        nothing else runs it can never fit and fails. Returns whether it was requeued."""
        self.stats.preemptions += 1
        self.cache.release(seq)
        if len(self.scheduler.running) <= 1:
            self._finish(seq, FinishReason.ERROR, None, outputs, error=error)
            return False
        self.scheduler.requeue(seq)
        return True

    def _matched_prefill(self, planned: list[tuple[Sequence, int]],
                         outputs: list[RequestOutput]) -> list[tuple[Sequence, int]]:
        """The step's prefill chunks, each sequence matched against the cache first. One forward
        pass computes the chunks together, so a sequence whose first page another computes in this
        step waits a step, to find that page cached then instead of computing it again (two equal
        prompts arriving together: the second is a prefix hit, as SGLang's scheduler makes it)."""
        page = self.config.page_size
        computing: set[tuple[Namespace, tuple[int, ...]]] = set()
        chosen = []
        for seq, budget in planned:
            first = (seq.namespace, tuple(seq.token_ids[:page])) if len(seq.token_ids) > page else None
            if not seq.matched:
                if first is not None and first in computing:
                    continue
                if not self._match(seq, outputs):
                    continue
            if first is not None and seq.num_computed < page:
                computing.add(first)
            chosen.append((seq, budget))
        return chosen

    def _match(self, seq: Sequence, outputs: list[RequestOutput]) -> bool:
        """Match `seq`'s prompt against the cache; False when it cannot prefill this step (its
        pages are being pulled from a peer, or it was preempted)."""
        try:
            if not self.cache.match_prefix(seq):
                return False
        except KVCapacityError as exc:
            self._preempt(seq, outputs, str(exc))
            return False
        self.sessions.restore_tail(seq, self.config.page_size)
        if seq.first_match:
            seq.first_match = False
            seq.cached_tokens = seq.num_computed
            self.stats.cached_tokens += seq.cached_tokens
        return True

    def _prefill(self, planned: list[tuple[Sequence, int]], outputs: list[RequestOutput],
                 hand_over: bool) -> list[tuple[Sequence, torch.Tensor]]:
        """One forward pass over the step's prefill chunks; commits their K/V and returns the
        logits of the sequences whose prompt is now computed. With `hand_over` (no decode batch
        this step), a lone sequence that finishes its prompt leaves its attention buffer as the
        next decode step's (see `PagedForward.prefill_batch`)."""
        if not planned:
            return []
        seqs = [seq for seq, _ in planned]
        counts = [min(budget, seq.pending) for seq, budget in planned]
        chunks = [_prefill_chunk(seq, n, self.cache.tail(seq)) for seq, n in zip(seqs, counts, strict=True)]
        wants = [n == seq.pending for seq, n in zip(seqs, counts, strict=True)]
        key = planned[0][0].request_id if hand_over and len(planned) == 1 else None
        output = self.forward.prefill_batch(chunks, self.store.device_pool, wants, decode_key=key)
        ready = []
        for (seq, _), tokens, (logits, fresh) in zip(planned, counts, output.results, strict=True):
            self.stats.computed_prompt_tokens += tokens
            if not self._grow(seq, outputs, lambda s=seq, f=fresh, t=tokens: self.cache.commit_prefill(s, f, t)):
                continue
            if logits is not None:
                ready.append((seq, logits))
        if output.buffer is not None and ready:  # its K/V are committed: the buffer agrees with the pages
            self._decode_buffer = output.buffer
        return ready

    def _decode(self, batch: list[Sequence]) -> torch.Tensor:
        logits, self._decode_buffer = self.forward.decode(
            _decode_batch(batch), self.store.device_pool, self.cache.tails, self._decode_buffer
        )
        for seq in batch:
            self._grow(seq, self._outbox, lambda s=seq: self.cache.commit_decoded(s))
        return logits

    def _grow(self, seq: Sequence, outputs: list[RequestOutput], commit: Callable[[], None]) -> bool:
        """Commit new K/V; when the device tier is full, preempt `seq` (it recomputes later)."""
        try:
            commit()
            return True
        except KVCapacityError as exc:
            self._preempt(seq, outputs, str(exc))
            return False

    def _append(self, seq: Sequence, token: int, outputs: list[RequestOutput]) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = self.clock()
        self.stats.generated_tokens += 1
        taken = take_token(seq, token, self._eos)
        if taken.reason is None:
            outputs.append(RequestOutput(seq.request_id, (token,), taken.delta, session_id=seq.session_id))
            return
        self._finish(seq, taken.reason, taken.stop_reason, outputs, last=(token,), delta=taken.delta)

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        stop_reason: int | str | None,
        outputs: list[RequestOutput],
        *,
        last: tuple[int, ...] = (),
        delta: str = "",
        error: str | None = None,
    ) -> None:
        now = self.clock()
        handoff = None
        self.sessions.end_turn(seq, reason, now, self.config.prefix_cache)
        if reason is FinishReason.PREFILLED:
            handoff = self.handoffs.make(seq)
        if seq.detokenizer is None:
            seq.text = self.decode_text(seq.output_ids)
        kv_pages = tuple(seq.pages) if self.config.prefix_cache else ()
        self.cache.release(seq)
        self.scheduler.remove(seq)
        self._requests.pop(seq.request_id, None)
        outputs.append(seq.final_output(reason, stop_reason, now, last=last, delta=delta, handoff=handoff,
                                        error=error, kv_pages=kv_pages))

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
        self._outbox.clear()
        self.sessions.close_all()
        self.handoffs.release_all()
        self.cache.close()
        if self._own_store:
            self.store.close()


def _prefill_chunk(seq: Sequence, tokens: int, tail: torch.Tensor | None) -> PrefillChunk:
    """The next `tokens` of `seq`'s prompt to compute, over its cached pages and `tail`."""
    start = seq.num_computed
    return PrefillChunk(token_ids=seq.token_ids[start : start + tokens], start=start, prefix_slots=seq.slots,
                        tail=tail, embeds=seq.embeds_in(start, start + tokens))


def _decode_batch(batch: Seq[Sequence]) -> DecodeBatch:
    """One token of each of `batch`: the last one sampled, whose K/V go into its tail page."""
    return DecodeBatch(
        token_ids=[seq.token_ids[seq.num_computed] for seq in batch],
        positions=[seq.num_computed for seq in batch],
        page_slots=[seq.slots for seq in batch],
        tail_slots=[seq.tail_slot for seq in batch],  # type: ignore[misc]
        keys=[seq.request_id for seq in batch],
    )
