"""Prefill/decode handoffs of a tensor-parallel `llm` role: KV pages cross the role whole.

Rank 0's pages hold only its KV heads, but a page that leaves the role, or enters it, is whole
(the whole model's layout), so roles of any TP size feed each other, bit-exact (pages only
change hands by head slices, `kv.py`):

* `llm.decode` here: rank 0 pulls the handoff's whole pages and partial last page from the
  prefill worker (off the engine thread), splits them by head, and admits the request with a
  `ShardSource` (`cache.py`, as prefix matching lands pages pulled from peers): the engine
  stores rank 0's heads, and each follower gets its own heads in the pass (`Shards`, `journal.py`);
* `llm.prefill` here: after the prefill every rank sends its heads of the handoff's pages to
  rank 0 (`BroadcastForward.gather`, on the engine thread: `Export`), which keeps them whole in
  the unit's export store, served by its page server until the decode side lets go.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.errors import LLMUnitError
from engine.compute.llm.loop import EngineLoop
from engine.compute.llm.pd import PrefillDecode, PulledHandoff, pull_tail
from engine.compute.llm.transfer import KVHandoff, handoff_of
from engine.compute.tp.cache import ShardSource
from engine.compute.tp.group import TPGroup
from engine.compute.tp.journal import KVJournal
from engine.compute.tp.kv import pull_whole, split_page
from engine.compute.tp.runner import BroadcastForward
from engine.compute.tp.serve import ServePages, gather_into
from engine.data.kv.errors import KVError
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.ref import KVHold, KVHolder, KVRef
from engine.data.kv.store import KVStore
from engine.data.peer import Peer
from engine.data.tensor_store import TensorStore


def split_handoff(ref: KVRef, pages: Sequence[torch.Tensor], tail: torch.Tensor | None, group: TPGroup,
                  journal: KVJournal, shard: KVLayout) -> PulledHandoff:
    """A decode's handoff as rank 0's engine admits it: `pages` (whole, the leading pulled run of
    the handoff's, which the store lacked) and `tail` split by head."""
    heads = int(ref.layout["num_kv_heads"])
    split = {PageHash(key): split_page(page, heads, group.size)
             for key, page in zip(ref.page_hashes[len(ref.page_hashes) - len(pages):], pages, strict=True)}
    mine = None
    if tail is not None:
        shards = split_page(tail, heads, group.size)
        mine = shards[0]
        journal.save_shards(mine, shards[1:])
    # Rank 0's pages hold its own heads: its engine's layout, not the ref's (the whole model's).
    handoff = dataclasses.replace(handoff_of(ref, mine), layout=shard.to_dict())
    return PulledHandoff(len(pages), handoff, ShardSource(journal, split))


@dataclass(frozen=True, slots=True)
class Export:
    """Engine thread command: gather prefill handoff `handoff` whole; resolve `done` with its tail."""

    handoff: KVHandoff
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[torch.Tensor | None]


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    """Event loop side: `future`'s result (an exception fails it), unless its caller gave up."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class TPEngineLoop(EngineLoop):
    """Rank 0's engine thread, with two commands of its own: a prefill handoff gathered whole
    (`Export`) into `exports`, which the unit's page server serves until the decode side lets go,
    and pages another worker asked for, gathered whole into `exports` unlocked (`ServePages`)."""

    def __init__(self, engine: LLMEngine, name: str, holds_store: Callable[[], TensorStore | None],
                 exports: KVStore) -> None:
        super().__init__(engine, name, holds_store)
        self.exports = exports
        self._exported: dict[str, list[PageHash]] = {}
        self.exported_pages = 0  # an int: read by the heartbeat thread

    def apply(self, command: Any) -> None:
        if isinstance(command, Export):
            self._export(command)
        elif isinstance(command, ServePages):
            self._serve_pages(command)
        else:
            super().apply(command)

    def _serve_pages(self, command: ServePages) -> None:
        """Pages the group serves to other workers, gathered whole into `exports` (`serve.py`)."""
        done = command.done
        try:
            held = gather_into(self.engine, self.exports, command.pages)
        except KVError as exc:
            done.set_exception(LLMUnitError(f"keeping KV pages whole to serve them: {exc}"))
            return
        except BaseException as exc:  # the group broke: the request gets nothing, then the unit fails
            done.set_exception(LLMUnitError(f"{type(exc).__name__}: {exc}"))
            raise
        done.set_result(held)

    def _export(self, command: Export) -> None:
        handoff, done = command.handoff, command.done
        forward = self.engine.forward
        assert isinstance(forward, BroadcastForward)
        try:
            pages, tail = forward.gather(self.engine.store, handoff.page_hashes, handoff.tail,
                                         self.exports.layout.num_kv_heads)
            if pages is not None:
                keys = list(handoff.page_hashes)
                self.exports.put_many(keys, pages)
                self.exports.lock(keys)
                self._exported[handoff.handoff_id] = keys
                self.exported_pages += len(keys)
        except KVError as exc:
            command.loop.call_soon_threadsafe(_settle, done, LLMUnitError(
                f"keeping handoff {handoff.handoff_id}'s pages for the decode side: {exc}"))
            return
        except BaseException as exc:  # the group broke: the caller fails with it, then the unit does
            command.loop.call_soon_threadsafe(_settle, done, LLMUnitError(f"{type(exc).__name__}: {exc}"))
            raise
        command.loop.call_soon_threadsafe(_settle, done, tail)

    def release(self, handoff_id: str) -> None:
        super().release(handoff_id)
        keys = self._exported.pop(handoff_id, None)
        if keys is not None:
            self.exported_pages -= len(keys)
            self.exports.unlock(keys)
            for page in keys:
                if not self.exports.lock_count(page):
                    self.exports.remove(page)

    def failure(self, exc: Exception) -> str:
        # Any engine failure breaks the lockstep (a TPError: the group itself).
        return f"llm role {self.name!r}: the tensor-parallel group failed: {type(exc).__name__}: {exc}"

    def refuse(self, command: Any, error: LLMUnitError) -> None:
        if isinstance(command, Export):
            command.loop.call_soon_threadsafe(_settle, command.done, error)
        elif isinstance(command, ServePages):
            command.done.set_exception(error)
        else:
            super().refuse(command, error)


class TPPrefillDecode(PrefillDecode):
    """Rank 0's prefill and decode kinds: handoffs in the whole model's layout (see the module docstring)."""

    def __init__(self, engine: LLMEngine, loop: EngineLoop, transfer: Callable[[], Peer],
                 worker_id: Callable[[], str | None], *, lease_s: float, pull_timeout_s: float,
                 whole: KVLayout, journal: KVJournal, group: TPGroup) -> None:
        super().__init__(engine, loop, transfer, worker_id, lease_s=lease_s, pull_timeout_s=pull_timeout_s)
        self.whole, self.journal, self.group = whole, journal, group

    def layout(self) -> dict[str, Any]:
        return self.whole.to_dict()

    async def tail(self, handoff: KVHandoff) -> torch.Tensor | None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[torch.Tensor | None] = loop.create_future()
        self.loop.put(Export(handoff, loop, done))
        return await done

    def pull(self, peer: Peer, ref: KVRef, holder: KVHolder, hold: KVHold, node_id: str) -> PulledHandoff:
        where = f"prefill worker {holder.worker_id or '?'} at {holder.address}"
        deadline = time.monotonic() + self.pull_timeout_s
        pages = [PageHash(p) for p in ref.page_hashes]
        with self.pull_errors(node_id, where):
            have = self.engine.store.resident_run(pages)
            whole = pull_whole(peer, holder.address, pages[have:], self.whole, self.pull_timeout_s)
            if have + len(whole) < len(pages):
                raise LLMUnitError(f"node {node_id!r}: {where} holds only {have + len(whole)} of the prompt's"
                                   f" {len(pages)} KV pages (its hold on them ended?)")
            tail = pull_tail(peer, hold, deadline)
        return split_handoff(ref, whole, tail, self.group, self.journal, self.engine.layout)
