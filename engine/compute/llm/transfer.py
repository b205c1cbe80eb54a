"""Prefill/decode disaggregation: what a prefill runner hands a decode runner, and how pages move.

A prefill runner computes a prompt's KV and its first token and returns a `KVHandoff`:
the page keys of the prompt's full pages (which it keeps locked until the handoff is
released), the K/V of the trailing partial page, and the first token. A decode runner
that admits the handoff brings whichever of those pages it lacks into its own store
from a `PageSource` (`engine.data.kv.source`) and decodes from there. Nothing else is shared.

Between processes a handoff travels as a `KVRef` (`engine.data.kv.ref`), the value of an
`llm.prefill` node's `kv` port, with a `KVHold`: the first token and the *hold token*, a
`TensorRef` the prefill worker keeps the prompt's pages locked for (see `KVHold`);
`handoff_of` turns it back into a `KVHandoff` once the decode side has pulled the pages and
the tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.data.kv.keys import PageHash
from engine.data.kv.ref import KVRef


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


def handoff_of(ref: KVRef, tail: torch.Tensor | None) -> KVHandoff:
    """The engine's `KVHandoff` for a prefill hand-off that arrived as a `KVRef` (its pages
    pulled, its partial last page `tail`). Raises `KVRefError` when `ref` carries no hold."""
    hold = ref.handoff
    assert ref.layout is not None  # `handoff` checked it
    return KVHandoff(
        handoff_id=hold.handoff_id,
        model_id=ref.model_id,
        layout=dict(ref.layout),
        tenant_salt=ref.tenant_salt,
        prompt_ids=tuple(ref.prompt_ids),
        key_ids=tuple(ref.key_ids),
        page_hashes=tuple(ref.page_hashes),
        tail_len=hold.tail_len,
        tail=tail,
        first_token=hold.first_token,
    )
