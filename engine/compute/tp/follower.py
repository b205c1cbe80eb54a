"""A follower rank of a tensor-parallel `llm` role: its heads' KV memory and the loop that follows rank 0.

A follower holds no scheduler, sampler, prefix tree or sessions: only its model shard, its
`ShardKV` (its KV heads of every page rank 0 holds, at the same device slots, and in its own
host and disk tiers), and a loop: receive a `TPPass` -> mirror its KV operations -> run its
shard of the forward (a prefill chunk's multimodal embedding rows come with its inputs:
`embeds.py`), or send its heads of some pages to rank 0. The row-parallel layers'
all-reduces pair its forward with rank 0's.

Its disk tier is its own (`disk_path/rank-N`): the pages it recovered from an earlier run go to
rank 0 with the hello, and it keeps those rank 0 agrees every rank has (`TPSetup.disk_pages`).

A page its disk tier finds corrupt as rank 0 promotes it (a checksum that fails) is no failure:
the follower notes it (`ShardKV.corrupt`, logged), rank 0's next `CheckPages` learns it, and rank
0 drops the page from every tier before any forward reads it, so the prompt computes it again.

Failure: a follower exits when rank 0 or its launcher is gone (`LeaderWatch`), and when it
cannot apply a pass, which breaks the group at rank 0's next collective.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from engine.compute.llm.config import EngineConfig
from engine.compute.llm.engine import engine_layout, open_disk_slot
from engine.compute.llm.forward import DecodeBatch, DecodeBuffer, PagedForward, PrefillChunk
from engine.compute.tp.embeds import chunk_embeds
from engine.compute.tp.group import TPError, TPGroup
from engine.compute.tp.link import greet_leader
from engine.compute.tp.messages import (
    CheckPages,
    CopyPage,
    DecodeInputs,
    DropPage,
    ForgetTail,
    Fresh,
    GatherRequest,
    KVOp,
    PageOrigin,
    PrefillInputs,
    Saved,
    SaveTail,
    SetTail,
    Shards,
    Tail,
    TPMessage,
    TPPass,
    WritePage,
)
from engine.compute.tp.seat import (
    LeaderWatch,
    TPSeat,
    follow_leader,
    join_group,
    load_role_model,
    shard_to_device,
)
from engine.data.kv.copy import copy_page
from engine.data.kv.disk import DiskTier
from engine.data.kv.host import HostTier
from engine.data.kv.keys import PageHash
from engine.data.kv.layout import KVLayout
from engine.data.kv.tier import Tier
from engine.spec.graph import RoleSpec

log = logging.getLogger(__name__)
_decoder = msgspec.msgpack.Decoder(TPMessage)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """`config` for rank `rank`: its disk tier under `disk_path/rank-N` (each rank's pages hold its
    own heads under the whole model's page keys: a rank never takes over another's disk slot)."""
    if not config.disk_path:
        return config
    return dataclasses.replace(config, disk_path=str(Path(config.disk_path) / f"rank-{rank}"))


class ShardKV:
    """A follower's KV memory, as rank 0's operations leave it (see the module docstring)."""

    def __init__(self, config: EngineConfig, layout: KVLayout, device: str, rank: int) -> None:
        self.layout, self.rank = layout, rank
        shape, dtype = layout.page_shape, layout.torch_dtype
        self.pool = torch.empty((config.device_pages, *shape), dtype=dtype, device=device)
        self.slots: dict[PageHash, int] = {}
        self.tails = torch.zeros((config.max_running, *shape), dtype=dtype, device=device)
        self.saved: dict[int, torch.Tensor] = {}
        self.fresh: list[torch.Tensor] = []
        self.host = HostTier(layout, config.host_pages) if config.host_pages else None
        self.corrupt: set[PageHash] = set()
        """Pages promoted from this rank's disk tier that failed their checksum (their device slot
        holds garbage), until rank 0 drops them from its disk tier too."""
        self.disk: DiskTier | None = None
        if config.disk_path:
            disk_path, pages = config.disk_path, config.disk_pages
            self.disk = open_disk_slot(disk_path, layout, lambda directory: DiskTier(layout, pages, directory))

    def close(self) -> None:
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.close()

    def recovered(self) -> list[str]:
        """The pages the disk tier recovered from an earlier run."""
        return list(self.disk.pages()) if self.disk is not None else []

    def keep_recovered(self, pages: list[str]) -> None:
        """Drop every recovered page but `pages` (those rank 0 keeps)."""
        keep = set(pages)
        for page in self.recovered():
            if page not in keep:
                assert self.disk is not None
                self.disk.remove(PageHash(page))

    # -- mirroring ------------------------------------------------------------------------------------

    def apply(self, op: KVOp) -> None:
        if isinstance(op, WritePage):
            copy_page(self.pool[op.slot], self._origin(op.origin))
            self.slots[PageHash(op.page)] = op.slot
        elif isinstance(op, CopyPage):
            self._copy(PageHash(op.page), Tier(op.source), Tier(op.tier), op.slot)
        elif isinstance(op, DropPage):
            self._drop(PageHash(op.page), Tier(op.tier))
        elif isinstance(op, SetTail):
            self.tails[op.slot].copy_(self._origin(op.origin))
        elif isinstance(op, SaveTail):
            self.saved[op.id] = self._origin(op.origin).clone()
        elif isinstance(op, ForgetTail):
            del self.saved[op.id]
        else:
            raise TPError(f"a follower does not mirror {type(op).__name__}")

    def _origin(self, origin: PageOrigin) -> torch.Tensor:
        if isinstance(origin, Fresh):
            return self.fresh[origin.chunk][origin.index]
        if isinstance(origin, Tail):
            return self.tails[origin.slot]
        if isinstance(origin, Saved):
            return self.saved[origin.id]
        assert isinstance(origin, Shards)
        raw = torch.frombuffer(bytearray(origin.data[self.rank - 1]), dtype=torch.uint8)
        return raw.view(self.layout.torch_dtype).view(self.layout.page_shape).to(self.pool.device)

    def _copy(self, page: PageHash, source: Tier, tier: Tier, slot: int) -> None:
        if tier is Tier.DEVICE:
            if source is Tier.HOST:
                assert self.host is not None
                copy_page(self.pool[slot], self.host.view(page))
            else:
                if self.disk is None or page not in self.disk:
                    raise TPError(f"rank {self.rank}: page {page[:16]} is not on this rank's disk tier")
                staging = torch.empty(self.layout.page_shape, dtype=self.layout.torch_dtype)
                if self.disk.read_into(page, staging):  # False: corrupt, and removed from the disk tier
                    copy_page(self.pool[slot], staging)
                else:
                    log.warning("rank %d: KV page %s failed its checksum on this rank's disk tier; rank 0"
                                " drops it and the prompt computes it again", self.rank, page[:16])
                    self.corrupt.add(page)
            self.slots[page] = slot
            return
        target = self.host if tier is Tier.HOST else self.disk
        assert target is not None
        if page in target:  # a demotion to a tier that holds the page already only touches it
            return
        target.write(page, self.read(page, source))

    def _drop(self, page: PageHash, tier: Tier) -> None:
        if tier is Tier.DEVICE:
            if self.slots.pop(page, None) is None:
                raise TPError(f"rank {self.rank}: page {page[:16]} left a device slot it never had here")
            return
        target = self.host if tier is Tier.HOST else self.disk
        if tier is Tier.DISK and page in self.corrupt:
            self.corrupt.discard(page)  # its disk tier dropped it when the checksum failed
            return
        if target is None or page not in target:
            raise TPError(f"rank {self.rank}: page {page[:16]} left the {tier.label} tier, which lacks it here")
        target.remove(page)

    def read_intact(self, page: PageHash) -> torch.Tensor | None:
        """`read`, but None (and `page` noted in `corrupt`) when its only copy here, on this rank's
        disk tier, fails its checksum: rank 0 then drops it from its own disk tier too."""
        if page in self.slots or (self.host is not None and page in self.host) or self.disk is None \
                or page not in self.disk:
            return self.read(page)
        out = torch.empty(self.layout.page_shape, dtype=self.layout.torch_dtype)
        if self.disk.read_into(page, out):
            return out
        log.warning("rank %d: KV page %s to serve failed its checksum on this rank's disk tier; rank 0 drops it",
                    self.rank, page[:16])
        self.corrupt.add(page)
        return None

    def read(self, page: PageHash, tier: Tier | None = None) -> torch.Tensor:
        """This rank's heads of `page`, from `tier` (default: the fastest holding it)."""
        if tier in (None, Tier.DEVICE) and page in self.slots:
            return self.pool[self.slots[page]]
        if tier in (None, Tier.HOST) and self.host is not None and page in self.host:
            return self.host.view(page)
        if tier in (None, Tier.DISK) and self.disk is not None and page in self.disk:
            out = torch.empty(self.layout.page_shape, dtype=self.layout.torch_dtype)
            if self.disk.read_into(page, out):
                return out
        raise TPError(f"rank {self.rank}: page {page[:16]} is not where rank 0 has it")


