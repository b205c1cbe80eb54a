"""The `diffusion` compute unit of a role with `tp_size > 1`, as rank processes of a role worker.

A replica is `tp_size` worker processes, as for `llm` (`unit.py`): rank 0 is the role worker
the executor knows and hosts `TPDiffusionUnit`; ranks 1.. run `follow()`. Every rank holds a
shard of the LLM's transformer (`shard.py`) and a `DiffusionRunner` over it (the seeded head
replicated); the group meets at `TPSeat.address` and rank 0 publishes a ZeroMQ address in its
store, where each follower says `TPHello` and gets `TPSetup`.

A node call: rank 0 checks the inputs and tokenizes, sends every follower a `TPDiffuse` (the
branches' token ids, seed, steps, guidance; msgpack), then every rank prefills the prompts
over its own KV heads and denoises; the collectives inside keep them in step and rank 0's
latents are the output (float32 on the CPU: the same as TP-1 within rounding).

The prompt's KV: with an input `kv` (an `llm` node's kv output), every rank pulls the
prompts' leading full pages (their keys found once by rank 0: `kv`'s own, checked, for the context
it carries; see `engine.compute.diffusion.unit.node_prompt`) whole from the worker that computed
them (`kv`'s holder), keeps its own KV heads (`pull_shards`), and reuses them; the ranks first
agree that every pull worked (else the node fails on all of them alike, the group intact) and on
how many pages to reuse (the fewest any rank got), so that they prefill the same tokens in step.
The rest of each prompt is computed on the ranks.

Failure: as for `llm`: a dead follower fails the node in flight (rank 0's send finds it gone,
or its next collective fails within `tp_timeout_s`), and every later call fails at once; a
follower exits when rank 0 or its launcher is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import zmq

from engine.compute.context import TransferSeat
from engine.compute.diffusion.forward import DiffusionModelError
from engine.compute.diffusion.runner import DiffusionConfig, DiffusionRunner, Prompt
from engine.compute.diffusion.unit import CONFIG_PARAMS, kv_input, node_prompt, prompt_ids
from engine.compute.models.tokenizer import BOS_ID
from engine.compute.threaded import ThreadedUnit, UnitInputError
from engine.compute.tp.group import TPError, TPGroup, TPRankError
from engine.compute.tp.kv import pull_shards
from engine.compute.tp.link import FollowerLink, RefusalReporter, greet_leader
from engine.compute.tp.messages import TPDiffuse, TPMessage
from engine.compute.tp.seat import (
    LeaderWatch,
    TPSeat,
    follow_leader,
    join_group,
    load_role_model,
    shard_to_device,
    tp_timeout_s,
)
from engine.data.curve import PlaneKeys
from engine.data.kv.layout import KVLayout, dtype_name
from engine.data.peer import Peer, PeerConfig
from engine.spec.calls import NodeCall, NodeContext, NodeResult, map_outputs
from engine.spec.graph import RoleSpec

log = logging.getLogger(__name__)

_HOLDER = re.compile(r"^tcp://[^\s/]+:\d+$")
"""A worker's data address, as an `llm` node's kv output names it."""


def _config(role: RoleSpec) -> DiffusionConfig:
    try:
        return DiffusionConfig(**{k: role.params[k] for k in CONFIG_PARAMS if k in role.params})
    except (TypeError, ValueError) as exc:
        raise UnitInputError(f"diffusion role {role.name!r}: {exc}") from exc


class _Rank:
    """What one rank of a diffusion role holds: its runner over its shard, its group, the layout
    of the whole model's pages (what an `llm` role of the model serves) and, once a node brings
    input `kv`, a seat on the transfer plane to pull pages with."""

    def __init__(self, runner: DiffusionRunner, group: TPGroup, whole: KVLayout, pull_timeout_s: float,
                 keys: PlaneKeys | None, peer: Peer | None = None) -> None:
        self.runner = runner
        self.keys = keys
        self.group = group
        self.whole = whole
        self.pull_timeout_s = pull_timeout_s
        self._peer = peer
        """The worker's seat when it gave one (rank 0 on a worker), else the rank's own, made on first use."""
        self._own_peer = False

    def peer(self) -> Peer:
        if self._peer is None:
            self._peer = Peer.start(PeerConfig(keys=self.keys))
            self._own_peer = True
        return self._peer

    def refused(self) -> int:
        """Connections this rank's own transfer seat refused (a worker counts its seat's itself)."""
        peer = self._peer
        return peer.server.refused if self._own_peer and peer is not None else 0

    def close(self) -> None:
        if self._peer is not None and self._own_peer:
            self._peer.close()
        self._peer = None

    def _reused_pages(self, keys: list[str], message: TPDiffuse) -> list[torch.Tensor]:
        """This rank's heads of the leading pages of a prompt (its page `keys`) at `message.holder`;
        every rank returns as many (collectives), or every rank raises DiffusionModelError."""
        group = self.group
        if message.holder is None:
            return []
        pages: list[torch.Tensor] = []
        problem = ""
        try:
            pages = pull_shards(self.peer(), message.holder, keys, self.whole, group.size, group.rank,
                                self.pull_timeout_s)
        except Exception as exc:  # noqa: BLE001 - whatever fails here, every rank must still meet below
            problem = f"{type(exc).__name__}: {exc}"
        if group.min_int(0 if problem else 1) == 0:
            raise DiffusionModelError(f"pulling the prompt's KV from {message.holder} failed on rank {group.rank}: "
                                      + (problem or "another rank could not pull it"))
        return pages[:group.min_int(len(pages))]

    @torch.inference_mode()
    def diffuse(self, message: TPDiffuse) -> torch.Tensor:
        """What every rank runs for a node: the same prompts, pages, seed and schedule (collectives inside)."""
        runner = self.runner
        branches = []
        for index, ids in enumerate(message.prompts):
            keys = message.pages[index] if message.holder is not None else []
            branches.append(runner.encode_prompt(Prompt.of(ids), self._reused_pages(keys, message)))
        return runner.denoise(branches, seed=message.seed, steps=message.steps,
                              guidance_scale=message.guidance_scale)

    def follow(self, message: TPDiffuse) -> None:
        """A follower's turn at `message`. An input error is rank 0's to report (it met the same)."""
        try:
            self.diffuse(message)
        except DiffusionModelError as exc:
            log.info("rank %d: %s", self.group.rank, exc)


def pull_timeout_s(role: RoleSpec) -> float:
    """How long a rank may take to pull a prompt's pages (the role's `pull_timeout_s`; default
    half its `tp_timeout_s`). A rank that has pulled waits for the slowest pull in a collective,
    which gives up after `tp_timeout_s` and breaks the group: every pull must end well within it."""
    group_timeout = tp_timeout_s(role)
    timeout = role.params.get("pull_timeout_s", group_timeout / 2)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= group_timeout / 2:
        raise UnitInputError(f"diffusion role {role.name!r}: pull_timeout_s must be a positive number of seconds"
                             f" at most half the role's tp_timeout_s ({group_timeout:g}), got {timeout!r}")
    return float(timeout)


def _rank(role: RoleSpec, group: TPGroup, device: str, keys: PlaneKeys | None, peer: Peer | None = None) -> _Rank:
    """This rank's runner over its shard of the role's model, with the layout of the whole model's pages."""
    config = _config(role)
    timeout = pull_timeout_s(role)
    model = load_role_model(role)
    dtype = dtype_name(next(model.model.parameters()).dtype)
    whole = KVLayout(config.page_size, model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    return _Rank(DiffusionRunner(shard_to_device(model, group, device), config), group, whole, timeout, keys, peer)


class TPDiffusionUnit(ThreadedUnit):
    """Rank 0 of a tensor-parallel `diffusion` role (see the module docstring); built by the worker
    as `TPDiffusionUnit(role, tp=seat, transfer=its seat on the transfer plane)`, whose peer rank 0
    pulls prompt pages with (without one, a peer of its own)."""

    def __init__(self, role: RoleSpec, *, tp: TPSeat, transfer: TransferSeat | None = None) -> None:
        if tp.rank != 0 or tp.size < 2:
            raise TPError(f"TPDiffusionUnit is rank 0 of a group of 2 or more, not rank {tp.rank} of {tp.size}")
        super().__init__(role)
        self.seat = tp
        self.failed: str | None = None
        self.group: TPGroup | None = None
        self._rank: _Rank | None = None
        self._link: FollowerLink | None = None
        with contextlib.ExitStack() as undo:
            undo.callback(self._shutdown)  # a half-built rank 0 ends its link and group
            if not role.model:
                raise UnitInputError(f"diffusion role {role.name!r} needs a model (the LLM whose transformer denoises)")
            group, device = join_group(role, tp)
            self.group = group
            self._rank = rank = _rank(role, group, device, tp.keys, None if transfer is None else transfer.peer)
            self.runner = rank.runner
            self.whole = rank.whole
            self._link = FollowerLink(group, tp.address, tp.size, what=f"diffusion role {role.name!r}", keys=tp.keys)
            self._link.meet()
            undo.pop_all()

    def _broadcast(self, message: TPMessage) -> None:
        assert self._link is not None
        self._link.broadcast(message)

    # -- node calls (the unit's thread) ---------------------------------------------------------------

    def _message(self, call: NodeCall, inputs: dict[str, Any]) -> TPDiffuse:
        """The call as every rank runs it; all input errors are found here, before any rank starts."""
        params = call.params
        holder, kv = None, None
        if inputs.get("kv") is not None:
            kv = kv_input(call, inputs["kv"], self.runner.model_id, self.whole)
            if kv.holder is None or kv.holder.address == "":
                raise UnitInputError(f"node {call.node_id!r}: input 'kv' names no holder to pull its pages from")
            holder = kv.holder.address
            if not _HOLDER.match(holder):
                raise UnitInputError(f"node {call.node_id!r}: input 'kv' holder {holder!r} is not a worker's data"
                                     " address (tcp://HOST:PORT)")
        prompt = node_prompt(call, self.runner, inputs, kv)
        if not prompt.ids:
            raise UnitInputError(f"node {call.node_id!r}: the prompt is empty")
        branches = [(prompt.ids, prompt.known)]
        guidance = float(params.get("guidance_scale", self.runner.config.guidance_scale))
        if guidance != 1.0:
            negative = inputs.get("negative_prompt", params.get("negative_prompt", ""))
            branches.append((prompt_ids(call, self.runner, negative, None, "negative_prompt") or [BOS_ID], ()))
        pages: list[list[str]] = []
        if holder is not None:  # hashed here once, not on every rank
            pages = [list(self.runner.page_keys(Prompt.of(ids), call.tenant, known)) for ids, known in branches]
        steps = params.get("steps")
        return TPDiffuse([ids for ids, _ in branches], int(params.get("seed", 0)),
                         int(steps) if steps is not None else None, guidance, holder, pages)

    def _generate(self, call: NodeCall, inputs: dict[str, Any]) -> torch.Tensor:
        message = self._message(call, inputs)
        try:
            return self.diffuse(message)[0]
        except DiffusionModelError as exc:  # every rank met it on the same input; the group is intact
            raise UnitInputError(f"node {call.node_id!r}: {exc}") from exc

    def diffuse(self, message: TPDiffuse) -> torch.Tensor:
        """Every rank runs `message` (the latents, rank 0's); `DiffusionModelError` when every rank
        met the same input error, `TPRankError` when the group broke (the unit fails with it)."""
        if self.failed is not None:
            raise TPRankError(self.failed)
        try:
            self._broadcast(message)
            assert self._rank is not None  # built, or the unit would not exist
            return self._rank.diffuse(message)
        except DiffusionModelError:
            raise
        except Exception as exc:  # the group broke (or this rank did): the lockstep is lost
            self.failed = (f"diffusion role {self.role.name!r}: the tensor-parallel group failed:"
                           f" {type(exc).__name__}: {exc}")
            log.error("%s", self.failed)
            raise TPRankError(self.failed) from exc

    async def execute(self, call: NodeCall, ctx: NodeContext) -> NodeResult:
        inputs = await self.joined_inputs(call)
        latents = await self.run_blocking(self._generate, call, inputs)
        return NodeResult(outputs=map_outputs(latents, call.output_ports, call.node_id))

    def health(self) -> str | None:
        return self.failed

    def refused(self) -> int:
        """What rank 0's transfer seat and its link refused, and what the follower ranks report
        their sockets refused."""
        rank, link = self._rank, self._link
        return (0 if rank is None else rank.refused()) + (0 if link is None else link.refused)

    def metrics(self) -> dict[str, float]:
        """Rank 0's `diffusion.*` counters (every prompt token is computed on the ranks) and the
        group: its size and whether it failed."""
        stats = self.runner.stats
        return {"diffusion.prompt_tokens_computed": float(stats.prompt_tokens_computed),
                "diffusion.prompt_tokens_reused": float(stats.prompt_tokens_reused),
                "diffusion.steps": float(stats.steps), "diffusion.images": float(stats.images),
                "tp.size": float(self.seat.size), "tp.failed": float(self.failed is not None)}

    # -- shutdown -------------------------------------------------------------------------------------

    async def close(self) -> None:
        await super().close()
        self._shutdown()

    def _shutdown(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
        if self._rank is not None:
            self._rank.close()
            self._rank = None
        if self.group is not None:
            self.group.close()
            self.group = None


# -- ranks 1.. ------------------------------------------------------------------------------------------


def follow(role: RoleSpec, seat: TPSeat, *, ready: Callable[[dict[str, Any]], None],
           parent_pid: int | None = None) -> int:
    """Run follower rank `seat.rank` of `role` until rank 0 stops it or is gone; the exit status.
    `ready(details)` is called once the rank is in the group with its shard built."""
    if seat.rank < 1:
        raise TPError(f"follow() runs ranks 1.., not rank {seat.rank}")
    decoder = msgspec.msgpack.Decoder(TPMessage)
    group, device = join_group(role, seat)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    watch: LeaderWatch | None = None
    rank: _Rank | None = None
    try:
        rank = _rank(role, group, device, seat.keys)
        setup = greet_leader(sock, group, seat.rank, seat.keys)
        ready({"role": role.name, "pid": os.getpid(), "tp_rank": seat.rank, "tp_size": seat.size,
               "leader_pid": setup.leader_pid})
        watch = LeaderWatch(parent_pid, setup.leader_pid)
        reporter = RefusalReporter(sock, seat.rank, rank.refused, interval_s=seat.heartbeat_s)
        return follow_leader(sock, decoder, watch, seat, TPDiffuse, rank.follow, tick=reporter.tick)
    finally:
        if watch is not None:
            watch.close()
        if rank is not None:
            rank.close()
        sock.close()
        context.term()
        group.close()


__all__ = ["TPDiffusionUnit", "follow"]
