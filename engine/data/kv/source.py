"""Page sources: where a store gets KV pages it does not hold (the pull side of the Data Flow).

A `PageSource` puts the leading run of the asked pages that it holds straight into the asking
`KVStore` (the caller locks them after). The llm engine's prefix matching and decode admission
and the diffusion role's prompt encoding all pull through one:

* `StorePageSource`: another `KVStore` of this process (tests, one-process setups);
* `HolderPageSource`: a worker known to hold the pages (the holder a `KVRef` names: the worker
  that computed them, the prefill worker of a handoff), over the transfer plane
  (`engine.data.kv.pull.fetch_pages`);
* `IndexPageSource`: whichever live worker the distributed index names as holding the longest
  run (`engine.data.kv.pull.pull_missing`): prefix matching across workers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from engine.data.kv.errors import KVIndexError, KVTransferError
from engine.data.kv.keys import PageHash
from engine.data.kv.pull import KVHolderIndex, fetch_pages, pull_missing
from engine.data.kv.store import KVStore

if TYPE_CHECKING:
    from engine.data.peer import Peer


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
    """A `PageSource` at a known worker's data address (the holder a `KVRef` names)."""

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


__all__ = ["HolderPageSource", "IndexPageSource", "PageSource", "StorePageSource"]
