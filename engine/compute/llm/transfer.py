"""Prefill/decode disaggregation: what a prefill runner hands a decode runner, and how pages move.

A prefill runner computes a prompt's KV and its first token and returns a `KVHandoff`:
the page keys of the prompt's full pages (which it keeps locked until the handoff is
released), the K/V of the trailing partial page, and the first token. A decode runner
that admits the handoff brings whichever of those pages it lacks into its own store
from a `PageSource` (`engine.data.kv.source`) and decodes from there. Nothing else is shared.

Between processes a handoff travels as a `KVHandoffRef`, the value of an `llm.prefill`
node's `kv` port: plain data (page keys, first token, the holder's data address) plus one
`TensorRef`, the *hold token*. The prefill worker keeps the prompt's pages locked for as long
as that ref lives in its tensor store; it holds the K/V of the partial last page (a
one-element placeholder when the prompt ends on a page boundary). The decode side pulls the
pages and the tail, then releases the ref; if it never does (it died), the ref's lease ends
the hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from engine.data.kv.keys import PageHash
from engine.data.wire import TensorRef


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
