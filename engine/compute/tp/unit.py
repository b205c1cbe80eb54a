"""The `llm` compute unit of a role with `tp_size > 1`, as rank processes of a role worker.

A replica of such a role is `tp_size` worker processes. Rank 0 is an ordinary role worker
(the one endpoint the executor knows) hosting `TPLLMUnit`: the `llm` unit (continuous
batching, sessions, streaming, stop strings: everything of `engine.compute.llm.unit`) over
a `TPEngine` of its model shard. Ranks 1.. run `follow()`: no endpoint of their own, only
their shard and engine. The group meets at `TPSeat.address` (rank 0 hosts the rendezvous
store); rank 0 then publishes a ZeroMQ address in the store, each follower connects,
says `TPHello`, and gets `TPSetup` (the sampler seed all ranks use).

Lockstep: every call rank 0's engine thread makes that changes its engine (add, abort,
open a session, step, expire sessions, pull a handoff) is first sent to every follower as a
`TPMessage`, which applies it to its own engine in the same order; the engines are
deterministic and agree on prefix hits (`AgreedPrefixCache`), so the ranks run the same
forwards and meet in the same collectives. Followers answer nothing: rank 0's results are
the role's.

Failure: a follower that dies breaks the group: rank 0's next send fails (the peer is gone)
or its next collective does (gloo notices the closed connection, or the group's timeout
`tp_timeout_s` runs out), and every in-flight node of the replica fails with `TPRankError`'s
message; so does every later call, at once. A follower exits when rank 0 or its launcher is
gone, or when an operation fails on it (which fails the group the same way).

KV across TP sizes, both ways, bit-exact (pages only change hands by head slices):

* `llm.decode` on a TP role: every rank pulls the handoff's whole pages (and partial last
  page) from the prefill worker and keeps its own KV heads (`split_page`), so a prefill role
  of any TP size feeds it;
* `llm.prefill` on a TP role: after the prefill every rank sends its heads of the handoff's
  pages to rank 0 (`TPGroup.gather_tensor`), which keeps them whole (`merge_pages`) in a
  store of the whole model's layout that its page server serves, until the decode side
  lets go; so it feeds a decode role of any TP size, TP-1 included.

Not on tensor-parallel roles: multimodal items, logits processors; rank 0 does not serve
its own (sharded) pages to other workers, and prefix matching does not pull from peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import select
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import LLMEngine
from engine.compute.llm.errors import HandoffError, LLMError
from engine.compute.llm.loop import AddRequest, EngineLoop
from engine.compute.llm.nodes import node_sampling
from engine.compute.llm.pd import PrefillDecode, Pulled
from engine.compute.llm.sequence import RequestOutput
from engine.compute.llm.transfer import KVHandoff, handoff_of
from engine.compute.llm.unit import LLMUnit, LLMUnitError
from engine.compute.models.loader import LoadedModel, load_model
from engine.compute.prefix.keys import MultimodalItem
from engine.compute.sampling import SamplingParams
from engine.compute.tp.engine import TPEngine
from engine.compute.tp.group import TPError, TPGroup
from engine.compute.tp.kv import merge_pages, pull_shards, split_page
from engine.compute.tp.link import SETUP_TIMEOUT_S, FollowerLink, RefusalReporter, greet_leader
from engine.compute.tp.messages import (
    TPAbort,
    TPAdd,
    TPCloseSession,
    TPExpire,
    TPExport,
    TPMessage,
    TPOpenSession,
    TPPullHandoff,
    TPRelease,
    TPStep,
    TPStop,
)
from engine.compute.tp.shard import shard_model
from engine.data.channel import RefGone, TransferError
from engine.data.curve import PlaneKeys
from engine.data.kv.errors import KVError
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout, dtype_name
from engine.data.kv.pull import KVPageServer
from engine.data.kv.ref import KVRef, KVRefError
from engine.data.kv.source import PageSource
from engine.data.kv.store import Capacity, KVStore, KVStoreConfig
from engine.data.peer import Peer, PeerConfig
from engine.data.tensor_store import TensorStore
from engine.spec.calls import NodeCall
from engine.spec.graph import RoleSpec
from engine.spec.resources import role_resources

log = logging.getLogger(__name__)

TP_TIMEOUT_S = 10.0
"""Default deadline of one collective (role param `tp_timeout_s`): a stuck rank fails the role after it."""
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TPMessage)


@dataclass(frozen=True, slots=True)
class TPSeat:
    """Which rank of which group a process is: `rank` of `size`, meeting at `address`
    (`tcp://HOST:PORT`, where rank 0 hosts the rendezvous store)."""

    rank: int
    size: int
    address: str
    heartbeat_s: float = 0.5
    listen_fd: int | None = None
    """Rank 0: the socket listening at `address` that its launcher made (`engine.data.rendezvous`);
    None: rank 0 binds `address` itself."""
    worker_id: str | None = None
    """This rank's worker id (rank 0's is the replica's, named in its prefill handoffs)."""
    keys: PlaneKeys | None = None
    """The worker plane's CURVE keys: the ranks' link and their seats on the transfer plane."""


