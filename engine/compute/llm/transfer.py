"""Prefill/decode disaggregation: what a prefill runner hands a decode runner, and how pages move.

A prefill runner computes a prompt's KV and its first token and returns a `KVHandoff`:
the page keys of the prompt's full pages (which it keeps locked until the handoff is
released), the K/V of the trailing partial page, and the first token. A decode runner
that admits the handoff brings whichever of those pages it lacks into its own store
from a `PageSource` and decodes from there. Nothing else is shared.

Page sources put pages straight into the asking store (the cache locks them after):

* `StorePageSource`: another `KVStore` of this process (tests, one-process setups);
* `HolderPageSource`: a worker known to hold the pages (the prefill worker of a
  handoff), over the transfer plane (`engine.data.kv.pull.fetch_pages`);
* `IndexPageSource`: whichever live worker the distributed index names as holding the
  longest run (`engine.data.kv.pull.pull_missing`): prefix matching across workers.

Between processes a handoff travels as a `KVHandoffRef`, the value of an `llm.prefill`
node's `kv` port: plain data (page keys, first token, the holder's data address) plus one
`TensorRef`, the *hold token*. The prefill worker keeps the prompt's pages locked for as long
as that ref lives in its tensor store; it holds the K/V of the partial last page (a
one-element placeholder when the prompt ends on a page boundary). The decode side pulls the
pages and the tail, then releases the ref; if it never does (it died), the ref's lease ends
the hold.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import torch

from engine.data.kv.errors import KVIndexError, KVTransferError
from engine.data.kv.keys import PageHash
from engine.data.kv.pull import KVHolderIndex, fetch_pages, pull_missing
from engine.data.kv.store import KVStore
from engine.data.wire import TensorRef

if TYPE_CHECKING:
    from engine.data.peer import Peer


@dataclass(frozen=True, slots=True)
class KVHandoff:
    """A prefilled prompt, ready for a decode runner of the same model and KV layout.

    `tail` is one page-shaped tensor whose first `tail_len` tokens hold the K/V of the
    prompt's last, partial page (None when the prompt ends on a page boundary);
    `first_token` is the token sampled after the prompt (draw number 0 of the request).
    """

    handoff_id: str
    model_id: str
    layout: dict[str, Any]
    tenant_salt: str | None
    prompt_ids: tuple[int, ...]
    key_ids: tuple[int, ...]
    page_hashes: tuple[PageHash, ...]
    tail_len: int
    tail: torch.Tensor | None
    first_token: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


class KVHandoffRef(msgspec.Struct, frozen=True, tag="llm.handoff", tag_field="type"):
    """A handoff as a node value (the `kv` output of `llm.prefill`): JSON-able once built with
    `to_value()`, read back (and validated) with `from_value()`.

    `holder` is the prefill worker's data address (its tensor server: the pages are fetched
    from there) and `worker_id` its id. `hold` is the hold token (see the module docstring);
    None when there is nothing to hand off because the generation already ended at the first
    token (`finish_reason` says why: EOS, a stop token, `max_new_tokens` 1). `sampling` are the
    prefill node's sampling params, which the decode node continues with (its own override them).
    """

    handoff_id: str
    model_id: str
    layout: dict[str, Any]
    prompt_ids: tuple[int, ...]
    key_ids: tuple[int, ...]
    page_hashes: tuple[str, ...]
    tail_len: int
    first_token: int
    holder: str
    worker_id: str | None = None
    tenant_salt: str | None = None
    hold: TensorRef | None = None
    sampling: dict[str, Any] = {}
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def to_value(self) -> dict[str, Any]:
        """Plain JSON data (what crosses processes inline, lists for tuples; `type` names it)."""
        return msgspec.json.decode(msgspec.json.encode(self))

    @classmethod
    def from_value(cls, value: Any) -> KVHandoffRef:
        """Raises `ValueError` naming what is wrong when `value` is not a handoff."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict) or value.get("type") != "llm.handoff":
            raise ValueError("not a prefill handoff (connect the 'kv' output of an llm.prefill node)")
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"malformed prefill handoff: {exc}") from None

    def to_handoff(self, tail: torch.Tensor | None) -> KVHandoff:
        return KVHandoff(
            handoff_id=self.handoff_id,
            model_id=self.model_id,
            layout=dict(self.layout),
            tenant_salt=self.tenant_salt,
            prompt_ids=tuple(self.prompt_ids),
            key_ids=tuple(self.key_ids),
            page_hashes=tuple(PageHash(p) for p in self.page_hashes),
            tail_len=self.tail_len,
            tail=tail,
            first_token=self.first_token,
        )


class PageSource(Protocol):
    """Where a runner gets pages it does not hold (a peer worker, the prefill worker)."""

    def pull(self, store: KVStore, pages: Sequence[PageHash], timeout_s: float) -> int:
        """Put the leading run of `pages` that the source holds into `store` (unlocked) and
        return its length (0 when the source lacks the first page). Pages already in `store`
        count without being copied again. Counts the transfer in `store`'s pull metrics.

        Raises `KVTransferError` when the source fails or does not answer in time.
        """
        ...


class StorePageSource:
    """A `PageSource` over a `KVStore` of this process: copies, read without promotion."""

    def __init__(self, store: KVStore) -> None:
        self._store = store

    def pull(self, store: KVStore, pages: Sequence[PageHash], timeout_s: float) -> int:
        del timeout_s  # a local copy does not wait
        started = time.perf_counter()
        have = store.resident_run(pages)
        copied = 0
        for page in pages[have:]:
            data = self._store.get(page, promote=False)
            if data is None:
                break
            store.put(page, data)
            copied += 1
        store.record_pull(copied, copied * store.layout.page_nbytes, time.perf_counter() - started)
        return have + copied


class HolderPageSource:
    """A `PageSource` at a known worker's data address (the prefill worker of a handoff)."""

    def __init__(self, peer: Peer, holder: str) -> None:
        self._peer = peer
        self.holder = holder

    def pull(self, store: KVStore, pages: Sequence[PageHash], timeout_s: float) -> int:
        have = store.resident_run(pages)
        if have == len(pages):
            return have
        return have + len(fetch_pages(store, self._peer, self.holder, pages[have:], timeout_s).pages)


class IndexPageSource:
    """A `PageSource` that asks the distributed KV index who holds the pages and pulls them
    from the live worker holding the longest run (never from this worker itself).

    Used while matching a prompt's prefix, where recomputing is always possible: a miss in
    the index is no error, index failures become `KVTransferError`, and `max_timeout_s` caps
    how long a stale entry for a dead holder can hold up the engine.
    """

    def __init__(self, peer: Peer, index: KVHolderIndex, max_timeout_s: float = 2.0) -> None:
        self._peer = peer
        self._index = index
        self.max_timeout_s = max_timeout_s

    def pull(self, store: KVStore, pages: Sequence[PageHash], timeout_s: float) -> int:
        try:
            result = pull_missing(store, self._peer, self._index, pages, min(timeout_s, self.max_timeout_s))
        except KVIndexError as exc:
            raise KVTransferError(f"KV index lookup failed: {exc}") from exc
        return result.local_pages + len(result.pages)

