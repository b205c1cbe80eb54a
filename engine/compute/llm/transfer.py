"""Prefill/decode disaggregation: what a prefill runner hands a decode runner, and how pages move.

A prefill runner computes a prompt's KV and its first token and returns a `KVHandoff`:
the page keys of the prompt's full pages (which it keeps locked until the handoff is
released), the K/V of the trailing partial page, and the first token. A decode runner
that admits the handoff pulls whichever of those pages it lacks from a `PageSource`
(the prefill worker over the transfer plane; `StorePageSource` in one process), puts
them in its own store and decodes from there. Nothing else is shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.data.kv.errors import KVTransferError
from engine.data.kv.keys import PageHash
from engine.data.kv.store import KVStore


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


class PageSource(Protocol):
    """Where a runner pulls pages it does not hold (a peer worker, the prefill worker)."""

    def fetch(self, pages: Sequence[PageHash], timeout_s: float) -> list[torch.Tensor]:
        """The leading `pages` that the source holds, in order (fewer when it lacks one).

        Raises `KVTransferError` when the source fails or does not answer in time.
        """
        ...


class StorePageSource:
    """A `PageSource` over a `KVStore` of this process: copies, read without promotion.

    Counts what it serves in the source store's pull metrics.
    """

    def __init__(self, store: KVStore) -> None:
        self._store = store

    def fetch(self, pages: Sequence[PageHash], timeout_s: float) -> list[torch.Tensor]:
        del timeout_s  # a local copy does not wait
        out: list[torch.Tensor] = []
        for page in pages:
            data = self._store.get(page, promote=False)
            if data is None:
                break
            if data.device.type != "cpu":
                data = data.cpu()
            out.append(data)
        return out


def check_pages(pages: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Reject pulled pages that are not pages of the expected layout."""
    for page in pages:
        if tuple(page.shape) != shape or page.dtype != dtype:
            raise KVTransferError(f"pulled page of shape {tuple(page.shape)} {page.dtype}, expected {shape} {dtype}")