def tp_timeout_s(role: RoleSpec) -> float:
    value = role.params.get("tp_timeout_s", TP_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise LLMUnitError(f"{role.kind} role {role.name!r}: tp_timeout_s must be a positive number, got {value!r}")
    return float(value)


def rank_device(role: RoleSpec, rank: int) -> str:
    """Where rank `rank` of `role` runs: every rank on the CPU (`cpu`: gloo), or on GPUs counting
    from the role's (`cuda` = `cuda:0`, `cuda:N`: NCCL), each rank `resources.gpus` of them
    (at least one) past the one before. A replica given GPUs sees only those
    (`CUDA_VISIBLE_DEVICES`, `engine.flow.gpus`), so the count starts at its first."""
    device = role.device
    if device == "cpu":
        return "cpu"
    head, _, index = device.partition(":")
    if head == "cuda" and (not index or index.isdigit()):
        stride = max(role_resources(role.resources).per_process.gpus, 1)
        return f"cuda:{int(index or 0) + rank * stride}"
    raise LLMUnitError(f"{role.kind} role {role.name!r}: device {device!r}; a tensor-parallel role runs on cpu or cuda[:N]")


def join_group(role: RoleSpec, seat: TPSeat) -> tuple[TPGroup, str]:
    """Join the replica's group on this rank's device; the group and the device."""
    device = rank_device(role, seat.rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    group = TPGroup.init(seat.rank, seat.size, seat.address, timeout_s=tp_timeout_s(role),
                         rendezvous_timeout_s=SETUP_TIMEOUT_S, backend="gloo" if device == "cpu" else "nccl",
                         device=device, listen_fd=seat.listen_fd)
    return group, device


def shard_to_device(model: LoadedModel, group: TPGroup, device: str) -> LoadedModel:
    shard = shard_model(model, group)
    shard.model.to(device)
    return shard


def load_role_model(role: RoleSpec) -> LoadedModel:
    ref = role.model
    if not ref:
        raise LLMUnitError(f"{role.kind} role {role.name!r} needs a model (a built-in name or a checkpoint directory)")
    dtype = role.params.get("dtype", "float32")
    return load_model(path=ref, dtype=dtype) if Path(ref).is_dir() else load_model(name=ref, dtype=dtype)


def _whole_layout(model: LoadedModel, config: EngineConfig) -> KVLayout:
    return KVLayout(config.page_size, model.num_layers, model.num_kv_heads, model.head_dim, dtype_name(model.dtype))


def _sampling_fields(params: SamplingParams) -> dict[str, Any]:
    if params.logits_processors:
        raise LLMUnitError("logits processors cannot run on a tensor-parallel role (they do not travel to its ranks)")
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "logits_processors"}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


def _sampling_of(fields: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


# -- pulling a handoff's pages, by head ---------------------------------------------------------------


class _HandoffPuller:
    """One rank's side of `TPPullHandoff`: pull a handoff's whole pages and tail from its holder,
    keep this rank's KV heads under the same page keys, then agree with the other ranks."""

    def __init__(self, engine: TPEngine, whole: KVLayout, peer: Callable[[], Peer]) -> None:
        self.engine = engine
        self.whole = whole
        self._peer = peer

    def pull(self, ref: KVRef, timeout_s: float) -> KVHandoff:
        """Every rank calls this for the same handoff, in the same order (it ends in a collective)."""
        group, engine = self.engine.group, self.engine
        problem = ""
        tail = None
        try:
            tail = self._pull(ref, timeout_s)
        except (KVError, KVRefError, TransferError, RefGone, HandoffError) as exc:
            # KVError: the pull failed, or this rank's store had no room for the pages (every rank
            # then fails this request alike, in the collective below, and the group stays whole).
            problem = f"{type(exc).__name__}: {exc}"
        if group.min_int(0 if problem else 1) == 0:
            holder = ref.holder.address if ref.holder is not None else None
            handoff_id = ref.hold.handoff_id if ref.hold is not None else None
            raise HandoffError(f"rank {group.rank}: pulling handoff {handoff_id} from {holder} failed: "
                               + (problem or "another rank could not pull it"))
        # The rank's pages hold its own heads: its engine's layout, not the ref's (the whole model's).
        return dataclasses.replace(handoff_of(ref, tail), layout=engine.layout.to_dict())

    def _mine(self, whole: torch.Tensor) -> torch.Tensor:
        group = self.engine.group
        return split_page(whole, self.whole.num_kv_heads, group.size)[group.rank]

    def _pull(self, ref: KVRef, timeout_s: float) -> torch.Tensor | None:
        deadline = time.monotonic() + timeout_s
        store, group = self.engine.store, self.engine.group
        hold = ref.handoff
        if ref.holder is None:
            raise HandoffError("a handoff that names no holder")
        pages = list(ref.page_hashes)
        have = store.resident_run(pages)
        if have < len(pages):
            got = pull_shards(self._peer(), ref.holder.address, pages[have:], self.whole, group.size, group.rank,
                              timeout_s)
            if len(got) < len(pages) - have:
                raise HandoffError(f"the holder has only {have + len(got)} of the {len(pages)} pages")
            for page, shard in zip(pages[have:], got, strict=True):
                store.put(page, shard)
        if not hold.tail_len:
            return None
        if hold.token is None:
            raise HandoffError("a handoff with a partial last page but no hold token")
        left = max(0.001, deadline - time.monotonic())
        return self._mine(self._peer().pull(hold.token, left).torch().clone())


def _gather_handoff(engine: TPEngine, handoff: KVHandoff,
                    num_kv_heads: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Every rank calls this for the same prefill handoff, in the same order (collectives): rank 0
    gets its whole pages (stacked, None without full pages) and whole partial last page (None
    without one); the other ranks get (None, None). The rank's pages are pinned by the handoff."""
    group = engine.group
    pages = tail = None
    if handoff.page_hashes:
        mine = []
        for page in handoff.page_hashes:
            data = engine.store.get(page, promote=False)
            if data is None:
                raise TPError(f"rank {group.rank}: page {page} of handoff {handoff.handoff_id} is gone")
            mine.append(data)
        shards = group.gather_tensor(torch.stack(mine))
        pages = merge_pages(shards, num_kv_heads) if shards is not None else None
    if handoff.tail_len:
        assert handoff.tail is not None
        shards = group.gather_tensor(handoff.tail)
        tail = merge_pages(shards, num_kv_heads) if shards is not None else None
    return pages, tail


# -- rank 0 ---------------------------------------------------------------------------------------------


class _Broadcasting:
    """Rank 0's engine as the `llm` unit drives it: each state-changing call is sent to the
    followers before it runs here. Reads (`has_request`, `store`, `layout`, ...) go straight
    to the engine. Used only from the unit's engine thread."""

    def __init__(self, engine: TPEngine, send: Callable[[TPMessage], None], puller: _HandoffPuller,
                 pull_timeout_s: float) -> None:
        self._engine = engine
        self._send = send
        self._puller = puller
        self._pull_timeout_s = pull_timeout_s
        self.now = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _tick(self) -> float:
        self.now = time.monotonic()
        return self.now

    def add_request(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, *,
                    request_id: str | None = None, session_id: str | None = None, tenant_salt: str | None = None,
                    mm_items: tuple[MultimodalItem, ...] = (), prefill_only: bool = False,
                    handoff: KVHandoff | None = None, source: object = None, stream_text: bool = False) -> str:
        if mm_items or source is not None or request_id is None:
            raise LLMUnitError("a tensor-parallel role runs no multimodal items")
        params = params or SamplingParams()
        fields = _sampling_fields(params)
        if handoff is not None:
            raise LLMUnitError("a tensor-parallel role admits handoffs through add_handoff")
        self._send(TPAdd(self._tick(), request_id, prompt, fields, session_id, tenant_salt, stream_text,
                         prefill_only=prefill_only))
        return self._engine.add_request(prompt, params, request_id=request_id, session_id=session_id,
                                        tenant_salt=tenant_salt, stream_text=stream_text, prefill_only=prefill_only)

    def add_handoff(self, ref: KVRef, params: SamplingParams, request_id: str, stream_text: bool) -> str:
        """Every rank pulls `ref`'s pages (its own heads), then admits it as `request_id`."""
        fields = _sampling_fields(params)
        self._send(TPPullHandoff(self._tick(), _encoder.encode(ref), self._pull_timeout_s))
        handoff = self._puller.pull(ref, self._pull_timeout_s)
        self._send(TPAdd(self._tick(), request_id, None, fields, stream_text=stream_text,
                         handoff_id=ref.handoff.handoff_id))
        return self._engine.add_request(None, params, request_id=request_id, handoff=handoff,
                                        stream_text=stream_text)

    def export_handoff(self, handoff: KVHandoff) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rank 0's whole pages and partial last page of a prefill handoff (see `_gather_handoff`)."""
        self._send(TPExport(self._tick(), handoff.handoff_id))
        return _gather_handoff(self._engine, handoff, self._puller.whole.num_kv_heads)

    def release_handoff(self, handoff_id: str) -> None:
        self._send(TPRelease(self._tick(), handoff_id))
        self._engine.release_handoff(handoff_id)

    def abort(self, request_id: str) -> None:
        self._send(TPAbort(self._tick(), request_id))
        self._engine.abort(request_id)

    def open_session(self, session_id: str | None = None, *, tenant_salt: str | None = None, turns: int = 0) -> str:
        if session_id is None:
            raise LLMUnitError("a tensor-parallel role opens sessions by id")
        self._send(TPOpenSession(self._tick(), session_id, tenant_salt, turns))
        return self._engine.open_session(session_id, tenant_salt=tenant_salt, turns=turns)

    def close_session(self, session_id: str) -> None:
        self._send(TPCloseSession(self._tick(), session_id))
        self._engine.close_session(session_id)

    def step(self) -> list[RequestOutput]:
        self._send(TPStep(self._tick()))
        return self._engine.step()

    def expire_sessions(self, now: float | None = None) -> list[str]:
        self._send(TPExpire(self._tick()))
        return self._engine.expire_sessions()


@dataclass(frozen=True, slots=True)
class _AddHandoff:
    request_id: str
    ref: KVRef
    params: SamplingParams
    stream_text: bool


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    """Event loop side: `future`'s result (an exception fails it), unless its caller gave up."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


@dataclass(frozen=True, slots=True)
class _Export:
    handoff: KVHandoff
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[torch.Tensor | None]


class TPEngineLoop(EngineLoop):
    """Rank 0's engine thread: its engine is `_Broadcasting`, and it has two commands of its own,
    a decode's handoff pulled by every rank (`_AddHandoff`) and a prefill's handoff gathered whole
    (`_Export`) into `exports`, which the unit's page server serves until the decode side lets go."""

    def __init__(self, engine: LLMEngine, name: str, holds_store: Callable[[], TensorStore | None],
                 exports: KVStore) -> None:
        super().__init__(engine, name, holds_store)
        self.exports = exports
        self._exported: dict[str, list[PageHash]] = {}
        self.exported_pages = 0  # an int: read by the heartbeat thread

    def apply(self, command: Any) -> None:
        if isinstance(command, _Export):
            self._export(command)
        elif isinstance(command, _AddHandoff):
            try:
                self.engine.add_handoff(command.ref, command.params, command.request_id,  # type: ignore[attr-defined]
                                        command.stream_text)
            except LLMError as exc:
                self.deliver(command.request_id, exc)
        else:
            super().apply(command)

    def _export(self, command: _Export) -> None:
        """Gather a prefill handoff from the ranks and keep its pages whole, locked, for the decode
        side; resolve `command.done` with the whole partial last page."""
        handoff = command.handoff
        done = command.done
        try:
            pages, tail = self.engine.export_handoff(handoff)  # type: ignore[attr-defined]
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
        if isinstance(command, AddRequest | _AddHandoff):
            self.deliver(command.request_id, error)
        elif isinstance(command, _Export):
            command.loop.call_soon_threadsafe(_settle, command.done, error)


class TPPrefillDecode(PrefillDecode):
    """Rank 0's prefill and decode kinds: handoffs in the whole model's layout, a prefill's
    pages gathered from the ranks, a decode's pulled by every rank (in the engine thread)."""

    def __init__(self, engine: LLMEngine, loop: EngineLoop, transfer: Callable[[], Peer],
                 worker_id: Callable[[], str | None], *, lease_s: float, pull_timeout_s: float,
                 whole: KVLayout) -> None:
        super().__init__(engine, loop, transfer, worker_id, lease_s=lease_s, pull_timeout_s=pull_timeout_s)
        self.whole = whole

    def layout(self) -> dict[str, Any]:
        return self.whole.to_dict()

    async def tail(self, handoff: KVHandoff) -> torch.Tensor | None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[torch.Tensor | None] = loop.create_future()
        self.loop.put(_Export(handoff, loop, done))
        return await done

    async def decode(self, call: NodeCall, stream: bool) -> AsyncIterator[tuple[RequestOutput, Pulled]]:
        ref, hold = self.handoff_ref(call)
        sampling = node_sampling(call.node_id, {**hold.sampling, **call.params})
        pulled = Pulled(len(ref.page_hashes), ref.holder)
        if hold.finish_reason is not None:
            yield self.finished_at_prefill(ref, hold), pulled
            return
        if hold.token is None or ref.holder is None:
            raise LLMUnitError(f"node {call.node_id!r}: input 'kv': a handoff without a hold token or holder")

        async def admit(request_id: str) -> Pulled:
            self.loop.put(_AddHandoff(request_id, ref, sampling, stream))
            return pulled

        async for item in self.held_decode(call, self.transfer(), hold.token, admit):
            yield item


class TPLLMUnit(LLMUnit):
    """Rank 0 of a tensor-parallel `llm` role (see the module docstring)."""

    def __init__(self, role: RoleSpec, *, tp: TPSeat) -> None:
        if tp.rank != 0 or tp.size < 2:
            raise TPError(f"TPLLMUnit is rank 0 of a group of 2 or more, not rank {tp.rank} of {tp.size}")
        self.seat = tp
        self.group: TPGroup | None = None
        self._link: FollowerLink | None = None
        with contextlib.ExitStack() as undo:
            undo.callback(self._shutdown)  # a half-built rank 0 ends its link and group
            super().__init__(role)
            undo.pop_all()
        self.worker_id = tp.worker_id

    # -- building (runs inside LLMUnit.__init__) ------------------------------------------------------

    def _build_engine(self, model: LoadedModel, config: EngineConfig, kv_store: KVStore | None,
                      peers: list[PageSource]) -> LLMEngine:
        role, seat = self.role, self.seat
        group, device = join_group(role, seat)
        self.group = group
        shard = shard_to_device(model, group, device)
        self._link = FollowerLink(group, seat.address, seat.size, what=f"llm role {role.name!r}", keys=seat.keys)
        seed = config.seed if config.seed is not None else secrets.randbits(62)
        self._link.meet(seed)
        engine = TPEngine(shard, group, dataclasses.replace(config, seed=seed), clock=lambda: broadcast.now)
        puller = _HandoffPuller(engine, _whole_layout(model, config), self._transfer)
        broadcast = _Broadcasting(engine, self._broadcast, puller, self.pull_timeout_s)
        self.whole_layout = puller.whole
        # Prefill handoffs' pages, whole, while their decode sides have not taken them.
        self._exports = KVStore(KVStoreConfig(layout=puller.whole, device_capacity=Capacity(pages=config.device_pages),
                                              device="cpu"))
        return broadcast  # type: ignore[return-value]  # an LLMEngine in all the unit uses

    def _make_loop(self) -> EngineLoop:
        return TPEngineLoop(self.engine, self.role.name, self._holds_store, self._exports)

    def _make_pd(self, lease_s: float) -> PrefillDecode:
        return TPPrefillDecode(self.engine, self.loop, self._transfer, lambda: self.worker_id, lease_s=lease_s,
                               pull_timeout_s=self.pull_timeout_s, whole=self.whole_layout)

    def _transfer(self) -> Peer:
        """The unit's seat on the transfer plane: pulls, hold tokens, and serving the exported
        (whole) pages of its prefill handoffs."""
        with self._lock:
            if self._peer is None:
                self._peer = Peer.start(PeerConfig(keys=self.seat.keys))
                self._own_peer = True
                self._page_server = KVPageServer(self._exports, self._peer.server)
            return self._peer

    def _broadcast(self, message: TPMessage) -> None:
        assert self._link is not None
        self._link.broadcast(message)

    def refused(self) -> int:
        """What rank 0's transfer seat refused (`LLMUnit.refused`), and its link: what the link
        refused and what the follower ranks report their sockets refused."""
        link = self._link
        return super().refused() + (0 if link is None else link.refused)

    def metrics(self) -> dict[str, float]:
        """The `llm.*` counters of rank 0's engine, the pages held whole for decode sides, and the
        group: its size and whether it failed."""
        exported = self.loop.exported_pages  # type: ignore[attr-defined]
        return {**super().metrics(), "llm.exported_pages": float(exported),
                "tp.size": float(self.seat.size), "tp.failed": float(self.failed is not None)}

    def _multimodal(self, call: NodeCall, prompt: str | list[int]) -> tuple[str | list[int],
                                                                           tuple[MultimodalItem, ...]]:
        if call.inputs.get("items") is not None or call.inputs.get("embeds") is not None:
            raise LLMUnitError(f"node {call.node_id!r}: multimodal items do not run on a tensor-parallel role")
        return prompt, ()

    # -- shutdown -------------------------------------------------------------------------------------

    async def close(self) -> None:
        await super().close()
        self._shutdown()
        self._exports.close()

    def _shutdown(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
        if self.group is not None:
            self.group.close()
            self.group = None


# -- ranks 1.. ------------------------------------------------------------------------------------------


class LeaderWatch:
    """Whether a follower rank should stop: its launcher or rank 0 is gone. Rank 0 is watched
    through a pidfd (a recycled pid cannot pass for it); `close()` it."""

    def __init__(self, parent_pid: int | None, leader_pid: int) -> None:
        self.parent_pid = parent_pid
        self.leader_pid = leader_pid
        try:
            self._pidfd: int | None = os.pidfd_open(leader_pid)
        except ProcessLookupError:
            self._pidfd = None

    def gone(self) -> str | None:
        """Why the follower should stop, or None."""
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            return f"its launcher (pid {self.parent_pid}) is gone"
        if self._pidfd is None or select.select([self._pidfd], [], [], 0)[0]:  # readable: it exited
            return f"rank 0 (pid {self.leader_pid}) is gone"
        return None

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class _Follower:
    """A follower rank's engine and the loop applying rank 0's operations to it."""

    def __init__(self, role: RoleSpec, seat: TPSeat, parent_pid: int | None) -> None:
        self.role, self.seat, self.parent_pid = role, seat, parent_pid
        self.now = time.monotonic()
        self.handoffs: dict[str, KVHandoff] = {}
        """Decode handoffs pulled by `TPPullHandoff`, until their `TPAdd`."""
        self.prefilled: dict[str, KVHandoff] = {}
        """Prefill handoffs this rank's engine made, until their `TPExport`."""
        self._peer: Peer | None = None

    def peer(self) -> Peer:
        if self._peer is None:
            self._peer = Peer.start(PeerConfig(keys=self.seat.keys))
        return self._peer

    def refused(self) -> int:
        """Connections this rank's transfer seat refused (rank 0 reports them: `TPRefusals`)."""
        return 0 if self._peer is None else self._peer.server.refused

    def run(self, ready: Callable[[dict[str, Any]], None]) -> int:
        seat = self.seat
        group, device = join_group(self.role, seat)
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        engine: TPEngine | None = None
        try:
            model = load_role_model(self.role)
            shard = shard_to_device(model, group, device)
            setup = greet_leader(sock, group, seat.rank, seat.keys)
            config = dataclasses.replace(EngineConfig.from_params(self.role.params), seed=setup.seed)
            engine = TPEngine(shard, group, config, clock=lambda: self.now)
            puller = _HandoffPuller(engine, _whole_layout(model, config), self.peer)
            ready({"role": self.role.name, "pid": os.getpid(), "tp_rank": seat.rank, "tp_size": seat.size,
                   "leader_pid": setup.leader_pid})
            return self._follow(sock, engine, puller, setup.leader_pid)
        finally:
            if engine is not None:
                engine.close()
            if self._peer is not None:
                self._peer.close()
            sock.close()
            context.term()
            group.close()

    def _follow(self, sock: zmq.Socket, engine: TPEngine, puller: _HandoffPuller, leader_pid: int) -> int:
        watch = LeaderWatch(self.parent_pid, leader_pid)
        try:
            return self._follow_until_stopped(sock, engine, puller, watch)
        finally:
            watch.close()

    def _follow_until_stopped(self, sock: zmq.Socket, engine: TPEngine, puller: _HandoffPuller,
                              watch: LeaderWatch) -> int:
        rank = self.seat.rank
        reporter = RefusalReporter(sock, rank, self.refused, interval_s=self.seat.heartbeat_s)
        while True:
            reporter.tick()
            if not sock.poll(int(self.seat.heartbeat_s * 1000)):
                why = watch.gone()
                if why is not None:
                    log.warning("rank %d stops: %s", rank, why)
                    return 2
                continue
            message = _decoder.decode(sock.recv())
            if isinstance(message, TPStop):
                return 0
            try:
                self._apply(message, engine, puller)
            except LLMError as exc:
                # Rank 0 met the same error on its identical engine and reported it to the caller.
                log.info("rank %d: %s", rank, exc)
            except Exception:  # a follower that cannot follow exits; the group fails at rank 0
                log.exception("rank %d cannot apply %s; exiting", rank, type(message).__name__)
                return 3

    def _apply(self, message: TPMessage, engine: TPEngine, puller: _HandoffPuller) -> None:
        self.now = getattr(message, "now", self.now)
        if isinstance(message, TPStep):
            for out in engine.step():
                if out.handoff is not None:
                    self.prefilled[out.handoff.handoff_id] = out.handoff
        elif isinstance(message, TPAdd):
            handoff = self.handoffs.pop(message.handoff_id) if message.handoff_id is not None else None
            engine.add_request(message.prompt, _sampling_of(message.params), request_id=message.request_id,
                               session_id=message.session_id, tenant_salt=message.tenant_salt,
                               stream_text=message.stream_text, prefill_only=message.prefill_only,
                               handoff=handoff)
        elif isinstance(message, TPExport):
            _gather_handoff(engine, self.prefilled.pop(message.handoff_id), puller.whole.num_kv_heads)
        elif isinstance(message, TPRelease):
            # A prefill released before its TPExport (cancelled, or its export failed) is done too.
            self.prefilled.pop(message.handoff_id, None)
            engine.release_handoff(message.handoff_id)
        elif isinstance(message, TPAbort):
            engine.abort(message.request_id)
        elif isinstance(message, TPOpenSession):
            engine.open_session(message.session_id, tenant_salt=message.tenant_salt, turns=message.turns)
        elif isinstance(message, TPCloseSession):
            engine.close_session(message.session_id)
        elif isinstance(message, TPExpire):
            engine.expire_sessions()
        elif isinstance(message, TPPullHandoff):
            ref = msgspec.msgpack.decode(message.ref, type=KVRef)
            self.handoffs[ref.handoff.handoff_id] = puller.pull(ref, message.timeout_s)
        else:
            raise TPError(f"a follower does not apply {type(message).__name__}")


def follow(role: RoleSpec, seat: TPSeat, *, ready: Callable[[dict[str, Any]], None],
           parent_pid: int | None = None) -> int:
    """Run follower rank `seat.rank` of `role` until rank 0 stops it or is gone; the exit status.
    `ready(details)` is called once the rank is in the group with its shard built."""
    if seat.rank < 1:
        raise TPError(f"follow() runs ranks 1.., not rank {seat.rank}")
    return _Follower(role, seat, parent_pid).run(ready)


__all__ = ["TPLLMUnit", "TPSeat", "follow", "tp_timeout_s"]
