"""The prefill side of prefill/decode disaggregation: the handoffs an engine has made.

A request added with `prefill_only` ends after its first token with a `KVHandoff`: its prompt,
the hash chain of its full pages, its partial last page (a copy) and that first token. Its
full pages stay pinned (store locks and the tree node over them) until the decode side has
them and the handoff is released, so nothing evicts what another worker is about to pull.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.compute.llm.cache import PagedKVCache
from engine.compute.llm.errors import UnknownRequestError
from engine.compute.llm.sequence import Sequence
from engine.compute.llm.transfer import KVHandoff
from engine.compute.prefix.radix import RadixNode
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout


@dataclass(slots=True)
class _Lease:
    pages: list[PageHash]
    node: RadixNode | None


class Handoffs:
    """The handoffs made and not yet released, by handoff id (the request id). Owned by the
    engine thread."""

    def __init__(self, cache: PagedKVCache, model_id: str, layout: KVLayout) -> None:
        self._cache = cache
        self._model_id = model_id
        self._layout = layout
        self._leases: dict[str, _Lease] = {}

    def make(self, seq: Sequence) -> KVHandoff:
        """The handoff of `seq`, a prefill-only request that has its first token; pins its pages."""
        self._cache.pin(seq.pages, seq.node)
        self._leases[seq.request_id] = _Lease(list(seq.pages), seq.node)
        return KVHandoff(
            handoff_id=seq.request_id,
            model_id=self._model_id,
            layout=self._layout.to_dict(),
            tenant_salt=seq.namespace[1],
            prompt_ids=tuple(seq.prompt_ids),
            key_ids=tuple(seq.key_ids[: seq.prompt_len]),
            page_hashes=tuple(seq.pages),
            tail_len=self._cache.tail_len(seq),
            tail=self._cache.copy_tail(seq),
            first_token=seq.output_ids[0],
        )

    def release(self, handoff_id: str) -> None:
        """The decode side has the pages: drop the hold the handoff kept on them."""
        lease = self._leases.pop(handoff_id, None)
        if lease is None:
            raise UnknownRequestError(handoff_id)
        self._cache.unpin(lease.pages, lease.node)

    def release_all(self) -> None:
        for handoff_id in list(self._leases):
            self.release(handoff_id)

    @property
    def pinned_pages(self) -> int:
        return sum(len(lease.pages) for lease in self._leases.values())
