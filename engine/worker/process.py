"""The role worker process: sockets, registry, signals around a `RoleWorkerCore`.

It runs as its `WorkerConfig` (`engine.worker.config`) says. Three endpoints, three threads:

* control (ZeroMQ ROUTER, the main event loop): hello, `ExecuteRequest`s and their
  answers; the core runs node executions on the same loop;
* liveness (ROUTER, its own thread and loop, `engine.worker.liveness`): answers pings and
  heartbeats the registry, so a worker busy in a long blocking forward pass still looks alive;
* data (the `Peer`'s tensor server, its own thread): consumers pull outputs from it.

On SIGTERM the worker drains (refuses new work, finishes what runs), deregisters and
exits; if spawned by a local launcher it exits when that parent dies. When it is
ready it prints one line, `OMNIFLOW-READY {json}`, on standard output (with the
`CUDA_VISIBLE_DEVICES` it runs under, `cuda_visible_devices`: null when unset). One that
cannot start says why there instead, `OMNIFLOW-FAILED {"error": ...}` (the exception, its
traceback on standard error as before), for its launcher to report (`engine.worker.announce`).

A worker whose registry record is gone registers again (Redis restarted or was flushed, or
the worker paused past its TTL) unless its id was fenced (`Registry.fence`: it was declared
lost, its node cut off say, and its replica placed elsewhere): then it drains and exits, so
that the replacement alone serves.

Exit status: 0 after a drain, 3 when the drain had to cancel executions, 4 when it cannot
go on serving (its unit reports why, `ComputeUnit.health`, or the GPU weights it attached lost
their publisher), 5 (`engine.worker.liveness.STALLED_EXIT`) when its event loop stopped turning
for `stall_timeout_s` (a deadlock, or node code blocking the loop): the liveness thread, which
would otherwise keep answering pings for a worker that serves nothing, dumps every thread's
stack on standard error, deregisters the worker and ends the process, so that its calls go
to other replicas and a supervising launcher replaces it. 6 when it was fenced (above).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import itertools
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import psutil
import uvloop
import zmq

from engine.data import framed
from engine.data.codec import WireCodec, WireError
from engine.data.curve import PlaneGuard
from engine.data.peer import Peer, PeerConfig, ServerConfig
from engine.data.shm import local_namespace
from engine.data.wire import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    HelloReply,
    HelloRequest,
    PingReply,
    PingRequest,
    WorkerMessage,
)
from engine.flow.discovery import WorkerInfo, WorkerLoad
from engine.flow.gpus import VISIBLE_DEVICES_ENV
from engine.flow.links import LoopSocket
from engine.spec.kinds import KindRegistry, default_kinds
from engine.spec.ops import OpConfig, default_ops
from engine.spec.userfiles import UsersRoot
from engine.worker.announce import FENCED_EXIT, READY_PREFIX, REFUSED_METRIC, report_start_failure
from engine.worker.config import WorkerConfig, bound_endpoint, host_of_endpoint
from engine.worker.core import RoleWorkerCore
from engine.worker.kv import KVHosting, open_index
from engine.worker.liveness import Liveness, LoopWatch
from engine.worker.title import set_title

log = logging.getLogger(__name__)

_ANSWER_LINGER_MS = 1000


def process_metrics(device: str) -> dict[str, float]:
    """The worker process's resident memory (`rss_bytes`) and, for a worker on a CUDA device, that
    device's memory: what torch's allocator holds and reserves there, and the device's total and
    free (`gpu_memory_<kind>_bytes`). A worker on the CPU never asks CUDA anything: a query would
    give it a CUDA context, hundreds of MB of GPU memory, of its own."""
    metrics = {"rss_bytes": float(psutil.Process().memory_info().rss)}
    if device.startswith("cuda") and "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            index = torch.device(device).index
            index = torch.cuda.current_device() if index is None else index
            metrics["gpu_memory_allocated_bytes"] = float(torch.cuda.memory_allocated(index))
            metrics["gpu_memory_reserved_bytes"] = float(torch.cuda.memory_reserved(index))
            free, total = torch.cuda.mem_get_info(index)
            metrics["gpu_memory_total_bytes"] = float(total)
            metrics["gpu_memory_free_bytes"] = float(free)
    return metrics


class RoleWorkerProc:
    """One role worker process's endpoints around its `RoleWorkerCore`: the control socket
    (ZeroMQ ROUTER, with CURVE when the plane has keys) and the local stream listener feed
    `receive`; the liveness thread heartbeats `load()` and asks `check()`; `run()` serves until
    stopped and returns the exit status (see the module docstring).

    Units are built as `Unit(role, ctx)`: a `UnitContext` with the process's `WeightStore`, the
    worker's KV store (when it has one), the ops it may run and its seat on the transfer plane
    (its `Peer`, worker id and KV index)."""

    def __init__(self, config: WorkerConfig, kinds: KindRegistry, *, ready: Callable[[dict], None],
                 kv_store: Any = None) -> None:
        self.config = config
        self.kinds = kinds
        self._ready = ready
        self._kv_store = kv_store
        self.host = host_of_endpoint(config.listen)
        self.codec = WireCodec(config.max_message_bytes, WorkerMessage)
        self.stop = asyncio.Event()
        self.unhealthy: list[str] = []
        """Why the worker cannot go on serving, when its unit or weights said so."""
        self._streams: dict[bytes, framed.FramedStream] = {}
        """Executors connected on the local socket, by the identity their messages carry here."""
        self._greeted: set[bytes] = set()
        self._identities = itertools.count(1)
        self._control: LoopSocket | None = None
        self._local_server: Any = None
        self._local_refusals = framed.RefusalCounter()

    # -- start ------------------------------------------------------------------------------------
    def _bind_control(self) -> None:
        config = self.config
        self.peer = Peer.start(PeerConfig(server=ServerConfig(bind=f"tcp://{self.host}:0"), keys=config.keys))
        self.context = zmq.Context()
        self.guard = None if config.keys is None else PlaneGuard(self.context, config.keys, name="control")
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        if self.guard is not None:
            self.guard.serve(self.sock)
        self.sock.bind(config.listen)
        self.address = bound_endpoint(self.sock, self.host)

    def _build_unit(self) -> None:
        """One weight store per process (roles of one model share weights; segments and indexes of
        dead publishers are reclaimed first; GPU weights are served by CUDA IPC through the peer)
        and, when given, one KV store for the units that take them."""
        from engine.compute.context import TransferSeat, UnitContext  # torch: imported by the worker only
        from engine.compute.weights.cuda import DeviceWeights
        from engine.compute.weights.shared import HostWeights
        from engine.compute.weights.store import WeightStore

        config, peer = self.config, self.peer
        HostWeights().reclaim()
        DeviceWeights(peer).reclaim()
        self.weights = WeightStore(HostWeights() if config.host_weights else None, DeviceWeights(peer))
        self.capacity = config.capacity or int(config.role.params.get("capacity", 64))
        # The units see the capacity this worker runs at (`--capacity` overrides the role's).
        role = msgspec.structs.replace(config.role, params={**config.role.params, "capacity": self.capacity})
        index = open_index(config.registry_url, config.namespace)
        seat = TransferSeat(peer, config.worker_id, index)
        if config.role.tp_size > 1:
            # Rank 0 of a tensor-parallel replica: an `llm` one serves the group's pages whole on a
            # peer of its own (`engine.compute.tp.serve`), which the KV index names.
            tp_unit, _ = self.kinds.role_kind(config.role.kind).load_tp_runner()
            self.unit = tp_unit(role, tp=tp_seat(config), transfer=seat)
        else:
            ops = OpConfig(default_ops(), allow_module_ops=config.allow_module_ops)
            users = None if config.users_root is None else UsersRoot(config.users_root)
            ctx = UnitContext(weights=self.weights, kv_store=self._kv_store, ops=ops, seat=seat, users=users)
            self.unit = self.kinds.role_kind(config.role.kind).load_runner()(role, ctx)
        # A unit with a KV cache: serve its pages to other workers, publish them to the KV index.
        self.kv = KVHosting.start(self.unit, peer, config.worker_id, index=index,
                                  heartbeat_s=config.heartbeat_s, ttl_s=config.registry_ttl_s)
        self.core = RoleWorkerCore(config.role, self.unit, peer, config.worker_id, self.send,
                                   capacity=self.capacity, pull_timeout_s=config.pull_timeout_s)

    async def _listen_locally(self) -> dict[str, str]:
        """Executors in the same network namespace reach the worker on an abstract Unix socket
        (`engine.data.framed`: no ZeroMQ I/O thread on either side, no file to clean up); the
        address and namespace it advertises, or nothing outside a namespace."""
        namespace = local_namespace()
        if namespace is None:
            return {}
        # Named by pid and a digest of the worker id: a worker id of a long workflow and role
        # name would pass the 107 bytes a Unix socket name may have, and fail the bind.
        digest = hashlib.blake2b(self.config.worker_id.encode(), digest_size=8).hexdigest()
        local = {"local": framed.local_address(f"omniflow-{os.getpid()}-{digest}"), "local_ns": namespace}
        self._local_server = await framed.listen(local["local"], self._accept, counter=self._local_refusals)
        return local

    def info(self, liveness_address: str, local: dict[str, str]) -> WorkerInfo:
        """What the registry lists for this worker."""
        config = self.config
        return WorkerInfo(
            worker_id=config.worker_id, role=config.role.name, address=self.address, capacity=self.capacity,
            model=config.role.model, device=config.role.device, host=self.host, pid=os.getpid(),
            meta={"liveness": liveness_address, "data": self.peer.address, "workflow": config.workflow, **local,
                  **self.kv.meta},
        )

    # -- messages ---------------------------------------------------------------------------------
    def send(self, identity: bytes, message: WorkerMessage) -> None:
        # Never waits: a ROUTER drops a message to a peer that is gone or over its high-water
        # mark (no ROUTER_MANDATORY); a local stream buffers it (without back-pressure: the
        # executor reads as answers come), or drops it once its caller has gone (who then
        # cancels what it started here, see `_accept`).
        stream = self._streams.get(identity)
        if stream is None:
            assert self._control is not None
            self._control.send_nowait([identity, self.codec.encode(message)])
        elif not stream.closed:
            stream.send_nowait(self.codec.encode(message), waiter=False)

    def receive(self, identity: bytes, payload: bytes) -> None:
        try:
            message = self.codec.decode(payload)
        except WireError as exc:
            self.send(identity, ErrorReply(None, exc.code, str(exc)))
            return
        if isinstance(message, HelloRequest):
            if message.protocol_version != PROTOCOL_VERSION:
                self.send(identity, ErrorReply(None, ErrorCode.VERSION_MISMATCH,
                                               f"protocol {message.protocol_version}; this worker speaks"
                                               f" {PROTOCOL_VERSION}"))
                return
            self._greeted.add(identity)
            self.send(identity, HelloReply(PROTOCOL_VERSION, self.config.worker_id, self.host, 0,
                                           self.config.max_message_bytes))
        elif identity not in self._greeted:
            self.send(identity, ErrorReply(getattr(message, "request_id", None), ErrorCode.HANDSHAKE_REQUIRED,
                                           "the first message of a connection must be HelloRequest"))
        elif isinstance(message, PingRequest):
            self.send(identity, PingReply(message.request_id))
        else:
            self.core.handle(identity, message)

    def _receive_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.send(frames[0], ErrorReply(None, ErrorCode.MALFORMED,
                                            f"expected 1 message frame, got {len(frames) - 1}"))
            return
        self.receive(frames[0], frames[1])

    def _accept(self) -> framed.FramedStream:
        identity = f"local-{next(self._identities)}".encode()
        limit = self.config.max_message_bytes

        def closed(reason: str) -> None:
            # The executor went away: nothing it started here has anyone to answer to.
            self._streams.pop(identity, None)
            self._greeted.discard(identity)
            self.core.disconnected(identity)

        stream = self._streams[identity] = framed.FramedStream(
            lambda payload: self.receive(identity, payload),
            max_message_bytes=limit,
            on_oversized=lambda size: self.send(identity, ErrorReply(
                None, ErrorCode.OVERSIZED, f"message of {size} bytes is over the limit of {limit};"
                                           " closing the connection")),
            on_closed=closed,
        )
        return stream

    # -- health and load (from the liveness thread) -----------------------------------------------
    def _refused(self) -> dict[str, float]:
        # Connections refused on every server socket of the worker: for want of the plane's key
        # (ZeroMQ), or from another uid (the local socket); and on those its unit opened.
        guards = (self.guard, self.liveness.guard)
        return {REFUSED_METRIC: float(self.peer.server.refused + sum(g.refused for g in guards if g is not None)
                                      + self._local_refusals.refused + self.unit.refused())}

    def load(self) -> WorkerLoad:
        base = self.core.load()
        return WorkerLoad(outstanding=base.outstanding, queue_depth=base.queue_depth, busy=base.busy,
                          metrics={**base.metrics, **process_metrics(self.config.role.device), **self.kv.metrics(),
                                   **self.unit.metrics(), **self.peer.transfers.metrics(), **self._refused()})

    def check(self) -> str | None:
        """Each heartbeat: why the worker cannot go on serving, or None."""
        problem = self.unit.health()
        if problem is None and (orphaned := self.weights.orphaned()):
            problem = f"the publisher of GPU weights this worker attached is gone: {', '.join(orphaned)}"
        if problem is not None:
            self.unhealthy.append(problem)
        return problem

    # -- run --------------------------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT, the parent's death or an unhealthy unit; the exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        config = self.config
        self._bind_control()
        self._build_unit()
        local = await self._listen_locally()
        # The liveness thread logged why it stops the worker.
        self.liveness = Liveness(config, self.host, self.load, lambda reason: loop.call_soon_threadsafe(
            self.stop.set), self.check, LoopWatch(loop, config.stall_timeout_s).stalled)
        liveness_address = self.liveness.start_and_bind()
        info = self.info(liveness_address, local)
        self.liveness.register(info)
        set_title(f"omniflow-worker role={config.role.name} id={config.worker_id}"
                                  f" listen={self.address}")
        self._control = LoopSocket(self.sock, self._receive_frames)
        self._ready({"worker_id": config.worker_id, "role": config.role.name, "address": self.address,
                     "liveness": liveness_address, "data": self.peer.address, "pid": os.getpid(),
                     "host": self.host, "capacity": self.capacity, "info": info.to_dict(), **local})
        await self.stop.wait()
        return await self._shutdown()

    async def _shutdown(self) -> int:
        log.info("worker %s draining", self.config.worker_id)
        # Unhealthy (a failed unit, or weights gone and what runs would compute on freed memory):
        # cancel what runs at once.
        cancelled = await self.core.drain(0.0 if self.unhealthy else self.config.drain_timeout_s)
        self.liveness.stop()
        self.kv.close()
        await self.unit.close()
        self.weights.close()
        # A linger lets the answers of drained executions leave before the context ends.
        assert self._control is not None
        self._control.close(linger=_ANSWER_LINGER_MS)
        if self._local_server is not None:
            self._local_server.close()
        for stream in list(self._streams.values()):
            stream.close()
        if self.guard is not None:
            self.guard.close()
        self.context.term()
        self.peer.close()
        if self.unhealthy:
            return 4  # it could not go on serving (its unit failed, or its attached weights are gone)
        if self.liveness.fenced is not None:
            return FENCED_EXIT
        return 0 if not cancelled else 3


async def serve(config: WorkerConfig, kinds: KindRegistry, *, ready: Callable[[dict], None],
                kv_store: Any = None) -> int:
    """Run the worker until SIGTERM/SIGINT or the parent's death; returns the exit status."""
    return await RoleWorkerProc(config, kinds, ready=ready, kv_store=kv_store).run()