class Follower:
    """What a follower runs for each pass: its shard's forward over its `ShardKV`."""

    def __init__(self, forward: PagedForward, kv: ShardKV, group: TPGroup) -> None:
        self.forward, self.kv, self.group = forward, kv, group
        self._decoded: DecodeBuffer | None = None
        self._handed: DecodeBuffer | None = None

    def run(self, message: TPPass) -> None:
        for op in message.ops:
            self.kv.apply(op)
        work = message.forward
        if isinstance(work, PrefillInputs):
            self._prefill(work)
        elif isinstance(work, DecodeInputs):
            self._decode(work)
        elif isinstance(work, GatherRequest):
            self._gather(work)
        elif isinstance(work, CheckPages):
            self._check(work)

    def _check(self, work: CheckPages) -> None:
        corrupt = self.kv.corrupt
        flags = torch.tensor([int(PageHash(page) in corrupt) for page in work.pages], dtype=torch.int32)
        self.group.all_reduce_(flags.to(self.group.device))

    def _prefill(self, work: PrefillInputs) -> None:
        kv = self.kv
        forward = self.forward
        hidden = forward.weights.embed.embedding_dim
        chunks = [PrefillChunk(c.token_ids, c.start, c.prefix_slots,
                               kv.tails[c.tail_slot] if c.tail_slot is not None else None,
                               chunk_embeds(c.embeds, len(c.token_ids), hidden, forward.dtype, kv.pool.device))
                  for c in work.chunks]
        output = forward.prefill_batch(chunks, kv.pool, work.want_logits, work.decode_key)
        kv.fresh = [fresh for _, fresh in output.results]
        self._handed = output.buffer

    def _decode(self, work: DecodeInputs) -> None:
        keys = tuple(work.keys)
        previous = next((buffer for buffer in (self._decoded, self._handed) if buffer is not None
                         and buffer.keys == keys and len(buffer.positions) == len(work.positions)
                         and all(now == before + 1 for now, before in zip(work.positions, buffer.positions,
                                                                          strict=True))), None)
        batch = DecodeBatch(work.token_ids, work.positions, work.page_slots, work.tail_slots, work.keys)
        _, self._decoded = self.forward.decode(batch, self.kv.pool, self.kv.tails, previous)

    def _gather(self, work: GatherRequest) -> None:
        group = self.group
        if work.pages and work.check:
            read = [self.kv.read_intact(PageHash(page)) for page in work.pages]
            zeros = torch.zeros(self.kv.layout.page_shape, dtype=self.kv.layout.torch_dtype)
            group.gather_tensor(torch.stack([(zeros if page is None else page).to(group.device) for page in read]))
            flags = torch.tensor([int(page is None) for page in read], dtype=torch.int32)
            group.all_reduce_(flags.to(group.device))
        elif work.pages:
            pages = torch.stack([self.kv.read(PageHash(page)) for page in work.pages])
            group.gather_tensor(pages.to(group.device))
        if work.tail is not None:
            group.gather_tensor(self.kv.saved[work.tail].to(group.device))


