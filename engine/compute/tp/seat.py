"""Where a rank of a tensor-parallel role sits: its seat, device and group, and its model shard.

Shared by the `llm` and `diffusion` tensor-parallel units (`unit.py`, `follower.py`,
`diffusion_unit.py`): a replica of a role with `tp_size = N` is N worker processes
(`engine.worker.launcher`), rank 0 the one endpoint the executor knows, ranks 1.. followers.
"""

from __future__ import annotations

import logging
import os
import select
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec
import torch
import zmq

from engine.compute.llm.errors import LLMUnitError
from engine.compute.models.loader import LoadedModel, load_model
from engine.compute.tp.group import TPGroup
from engine.compute.tp.link import SETUP_TIMEOUT_S
from engine.compute.tp.messages import TPStop
from engine.compute.tp.shard import shard_model
from engine.data.curve import PlaneKeys
from engine.spec.graph import RoleSpec
from engine.spec.resources import role_resources

log = logging.getLogger(__name__)
M = TypeVar("M")

TP_TIMEOUT_S = 10.0
"""Default deadline of one collective (role param `tp_timeout_s`): a stuck rank fails the role after it."""


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


def follow_leader(sock: zmq.Socket, decoder: msgspec.msgpack.Decoder, watch: LeaderWatch, seat: TPSeat,
                  expected: type[M], apply: Callable[[M], None], tick: Callable[[], None] | None = None) -> int:
    """A follower rank's loop: apply each `expected` message rank 0 sends until it says stop.

    Returns the process's exit status: 0 at `TPStop`; 2 when its launcher or rank 0 is gone
    (checked each `seat.heartbeat_s` without a message); 3 at a message of another type or one
    `apply` raises on (a follower that cannot follow exits, and the group fails at rank 0).
    `tick` runs before each wait.
    """
    while True:
        if tick is not None:
            tick()
        if not sock.poll(int(seat.heartbeat_s * 1000)):
            why = watch.gone()
            if why is not None:
                log.warning("rank %d stops: %s", seat.rank, why)
                return 2
            continue
        message = decoder.decode(sock.recv())
        if isinstance(message, TPStop):
            return 0
        if not isinstance(message, expected):
            log.error("rank %d: a follower waiting for %s does not apply %s; exiting", seat.rank,
                      expected.__name__, type(message).__name__)
            return 3
        try:
            apply(message)
        except Exception:  # a follower that cannot follow exits; the group fails at rank 0
            log.exception("rank %d cannot apply %s; exiting", seat.rank, expected.__name__)
            return 3


__all__ = ["TP_TIMEOUT_S", "LeaderWatch", "TPSeat", "follow_leader", "join_group", "load_role_model",
           "rank_device", "shard_to_device", "tp_timeout_s"]
