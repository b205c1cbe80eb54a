"""One role's tensor-parallel process group."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.data.rendezvous import listening_socket

LOOPBACK_INTERFACE = "lo"
LINK_INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Where gloo and NCCL open their links between ranks. Unset, they bind the address the
machine's hostname resolves to (often its LAN address), reachable from other hosts and not
authenticated; the ranks of a replica are on one host, so `TPGroup.init` confines them to
loopback."""


class TPError(RuntimeError):
    """A tensor-parallel setup is invalid (sizes that do not divide, a bad rank)."""


class TPRankError(TPError):
    """A rank of the role died or stopped answering: the role's in-flight calls fail with this."""


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's seat in its role's group: `rank` of `size`. `size == 1` needs no
    `torch.distributed` at all (every collective is the identity). `store` is the group's
    rendezvous key-value store (rank 0 hosts it), for the little the ranks must tell each
    other outside collectives (`publish`/`lookup`). `device` is where the group's own small
    tensors (`min_int`, `gather_bytes`) live: NCCL takes CUDA tensors only."""

    rank: int
    size: int
    store: Any = None
    device: str = "cpu"

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def init(cls, rank: int, size: int, address: str, *, timeout_s: float = 10.0,
             rendezvous_timeout_s: float | None = None, backend: str | None = None,
             device: str = "cpu", listen_fd: int | None = None) -> TPGroup:
        """Join the group at `address` (`tcp://127.0.0.1:PORT`). A collective that a dead peer
        never joins raises after `timeout_s` (gloo's timeout) instead of hanging; meeting the
        other ranks (and `lookup`) may take `rendezvous_timeout_s` (default: `timeout_s`).
        `device`: this rank's (`cuda:N` with NCCL). `listen_fd`: rank 0 only, a socket already
        listening at `address` (`engine.data.rendezvous`), which its store then owns.

        The ranks of a replica run on one host, so `address` is a loopback address, and every
        link of the group stays on loopback: the rendezvous store listens there only (without
        `listen_fd`, rank 0 binds it there itself, not on every interface as `TCPStore` would),
        and gloo's and NCCL's links between ranks open on the loopback interface (this process's
        `LINK_INTERFACE_ENVS`), never on an address other hosts reach: nothing of torch's
        rendezvous or collectives is authenticated."""
        if not 0 <= rank < size:
            raise TPError(f"rank {rank} is not in a group of {size}")
        if listen_fd is not None and rank != 0:
            raise TPError(f"rank {rank} was given a listening socket: only rank 0 hosts the rendezvous store")
        if size == 1:
            return cls(rank, size, device=device)
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        if not host or not port.isdigit():
            raise TPError(f"group address {address!r} is not tcp://HOST:PORT")
        if not _is_loopback(host):
            raise TPError(f"group address {address!r}: the ranks of a replica meet on loopback (127.0.0.1), "
                          "on one host; torch's rendezvous and collectives are not authenticated")
        for name in LINK_INTERFACE_ENVS:
            os.environ[name] = LOOPBACK_INTERFACE
        if rank == 0 and listen_fd is None:
            listen_fd = listening_socket(host, port=int(port))[0].detach()
        meet_s = timeout_s if rendezvous_timeout_s is None else rendezvous_timeout_s
        try:
            store = dist.TCPStore(host, int(port), size, rank == 0, timeout=datetime.timedelta(seconds=meet_s),
                                  master_listen_fd=listen_fd)
            dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError
            raise TPRankError(f"rank {rank} of {size} could not join the group at {address}"
                              f" within {meet_s:.1f}s: {exc}") from exc
        return cls(rank, size, store, device)

    def publish(self, key: str, value: bytes) -> None:
        """Put `value` under `key` in the group's store (every rank may `lookup` it)."""
        if self.store is None:
            raise TPError("a group of one has no store")
        self.store.set(f"omniflow/{key}", value)

    def lookup(self, key: str) -> bytes:
        """The value another rank `publish`ed under `key`, waiting for it up to the store's timeout."""
        if self.store is None:
            raise TPError("a group of one has no store")
        try:
            return bytes(self.store.get(f"omniflow/{key}"))
        except RuntimeError as exc:
            raise TPRankError(f"rank {self.rank}: no {key!r} in the group's store (rank 0 gone?): {exc}") from exc

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place."""
        if self.size > 1:
            try:
                dist.all_reduce(tensor)
            except RuntimeError as exc:
                raise TPRankError(f"rank {self.rank}: all_reduce failed (a peer rank is gone?): {exc}") from exc
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (every rank gets the same answer)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        except RuntimeError as exc:
            raise TPRankError(f"rank {self.rank}: all_reduce(MIN) failed (a peer rank is gone?): {exc}") from exc
        return int(tensor.item())

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's `data`, in rank order, on rank 0 (None elsewhere): raw bytes, padded to
        the longest over the ranks for the collective, so callers encode with msgspec (never
        pickle, which `torch.distributed`'s object collectives use)."""
        if self.size == 1:
            return [data]
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = self.gather_tensor(length)
        longest = -self.min_int(-len(data))
        padded = torch.zeros(longest, dtype=torch.uint8)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        shards = self.gather_tensor(padded.to(self.device))
        if shards is None or lengths is None:
            return None
        return [bytes(shard[: int(n.item())].cpu().numpy()) for shard, n in zip(shards, lengths, strict=True)]

    def gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape and dtype on all), in rank order, on rank 0 (None
        elsewhere). Raw tensors: nothing is pickled."""
        if self.size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_leader else None
        try:
            dist.gather(tensor.contiguous(), out, dst=0)
        except RuntimeError as exc:
            raise TPRankError(f"rank {self.rank}: gather failed (a peer rank is gone?): {exc}") from exc
        return out

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
