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

from dataclasses import dataclass, field

import torch

from engine.compute.prefix.keys import MultimodalItem
from engine.compute.prefix.radix import Namespace, RadixNode
from engine.data.kv.keys import PageHash


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
