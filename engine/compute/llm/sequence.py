"""Per-request state of the runner and what it reports back."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from engine.compute.prefix.keys import MultimodalItem
from engine.compute.prefix.radix import Namespace, RadixNode
from engine.compute.sampling import SamplingParams
from engine.data.kv.keys import ExtraKeys, PageHash

if TYPE_CHECKING:
    from engine.compute.llm.cache import PendingPull
    from engine.compute.llm.transfer import KVHandoff
    from engine.compute.models.text import IncrementalDetokenizer
    from engine.data.kv.source import PageSource


class SeqStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(StrEnum):
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # EOS, a stop token id or a stop string
    ABORT = "abort"  # aborted by the caller
    PREFILLED = "prefilled"  # a prefill-only request handed off its KV
    ERROR = "error"  # could not run (e.g. the KV cache cannot hold it)


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Seconds on the engine's clock: queued (arrival to admission), to first token, total."""

    queue_s: float
    ttft_s: float
    total_s: float


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request: its new token(s) and, when it ends, the summary.

    `text_delta` is filled for requests that stream text or use stop strings; `output_ids`,
    `prompt_ids`, `key_ids`, `text`, `timings`, `kv_pages` (and their `tenant_salt`) only on the last
    output of a request.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    output_ids: tuple[int, ...] = ()
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    timings: RequestTimings | None = None
    handoff: KVHandoff | None = None
    error: str | None = None
    session_id: str | None = None
    kv_pages: tuple[PageHash, ...] = ()
    """Keys of the full KV pages of prompt + output (final output only); cached, not pinned."""
    prompt_ids: tuple[int, ...] = ()
    """The prompt's token ids, a session's history included (final output only)."""
    key_ids: tuple[int, ...] = ()
    """The prompt's cache key ids, which `kv_pages` are keyed over (final output only)."""
    tenant_salt: str | None = None
    """The tenant salt `kv_pages` are keyed under (final output only, with `kv_pages`)."""


@dataclass(slots=True, eq=False)
class Sequence:
    """A request inside the engine. `token_ids` = prompt + output; `key_ids` is its cache key
    (the same, with multimodal placeholders replaced by sentinels).

    KV invariant while running: `num_computed == len(pages) * page_size + tail_len`, the
    full pages are locked in the store (`slots` are their device slots) and the partial
    last page is in tail page `tail_slot`.
    """

    request_id: str
    prompt_len: int
    token_ids: list[int]
    key_ids: list[int]
    params: SamplingParams
    namespace: Namespace
    mm_items: tuple[MultimodalItem, ...] = ()
    session_id: str | None = None
    prefill_only: bool = False
    stream_text: bool = False
    handoff: KVHandoff | None = None
    source: PageSource | None = None
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    matched: bool = False
    first_match: bool = True
    pull: PendingPull | None = None
    """Its prompt's next pages, while peers are asked for them (`PagedKVCache.match_prefix`)."""
    cached_tokens: int = 0
    pages: list[PageHash] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    tail_slot: int | None = None
    node: RadixNode | None = None
    text: str = ""
    """Text of the output so far; kept up to date only where `detokenizer` is set."""
    emitted_chars: int = 0
    detokenizer: IncrementalDetokenizer | None = None
    """Set for requests that stream text or use stop strings."""
    arrival: float = 0.0
    admitted: float | None = None
    first_token_at: float | None = None
    reserved_pages: int = 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens whose K/V are still to be computed (the last sampled one included)."""
        return len(self.token_ids) - self.num_computed

    @property
    def extra_keys(self) -> ExtraKeys:
        return ExtraKeys(model_id=self.namespace[0], tenant_salt=self.namespace[1])

    def final_output(self, reason: FinishReason, stop_reason: int | str | None, now: float, *,
                     last: tuple[int, ...], delta: str, handoff: KVHandoff | None, error: str | None,
                     kv_pages: tuple[PageHash, ...]) -> RequestOutput:
        """Its last output, as it ends at `now` for `reason` (`last`: the tokens and `delta` the
        text that come with it)."""
        admitted = self.admitted if self.admitted is not None else now
        first = self.first_token_at if self.first_token_at is not None else now
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=last,
            text_delta=delta,
            finished=True,
            finish_reason=reason,
            stop_reason=stop_reason,
            output_ids=tuple(self.output_ids),
            text=self.text,
            prompt_tokens=self.prompt_len,
            cached_tokens=self.cached_tokens,
            timings=RequestTimings(admitted - self.arrival, first - self.arrival, now - self.arrival),
            handoff=handoff,
            error=error,
            session_id=self.session_id,
            kv_pages=kv_pages,
            prompt_ids=tuple(self.prompt_ids),
            key_ids=tuple(self.key_ids[: self.prompt_len]),
            tenant_salt=self.namespace[1] if kv_pages else None,
        )

    def embeds_in(self, start: int, end: int) -> list[tuple[int, object]]:
        """Rows of item embeddings overlapping positions `[start, end)`, relative to `start`."""
        rows = []
        for item in self.mm_items:
            if item.embeds is None or item.end <= start or item.start >= end:
                continue
            lo, hi = max(item.start, start), min(item.end, end)
            rows.append((lo - start, item.embeds[lo - item.start : hi - item.start]))
        return rows


@dataclass(frozen=True, slots=True)
class TokenTaken:
    """What a sampled token did to its sequence: why the sequence ends now (None: it goes on),
    the EOS/stop token or stop string that ended it, and the text it made visible."""

    reason: FinishReason | None
    stop_reason: int | str | None
    delta: str


def take_token(seq: Sequence, token: int, eos: frozenset[int]) -> TokenTaken:
    """Append the sampled `token` to `seq`: its text (where detokenized), and whether it ends
    the sequence (EOS, a stop token or string, `max_new_tokens`, or a prefill-only request's
    first token). A stop string is cut from the text; a suffix that may begin one is held back."""
    seq.token_ids.append(token)
    seq.key_ids.append(token)
    params = seq.params
    reason: FinishReason | None = None
    stop_reason: int | str | None = None
    if not params.ignore_eos and token in eos:
        reason, stop_reason = FinishReason.STOP, token
    elif token in params.stop_token_ids:
        reason, stop_reason = FinishReason.STOP, token
    delta = ""
    detok = seq.detokenizer
    if detok is not None:
        seq.text += detok.step(seq.output_ids)
    if reason is None and seq.num_output >= params.max_new_tokens:
        reason = FinishReason.LENGTH
    if reason is None and seq.prefill_only:
        reason = FinishReason.PREFILLED
    if detok is not None and reason is not None:
        seq.text += detok.flush(seq.output_ids)
    if params.stop and stop_reason is None:  # neither EOS nor a stop token ended it
        window = max(0, seq.emitted_chars - max(len(s) for s in params.stop))
        hits = [(seq.text.find(s, window), s) for s in params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            seq.text = seq.text[:index]
            reason, stop_reason = FinishReason.STOP, stop
    if detok is not None:
        visible = len(seq.text) if reason is not None else len(seq.text) - held_back(seq.text, params.stop)
        if visible > seq.emitted_chars:
            delta = seq.text[seq.emitted_chars : visible]
            seq.emitted_chars = visible
    return TokenTaken(reason, stop_reason, delta)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` to hold back from a stream: a suffix that may be
    the start of a stop string. (`text` never ends in an incomplete character: the sequence's
    `IncrementalDetokenizer` holds those back.)"""
    keep = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                keep = max(keep, size)
                break
    return keep
