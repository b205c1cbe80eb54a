"""`Peer`: a process's seat on the transfer plane.

    peer = Peer.start(PeerConfig(server=ServerConfig(bind="tcp://0.0.0.0:0",
                                                     advertise_host="10.0.0.7")))
    ref = peer.put(output)                    # producer: keep it, hand out the ref
    data = peer.pull(ref, timeout=5.0)        # consumer (any process): the bytes
    data = await peer.pull_async(ref, 5.0)    # the same from asyncio
    tensor = data.torch()                     # or data.numpy(); zero-copy views
    peer.release(ref)                         # or let the lease expire
    peer.close()

`Peer` bundles a `engine.data.server.TensorServer` (and its store) with a
`engine.data.client.ZmqClient` and picks the cheapest channel per ref: same process,
same host, then TCP.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from engine.data import cuda_ipc
from engine.data.channel import (
    InProcessChannel,
    SharedMemoryChannel,
    Transfer,
    ZmqChannel,
)
from engine.data.client import ClientConfig, ZmqClient
from engine.data.codec import TensorData
from engine.data.curve import PlaneKeys
from engine.data.pulls import ChunkSink
from engine.data.server import ServerConfig, TensorServer
from engine.data.tensor_store import StoreConfig, TensorStore
from engine.data.transfers import TransferTally
from engine.data.wire import (
    BulkGrant,
    LeaseReply,
    LeaseRequest,
    Message,
    PingRequest,
    ReleaseReply,
    ReleaseRequest,
    StatsReply,
    StatsRequest,
    TensorRef,
    Transport,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PeerConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    default_timeout_s: float = 30.0
    keys: PlaneKeys | None = None
    """The worker plane's CURVE keys (`engine.data.curve`): the server admits, and the client
    reaches, only the plane's members. None: plaintext, for a process that talks to no worker
    (or the benchmarks' unauthenticated anchor)."""


class Peer:
    """A producer and consumer in one: serves its own store and pulls from others, picking
    the cheapest channel per ref (same process, then same host, then TCP)."""

    def __init__(self, config: PeerConfig | None = None) -> None:
        self.config = config or PeerConfig()
        self._context = zmq.Context(io_threads=1)
        self.server = TensorServer(self.config.server, self.config.store, context=self._context,
                                   keys=self.config.keys)
        self.client = ZmqClient(self.config.client, context=self._context, host=self.server.store.host,
                                keys=self.config.keys)
        self.local = InProcessChannel(self.server.store)
        self.shm = SharedMemoryChannel(self.client)
        self.tcp = ZmqChannel(self.client)
        self.transfers = TransferTally()
        """The path each `pull`/`pull_async` took (`transfer.<transport>.pulls`/`.bytes`)."""
        self._closed = False

    @classmethod
    def start(cls, config: PeerConfig | None = None) -> Peer:
        return cls(config)

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def keys(self) -> PlaneKeys | None:
        """The plane's keys this peer uses (None: plaintext); a dispatcher uses the same."""
        return self.config.keys

    @property
    def store(self) -> TensorStore:
        return self.server.store

    @property
    def host(self) -> str:
        return self.server.store.host

    # --- producing ---------------------------------------------------------------------------

    def put(self, tensor: np.ndarray | torch.Tensor, lease_s: float | None = None) -> TensorRef:
        return self.store.put(tensor, lease_s)

    # --- consuming ---------------------------------------------------------------------------

    def start_pull(self, ref: TensorRef, timeout: float | None = None) -> Transfer:
        """Start a pull that the client's I/O thread carries; poll or wait on the handle."""
        timeout = self.config.default_timeout_s if timeout is None else timeout
        if ref.owner == self.address:
            return self.local.pull(ref, timeout)
        return self.client.pull(ref, self._transports(ref), timeout)

    def _transports(self, ref: TensorRef) -> tuple[Transport, ...]:
        if ref.host != self.host:
            return (Transport.TCP, Transport.INLINE)
        if ref.device.startswith("cuda") and cuda_ipc.available():
            return (Transport.CUDA_IPC, Transport.SHM, Transport.TCP, Transport.INLINE)
        return (Transport.SHM, Transport.TCP, Transport.INLINE)

    def pull(self, ref: TensorRef, timeout: float | None = None) -> TensorData:
        """Pull in the calling thread (blocking; the lowest latency)."""
        timeout = self.config.default_timeout_s if timeout is None else timeout
        if ref.owner == self.address:
            data = self.local.fetch(ref, timeout)
        else:
            data = self.client.fetch(ref, self._transports(ref), timeout)
        self.transfers.record(data)
        return data

    def pull_to(self, ref: TensorRef, timeout: float | None, sink: ChunkSink, *, align: int = 1,
                tcp: bool = False, chunk_bytes: int | None = None) -> TensorData | None:
        """`pull`, but bytes that come as TCP chunks go to `sink` (`ZmqClient.fetch_to`, in chunks
        of `chunk_bytes` when given): None then; bytes readable in place come back as `pull`
        returns them. `tcp`: TCP (or an inline reply) even on this host."""
        timeout = self.config.default_timeout_s if timeout is None else timeout
        if ref.owner == self.address and not tcp:
            data = self.local.fetch(ref, timeout)
            self.transfers.record(data)
            return data
        transports = (Transport.TCP, Transport.INLINE) if tcp else self._transports(ref)
        return self._counted(ref, self.client.fetch_to(ref, transports, timeout, sink, align, chunk_bytes))

    def pull_granted(self, ref: TensorRef, grant: BulkGrant, timeout: float | None, sink: ChunkSink | None = None,
                     *, align: int = 1, chunk_bytes: int | None = None) -> TensorData | None:
        """Pull `ref` over its owner's bulk channel under `grant`, given in another reply on the
        CURVE connection (`ZmqClient.fetch_granted`); with `sink`, the chunks go there (None returned)."""
        timeout = self.config.default_timeout_s if timeout is None else timeout
        return self._counted(ref, self.client.fetch_granted(ref, grant, timeout, sink, align, chunk_bytes))

    def _counted(self, ref: TensorRef, got: TensorData | None) -> TensorData | None:
        """`got` (None: `ref`'s bytes went to a sink as TCP chunks), counted in `transfers`."""
        if got is None:
            self.transfers.add(Transport.TCP, ref.nbytes)
        else:
            self.transfers.record(got)
        return got

    async def pull_async(self, ref: TensorRef, timeout: float | None = None) -> TensorData:
        """Pull without blocking the event loop (carried by the client's I/O thread)."""
        data = await self.start_pull(ref, timeout).wait_async()
        self.transfers.record(data)
        return data

    # --- lifetime of refs, wherever they live ---------------------------------------------------

    def release(self, ref: TensorRef, timeout: float | None = None) -> bool:
        """Free `ref` at its owner now; False if it was not live there."""
        if ref.owner == self.address:
            return self.store.release(ref.id)
        reply = self._call(ref.owner, lambda rid: ReleaseRequest(rid, ref.id), timeout)
        assert isinstance(reply, ReleaseReply)
        return reply.released

    def extend(self, ref: TensorRef, lease_s: float, timeout: float | None = None) -> float:
        """Extend `ref`'s lease at its owner to `lease_s` from now; returns the new UNIX expiry."""
        if ref.owner == self.address:
            return self.store.extend(ref.id, lease_s)
        reply = self._call(ref.owner, lambda rid: LeaseRequest(rid, ref.id, lease_s), timeout)
        assert isinstance(reply, LeaseReply)
        return reply.lease_expires_at

    def stats(self, address: str, timeout: float | None = None) -> StatsReply:
        reply = self._call(address, StatsRequest, timeout)
        assert isinstance(reply, StatsReply)
        return reply

    def ping(self, address: str, timeout: float | None = None) -> float:
        """Round trip to `address` in seconds."""
        start = time.perf_counter()
        self._call(address, PingRequest, timeout)
        return time.perf_counter() - start

    def _call(self, address: str, message: Any, timeout: float | None) -> Message:
        timeout = self.config.default_timeout_s if timeout is None else timeout
        return self.client.request(address, message, timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.client.close()
        self.server.close()
        self._context.term()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["ClientConfig", "Peer", "PeerConfig", "ServerConfig", "TensorServer", "ZmqClient"]
