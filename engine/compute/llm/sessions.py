"""Multi-turn sessions: the conversation's tokens and KV kept server-side between turns.

A turn sends only its new message; the engine prepends the session's history. Between
turns the session *pins* the KV of its history — store locks on its full pages (which
keep them in the device tier), a tree lock on their prefix, and a copy of its partial
last page — so the next turn computes only its new tokens. An idle session's pins are
released after its TTL (its pages then age out through the tiers like any others);
its history stays until the session is closed, so a late turn still works, matching
whatever is left of its prefix.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.compute.llm.errors import RequestError, SessionBusyError, SessionNotFoundError
from engine.compute.llm.sequence import FinishReason, Sequence
from engine.compute.prefix.keys import MultimodalItem
from engine.compute.prefix.radix import Namespace, RadixNode
from engine.data.kv.keys import PageHash

if TYPE_CHECKING:
    from engine.compute.llm.cache import PagedKVCache


@dataclass(slots=True, eq=False)
class Session:
    """One conversation. `kv_len` tokens of `token_ids` have K/V: `pages` (full pages) and,
    when `tail` is set, `kv_len - len(pages) * page_size` tokens in the `tail` copy."""

    session_id: str
    namespace: Namespace
    ttl_s: float
    last_used: float
    token_ids: list[int] = field(default_factory=list)
    key_ids: list[int] = field(default_factory=list)
    mm_items: list[MultimodalItem] = field(default_factory=list)
    kv_len: int = 0
    pages: list[PageHash] = field(default_factory=list)
    node: RadixNode | None = None
    tail: torch.Tensor | None = None
    pinned: bool = False
    busy: bool = False
    turns: int = 0

    def idle_expired(self, now: float) -> bool:
        return self.pinned and not self.busy and now - self.last_used > self.ttl_s


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A read-only view of a session for callers (ids, sizes, state)."""

    session_id: str
    turns: int
    tokens: int
    cached_pages: int
    pinned: bool
    busy: bool

    @classmethod
    def of(cls, session: Session) -> SessionInfo:
        return cls(
            session_id=session.session_id,
            turns=session.turns,
            tokens=len(session.token_ids),
            cached_pages=len(session.pages),
            pinned=session.pinned,
            busy=session.busy,
        )


class Sessions:
    """An engine's open sessions, and the KV each pins between turns in `cache` (full pages
    and the tree node over them; the partial last page as a copy). Owned by the engine thread."""

    def __init__(self, cache: PagedKVCache, model_id: str, ttl_s: float, clock: Callable[[], float]) -> None:
        self._cache = cache
        self._model_id = model_id
        self._ttl_s = ttl_s
        self._clock = clock
        self._open: dict[str, Session] = {}

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def open(self, session_id: str | None, tenant_salt: str | None, ttl_s: float | None, turns: int) -> str:
        session_id = session_id or f"sess-{uuid.uuid4().hex[:12]}"
        if session_id in self._open:
            raise RequestError(f"session {session_id!r} is already open")
        self._open[session_id] = Session(
            session_id=session_id,
            namespace=(self._model_id, tenant_salt),
            ttl_s=ttl_s if ttl_s is not None else self._ttl_s,
            last_used=self._clock(),
            turns=turns,
        )
        return session_id

    def get(self, session_id: str) -> Session:
        try:
            return self._open[session_id]
        except KeyError:
            raise SessionNotFoundError(session_id) from None

    def for_turn(self, session_id: str) -> Session:
        """The session a new turn goes to; SessionBusyError while its last turn runs."""
        session = self.get(session_id)
        if session.busy:
            raise SessionBusyError(f"session {session_id!r} already has a turn in flight")
        return session

    def close(self, session_id: str) -> None:
        session = self.get(session_id)
        if session.busy:
            raise SessionBusyError(f"session {session_id!r} has a turn in flight; abort it first")
        self._unpin(session)
        del self._open[session_id]

    def close_all(self) -> None:
        for session_id in list(self._open):
            self.close(session_id)

    def expire(self, now: float | None = None) -> list[str]:
        """Unpin sessions idle for longer than their TTL; returns their ids."""
        now = self._clock() if now is None else now
        expired = [s for s in self._open.values() if s.idle_expired(now)]
        for session in expired:
            self._unpin(session)
        return [s.session_id for s in expired]

    @property
    def pinned_pages(self) -> int:
        return sum(len(s.pages) for s in self._open.values() if s.pinned)

    def restore_tail(self, seq: Sequence, page_size: int) -> None:
        """A turn that matched exactly its session's pinned pages gets the pinned partial last
        page back, so it computes only its new tokens."""
        session = self._open.get(seq.session_id) if seq.session_id is not None else None
        if session is None or not session.pinned or session.tail is None or seq.pages != session.pages:
            return
        tokens = session.kv_len - len(session.pages) * page_size
        if 0 < tokens and session.kv_len < len(seq.token_ids):
            self._cache.restore_tail(seq, session.tail, tokens)

    def end_turn(self, seq: Sequence, reason: FinishReason, now: float, prefix_cache: bool) -> None:
        """`seq`, a turn of an open session, ended: a finished turn becomes the session's history
        (and its KV is pinned in place of the last turn's); an aborted or failed one leaves it."""
        session = self._open.get(seq.session_id) if seq.session_id is not None else None
        if session is None:
            return
        session.busy = False
        session.last_used = now
        if reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        if prefix_cache and seq.tail_slot is not None:
            self._cache.pin(seq.pages, seq.node)
            tail = self._cache.copy_tail(seq)
            self._unpin(session)
            session.pages, session.node, session.tail, session.pinned = list(seq.pages), seq.node, tail, True
            session.kv_len = seq.num_computed
        session.token_ids = list(seq.token_ids)
        session.key_ids = list(seq.key_ids)
        session.mm_items = list(seq.mm_items)
        session.turns += 1

    def _unpin(self, session: Session) -> None:
        if session.pinned:
            self._cache.unpin(session.pages, session.node)
        session.pinned = False
        session.tail = None
