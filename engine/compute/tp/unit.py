"""The `llm` compute unit of a role with `tp_size > 1`: rank 0 of its replica.

A replica of such a role is `tp_size` worker processes. Rank 0 is an ordinary role worker (the
one endpoint the executor knows) hosting `TPLLMUnit`: the `llm` unit (scheduler, prefix cache,
sampling, sessions, streaming, prefill/decode holds, KV tiers: everything of
`engine.compute.llm`) over its model shard, its engine given two parts of its own:

* `MirroredCache` (`cache.py`) and the store's events feed a `KVJournal` (`journal.py`) of what
  the engine does to KV memory, host and disk tiers included;
* `BroadcastForward` (`runner.py`) sends each paged forward to the followers as one `TPPass`
  (those operations, then the forward's inputs) before running its own shard of it.

Ranks 1.. run `follower.follow()`: no endpoint, scheduler or sampler of their own, only their
shard and their heads' KV memory, mirroring each pass. The group meets at `TPSeat.address`
(rank 0 hosts the rendezvous store); rank 0 publishes a ZeroMQ address there, each follower
connects and says `TPHello` (with the pages its disk tier recovered), and gets `TPSetup`.

KV pages leave and enter the role whole (`handoff.py`): a prefill's pages are gathered from the
ranks into an export store rank 0's page server serves; a decode's are pulled whole and split.
So are a prompt's prefix pages that another worker holds: given a transfer seat with a KV index
(`TPLLMUnit(transfer=...)`, as `LLMUnit` gets one in its `UnitContext`; the role worker gives rank
0 its own seat and index), prefix matching asks the index, as on any `llm` role, pulls the pages
whole from the holder off the engine thread, and lands them split by head (`cache.py`: rank 0
stores its heads, each follower gets its own in the next pass). A holder that is dead, silent or
lacks the pages costs at most the pull's timeout (`kv_pull_timeout_s`, capped by
`IndexPageSource.max_timeout_s`); then the prompt is computed.

Failure: a follower that dies breaks the group: rank 0's next send fails (the peer is gone) or
its next collective does (gloo notices the closed connection, or `tp_timeout_s` runs out), and
every in-flight node of the replica fails with the group's error; so does every later call.

Multimodal prompts (`items`/`embeds` inputs) run as on any `llm` role: rank 0 splices them and
keys their pages by item hash (`LLMUnit._multimodal`, the engine's prefix tree); each prefill
chunk's embedding rows go to the followers with its inputs (`embeds.py`).

The group serves the pages it computed whole, as a TP-1 worker serves its own (`serve.py`): rank 0
answers page requests on a peer of its own (the seat it is given lends it only its worker id and KV
index), gathering every rank's heads on the engine thread, and the role worker publishes rank 0's
store (every rank holds the same pages) to the KV index under that peer's address
(`engine.worker.kv.KVServingUnit`). So a TP-1 worker, another TP size, or another role pulls a
prefix a TP group computed, or the pages an `llm` node's `kv` output names (its holder), whole.
A page corrupt on a follower's disk tier is a miss, computed again (`cache.py`).
"""

from __future__ import annotations

import contextlib
from typing import Any

from engine.compute.context import TransferSeat, UnitContext
from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.loop import EngineLoop
from engine.compute.llm.pd import PrefillDecode
from engine.compute.llm.unit import LLMUnit
from engine.compute.models.loader import LoadedModel
from engine.compute.tp.cache import MirroredCache
from engine.compute.tp.follower import follow
from engine.compute.tp.group import TPError
from engine.compute.tp.handoff import TPEngineLoop, TPPrefillDecode
from engine.compute.tp.leader import Leader, lead
from engine.compute.tp.seat import TPSeat, tp_timeout_s
from engine.compute.tp.serve import GroupPageServer
from engine.data.kv.source import PageSource
from engine.data.kv.store import Capacity, KVStore, KVStoreConfig
from engine.data.peer import Peer, PeerConfig
from engine.data.server import ServerConfig
from engine.spec.graph import RoleSpec