def follow(role: RoleSpec, seat: TPSeat, *, ready: Callable[[dict[str, Any]], None],
           parent_pid: int | None = None) -> int:
    """Run follower rank `seat.rank` of `role` until rank 0 stops it or is gone; the exit status.
    `ready(details)` is called once the rank is in the group with its shard built."""
    if seat.rank < 1:
        raise TPError(f"follow() runs ranks 1.., not rank {seat.rank}")
    group, device = join_group(role, seat)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    kv: ShardKV | None = None
    try:
        shard = shard_to_device(load_role_model(role), group, device)
        # A rank's shard is its own copy: packed copies where the role leaves them unset.
        config = rank_config(EngineConfig.from_params(role.params), seat.rank).for_weights(host_shared=False)
        layout = engine_layout(shard, config)
        kv = ShardKV(config, layout, device, seat.rank)
        setup = greet_leader(sock, group, seat.rank, seat.keys, kv.recovered())
        kv.keep_recovered(setup.disk_pages)
        follower = Follower(PagedForward(shard.model, layout, packed=bool(config.packed_weights),
                                         packed_float32=bool(config.packed_float32)), kv, group)
        ready({"role": role.name, "pid": os.getpid(), "tp_rank": seat.rank, "tp_size": seat.size,
               "leader_pid": setup.leader_pid})
        watch = LeaderWatch(parent_pid, setup.leader_pid)
        try:
            return follow_leader(sock, _decoder, watch, seat, TPPass, follower.run)
        finally:
            watch.close()
    finally:
        if kv is not None:
            kv.close()
        sock.close()
        context.term()
        group.close()


__all__ = ["Follower", "ShardKV", "follow", "rank_config"]