def tp_seat(config: WorkerConfig) -> Any:
    """This process's seat in its tensor-parallel replica (`config.role.tp_size > 1`)."""
    from engine.compute.tp.seat import TPSeat  # torch: imported by the worker only

    if config.tp_address is None:
        raise ValueError(f"role {config.role.name!r} has tp_size {config.role.tp_size} but no tp_address")
    return TPSeat(config.tp_rank, config.role.tp_size, config.tp_address, heartbeat_s=config.heartbeat_s,
                  listen_fd=config.tp_listen_fd, worker_id=config.worker_id, keys=config.keys)


def follow_rank(config: WorkerConfig, kinds: KindRegistry, *, ready: Callable[[dict], None]) -> int:
    """Run rank `config.tp_rank` >= 1 of a tensor-parallel replica: no endpoint of its own, it
    applies rank 0's operations to its shard until rank 0 (or the parent) is gone or stops it."""
    _, follow = kinds.role_kind(config.role.kind).load_tp_runner()
    set_title(f"omniflow-worker role={config.role.name} id={config.worker_id}"
                              f" tp_rank={config.tp_rank}")

    def announce(details: dict) -> None:
        ready({"worker_id": config.worker_id, "host": host_of_endpoint(config.listen), **details})

    return int(follow(config.role, tp_seat(config), ready=announce, parent_pid=config.parent_pid))


def run_role_worker(config: WorkerConfig, kinds: KindRegistry | None = None) -> int:
    """Serve `config.role` until told to stop; prints the READY line on standard output (the
    FAILED line, and raises, when it cannot start)."""
    announced = False

    def ready(details: dict) -> None:
        nonlocal announced
        # Its unit is built (model code, weights' Python objects, the ops' modules) and lives as long
        # as the process: out of the collector's full passes, which would otherwise walk it inside
        # some call (about 150 ms over torch's objects on a 2-core machine).
        gc.freeze()
        # The GPUs it was confined to, as it sees them: its launcher's record of them is only what it meant to set.
        print(READY_PREFIX + json.dumps({**details, "cuda_visible_devices": os.environ.get(VISIBLE_DEVICES_ENV)}),
              flush=True)
        announced = True

    try:
        if config.tp_rank > 0:
            return follow_rank(config, kinds or default_kinds(), ready=ready)
        # uvloop: about a fifth less time per node execution than asyncio's own loop (`bench hops`).
        return uvloop.run(serve(config, kinds or default_kinds(), ready=ready))
    except Exception as exc:  # raised on (its traceback on standard error); before READY, said on stdout too
        if not announced:
            report_start_failure(f"{type(exc).__name__}: {exc}")
        raise