class TPLLMUnit(LLMUnit):
    """Rank 0 of a tensor-parallel `llm` role (see the module docstring)."""

    def __init__(self, role: RoleSpec, *, tp: TPSeat, transfer: TransferSeat | None = None) -> None:
        """`transfer`: rank 0's seat on the transfer plane (its `Peer`, worker id and KV index), where
        prefix matching finds and pulls the pages other workers hold, and where the unit serves its
        prefill handoffs' whole pages (so no other KV store may be served on that peer); None: no
        pulls from peers, and a peer of the unit's own (with `tp.keys`) the first time a prefill
        or decode node needs one."""
        if tp.rank != 0 or tp.size < 2:
            raise TPError(f"TPLLMUnit is rank 0 of a group of 2 or more, not rank {tp.rank} of {tp.size}")
        self.seat = tp
        self.leader: Leader | None = None
        self._exports: KVStore | None = None
        own = None if transfer is None else Peer.start(PeerConfig(
            server=ServerConfig(bind=f"tcp://{_host(transfer.peer.address)}:0"), keys=tp.keys))
        with contextlib.ExitStack() as undo:
            undo.callback(self._shutdown)  # a half-built rank 0 ends its link, group and stores
            if own is not None:
                undo.callback(own.close)
            # Only the seat (its own peer, see `serve.py`): rank 0 shards its model and keeps its own
            # (sharded) KV store.
            seat = None if transfer is None or own is None else TransferSeat(own, transfer.worker_id, transfer.index)
            super().__init__(role, UnitContext(seat=seat))
            undo.pop_all()
        self._own_peer = own is not None or self._own_peer
        self.worker_id = tp.worker_id or self.worker_id

    # -- building (runs inside LLMUnit.__init__) ------------------------------------------------------

    def _build_engine(self, model: LoadedModel, config: EngineConfig, kv_store: KVStore | None,
                      peers: list[PageSource]) -> LLMEngine:
        self.leader = leader = lead(self.role, model, config, self.seat, peers)
        self.group, self.journal, self.whole_layout = leader.group, leader.journal, leader.whole
        # Prefill handoffs' pages, whole, while their decode sides have not taken them.
        self._exports = KVStore(KVStoreConfig(layout=leader.whole, device="cpu",
                                              device_capacity=Capacity(pages=config.device_pages)))
        return leader.engine

    def _make_loop(self) -> EngineLoop:
        assert self._exports is not None
        return TPEngineLoop(self.engine, self.role.name, self._holds_store, self._exports)

    def _make_pd(self, lease_s: float) -> PrefillDecode:
        return TPPrefillDecode(self.engine, self.loop, self._transfer, lambda: self.worker_id, lease_s=lease_s,
                               pull_timeout_s=self.pull_timeout_s, whole=self.whole_layout, journal=self.journal,
                               group=self.group)

    def _transfer(self) -> Peer:
        """The unit's seat on the transfer plane (always a peer of its own): pulls, hold tokens, and
        serving whole pages: its prefill handoffs' and, on request, any the group holds (`serve.py`)."""
        with self._lock:
            if self._peer is None:
                self._peer = Peer.start(PeerConfig(keys=self.seat.keys))
                self._own_peer = True
            if self._page_server is None:
                assert self._exports is not None
                self._page_server = GroupPageServer(self._exports, self._peer.server, self.loop.put,
                                                    self.engine.store.resident_run)
            return self._peer

    def serve_kv(self) -> Peer:
        """Where the group's pages are served whole (`engine.worker.kv.KVServingUnit`): the unit's
        own peer, whose server may wait on the engine thread (`serve.py`)."""
        return self._transfer()

    def kv_meta(self) -> dict[str, Any]:
        """`LLMUnit.kv_meta`, with the layout the group's pages are served in: the whole model's."""
        return {**super().kv_meta(), "layout": self.whole_layout.fingerprint()}

    def refused(self) -> int:
        """What rank 0's transfer seat refused (`LLMUnit.refused`), and its link."""
        leader = self.leader
        return super().refused() + (0 if leader is None else leader.link.refused)

    def metrics(self) -> dict[str, float]:
        """The `llm.*` counters of rank 0's engine, the pages held whole for decode sides, and the
        group: its size, whether it failed, the pages a follower's disk tier found corrupt, and the
        page requests the engine thread gathered nothing for in time (`serve.py`)."""
        exported = self.loop.exported_pages  # type: ignore[attr-defined]
        cache = self.engine.cache
        assert isinstance(cache, MirroredCache)
        server = self._page_server
        late = server.late if isinstance(server, GroupPageServer) else 0
        return {**super().metrics(), "llm.exported_pages": float(exported),
                "tp.size": float(self.seat.size), "tp.failed": float(self.failed is not None),
                "tp.corrupt_pages": float(cache.corrupt_pages), "tp.serve_late": float(late)}

    # -- shutdown -------------------------------------------------------------------------------------

    async def close(self) -> None:
        await super().close()
        self._shutdown()

    def _shutdown(self) -> None:
        """After the engine closed (or was never built): the followers, the group, the stores."""
        if self.leader is not None:
            self.leader.close_group()
            self.leader = None
        if self._exports is not None:
            self._exports.close()
            self._exports = None


def _host(address: str) -> str:
    """The host of a `tcp://HOST:PORT` address (where the worker's own peer listens)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit():
        raise TPError(f"transfer address {address!r} is not tcp://HOST:PORT")
    return host


__all__ = ["TPLLMUnit", "TPSeat", "follow", "tp_timeout_s"]
