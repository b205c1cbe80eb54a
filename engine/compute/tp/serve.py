"""A tensor-parallel `llm` role serves the KV pages it computed whole, as a TP-1 worker serves its own.

Rank 0's store holds only its own KV heads of each page (each follower holds its own at the same
slots), but a page leaves the role whole (`handoff.py`), so a `KVFetchRequest` for pages the group
holds needs every rank's heads: a collective (`BroadcastForward.gather`), which only the engine
thread may run, in order with the passes. So `GroupPageServer`, the handler of rank 0's page
requests, asks the engine thread for them (`ServePages`, run between two steps): it gathers the
leading run of the asked pages that the group holds into the unit's store of whole pages (the one that keeps prefill handoffs for their decode sides; pages gathered
for a request stay there unlocked, evicted as it needs room, so a second puller of the same
prefix costs no second gather), then answers as `KVPageServer` does from that store.

Waiting for the engine thread holds the serving thread up to `SERVE_WAIT_S`, where a page server's
handler must never wait on another process (`TensorServer.register_handler`): so the unit serves
on a peer of its own (`unit.py`), whose server answers only the unit's transfers (page requests,
its hold tokens' and handoffs' pulls), never the worker's node outputs or weights.

Pages are read where they are, the disk tier included, as `KVPageServer` reads them. Not served:
a page corrupt on some rank's disk tier (dropped from every rank's, as when rank 0 promotes one,
`cache.py`), and pages the engine thread could not gather within `SERVE_WAIT_S` (a long step): the
puller gets the run before them, and computes the rest, as from any holder that lacks pages.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.errors import LLMUnitError
from engine.compute.tp.cache import MirroredCache
from engine.compute.tp.runner import BroadcastForward
from engine.data.kv.keys import PageHash
from engine.data.kv.pull import KVPageServer
from engine.data.kv.store import KVStore
from engine.data.server import TensorServer
from engine.data.wire import KVFetchReply, KVFetchRequest

log = logging.getLogger(__name__)

SERVE_WAIT_S = 2.0
"""How long a page request waits for the engine thread to gather the group's pages (a puller
matching a prefix waits at most `IndexPageSource.max_timeout_s`, 2 s by default, anyway)."""


@dataclass(frozen=True, slots=True)
class ServePages:
    """Engine thread command: gather the leading run of `pages` the group holds into the
    store of whole pages; `done` gets how many it holds there (an `LLMUnitError` when it failed)."""

    pages: tuple[PageHash, ...]
    done: concurrent.futures.Future[int]


def gather_into(engine: LLMEngine, whole: KVStore, pages: Sequence[PageHash]) -> int:
    """On the engine thread: every rank's heads of the leading run of `pages` the group holds (read
    where they are, nothing promoted), merged and put into `whole` unlocked; how many of `pages`
    lead in `whole` afterwards. A page corrupt on a rank's disk tier ends the run and is dropped
    from every rank's (rank 0's store drops its own when its checksum fails; a follower's is
    counted in `MirroredCache.corrupt_pages`)."""
    store = engine.store
    missing: list[PageHash] = []
    mine: list[torch.Tensor] = []
    for page in pages:
        if whole.resident_run([page]):
            continue
        data = store.get(page, promote=False)
        if data is None:
            break
        missing.append(page)
        mine.append(data)
    if missing:
        forward, cache = engine.forward, engine.cache
        assert isinstance(forward, BroadcastForward) and isinstance(cache, MirroredCache)
        merged, corrupt = forward.gather_checked(missing, mine, whole.layout.num_kv_heads)
        intact = missing.index(corrupt[0]) if corrupt else len(missing)
        whole.put_many(missing[:intact], merged[:intact])
        if corrupt:
            log.warning("%d KV pages to serve are corrupt on a follower's disk tier (first %s): dropped on every"
                        " rank", len(corrupt), corrupt[0][:16])
            cache.corrupt_pages += len(corrupt)
            for page in corrupt:
                store.remove(page)  # only on the disk tier (else read from memory): never locked
    return whole.resident_run(pages)


class GroupPageServer:
    """Answers `KVFetchRequest`s on `server` (the unit's own) from `whole`, the unit's store of whole
    pages, after asking the engine thread (`put`) for the group's pages it lacks (see the module
    docstring). `held(pages)`: how many leading `pages` rank 0's store holds. `close()` unregisters it."""

    def __init__(self, whole: KVStore, server: TensorServer, put: Callable[[Any], None],
                 held: Callable[[Sequence[PageHash]], int], *, wait_s: float = SERVE_WAIT_S) -> None:
        self._whole = whole
        self._put = put
        self._held = held
        self.wait_s = wait_s
        self.late = 0
        """Requests the engine thread did not answer within `wait_s` (read by the heartbeat)."""
        self._pages = KVPageServer(whole, server)
        self._fingerprint = whole.layout.fingerprint()
        server.register_handler(KVFetchRequest, self.serve)  # in place of `_pages`' own: gather first

    def serve(self, request: KVFetchRequest) -> KVFetchReply:
        if request.layout == self._fingerprint and len(request.pages) <= self._pages.max_pages:
            pages = [PageHash(page) for page in request.pages]
            rest = pages[self._whole.resident_run(pages):]
            run = self._held(rest) if rest else 0
            if run:
                done: concurrent.futures.Future[int] = concurrent.futures.Future()
                self._put(ServePages(tuple(rest[:run]), done))
                try:
                    done.result(timeout=self.wait_s)
                except concurrent.futures.TimeoutError:
                    self.late += 1
                    log.info("the engine thread gathered no KV pages to serve within %.1fs", self.wait_s)
                except LLMUnitError as exc:  # the gather failed, or the engine thread did
                    log.warning("gathering %d KV pages to serve failed: %s", run, exc)
        return self._pages.serve(request)  # refuses another layout, or too many pages

    def close(self) -> None:
        self._pages.close()


__all__ = ["SERVE_WAIT_S", "GroupPageServer", "ServePages", "gather_into"]
