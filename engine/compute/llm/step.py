"""One step of `LLMEngine`: admit, match prefixes, run the forwards, sample, and say what each
sequence's new token means.

Every step runs one forward over the prefill chunks of all sequences with prompt left to
compute and one decode forward for all the others, then one sampling pass for every sequence
that produced logits. A sequence whose prefix pages are being pulled from a peer waits (the
cache's `pulling`) while the batch runs on; one the device tier has no room for is preempted
and recomputes later. `EngineStep` holds no state of its own beyond the forward's decode
buffer and the outputs of a step not yet returned (`outbox`): the requests, the scheduler, the
cache, sessions and handoffs are the engine's, shared.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.compute.llm.cache import PagedKVCache
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.errors import HandoffError
from engine.compute.llm.forward import DecodeBatch, DecodeBuffer, PagedForward, PrefillChunk
from engine.compute.llm.handoffs import Handoffs
from engine.compute.llm.scheduler import Scheduler
from engine.compute.llm.sequence import FinishReason, RequestOutput, Sequence, take_token
from engine.compute.llm.sessions import Sessions
from engine.compute.prefix.radix import Namespace
from engine.compute.sampling import Sampler, SamplingRow
from engine.data.kv.errors import KVCapacityError
from engine.data.kv.store import KVStore

_PULL_WAIT_S = 0.01
"""How long a step with nothing to run but sequences waiting for peers' pages waits for them."""


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0


@dataclass(slots=True, eq=False)
class EngineStep:
    """The step of an engine over its shared state. See the module docstring."""

    config: EngineConfig
    store: KVStore
    cache: PagedKVCache
    scheduler: Scheduler
    sessions: Sessions
    handoffs: Handoffs
    forward: PagedForward
    sampler: Sampler
    stats: EngineStats
    requests: dict[str, Sequence]
    """The engine's waiting and running requests by id."""
    eos: frozenset[int]
    clock: Callable[[], float]
    decode_text: Callable[[Seq[int]], str]
    outbox: list[RequestOutput]
    """Outputs made between steps (an abort, a sampled decode's preemption): the next step's first."""
    decode_buffer: DecodeBuffer | None = None

    def run(self) -> list[RequestOutput]:
        """Admit, run one forward per running sequence, sample, and report what changed."""
        outputs, self.outbox = self.outbox, []
        self.sessions.expire()
        self._admit(outputs)
        plan = self.scheduler.plan()
        if plan.empty:
            return outputs
        self.stats.steps += 1
        ready: list[Sequence] = []
        logits: list[torch.Tensor] = []
        prefill = self._matched_prefill(plan.prefill, outputs)
        decode = [seq for seq in plan.decode if seq.request_id in self.requests]
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
            if seq.request_id in self.requests:
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
                self.finish(seq, FinishReason.ERROR, None, outputs, error=str(exc))
                continue
            if not seq.output_ids:
                self._append(seq, seq.handoff.first_token, outputs)

    def _preempt(self, seq: Sequence, outputs: list[RequestOutput], error: str) -> bool:
        """Give up `seq`'s KV (the device tier is full) and requeue it to recompute later; when
        nothing else runs it can never fit and fails. Returns whether it was requeued."""
        self.stats.preemptions += 1
        self.cache.release(seq)
        if len(self.scheduler.running) <= 1:
            self.finish(seq, FinishReason.ERROR, None, outputs, error=error)
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
            self.decode_buffer = output.buffer
        return ready

    def _decode(self, batch: list[Sequence]) -> torch.Tensor:
        logits, self.decode_buffer = self.forward.decode(
            _decode_batch(batch), self.store.device_pool, self.cache.tails, self.decode_buffer
        )
        for seq in batch:
            self._grow(seq, self.outbox, lambda s=seq: self.cache.commit_decoded(s))
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
        taken = take_token(seq, token, self.eos)
        if taken.reason is None:
            outputs.append(RequestOutput(seq.request_id, (token,), taken.delta, session_id=seq.session_id))
            return
        self.finish(seq, taken.reason, taken.stop_reason, outputs, last=(token,), delta=taken.delta)

    def finish(
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
        self.requests.pop(seq.request_id, None)
        outputs.append(seq.final_output(reason, stop_reason, now, last=last, delta=delta, handoff=handoff,
                                        error=error, kv_pages=kv_pages))


def _prefill_chunk(seq: Sequence, tokens: int, tail: torch.Tensor | None) -> PrefillChunk:
    """The next `tokens` of `seq`'s prompt to compute, over its cached pages and `tail`."""
    start = seq.num_computed
    return PrefillChunk(token_ids=seq.token_ids[start : start + tokens], start=start, prefix_slots=seq.slots,
                        tail=tail, embeds=seq.embeds_in(start, start + tokens),
                        tail_slot=seq.tail_slot if tail is not None else None)


def _decode_batch(batch: Seq[Sequence]) -> DecodeBatch:
    """One token of each of `batch`: the last one sampled, whose K/V go into its tail page."""
    return DecodeBatch(
        token_ids=[seq.token_ids[seq.num_computed] for seq in batch],
        positions=[seq.num_computed for seq in batch],
        page_slots=[seq.slots for seq in batch],
        tail_slots=[seq.tail_slot for seq in batch],  # type: ignore[misc]
        keys=[seq.request_id for seq in batch],
    )
