"""The role worker process: sockets, registry, signals around a `RoleWorkerCore`.

Three endpoints, three threads:

* control (ZeroMQ ROUTER, the main event loop): hello, `ExecuteRequest`s and their
  answers; the core runs node executions on the same loop;
* liveness (ROUTER, its own thread and loop): answers pings and heartbeats the
  registry, so a worker busy in a long blocking forward pass still looks alive;
* data (the `Peer`'s tensor server, its own thread): consumers pull outputs from it.

On SIGTERM the worker drains (refuses new work, finishes what runs), deregisters and
exits; if spawned by a local launcher it exits when that parent dies. When it is
ready it prints one line, `OMNIFLOW-READY {json}`, on standard output (with the
`CUDA_VISIBLE_DEVICES` it runs under, `cuda_visible_devices`: null when unset). One that
cannot start says why there instead, `OMNIFLOW-FAILED {"error": ...}` (the exception, its
traceback on standard error as before), for its launcher to report (`start_failure`).

A worker whose registry record is gone registers again (Redis restarted or was flushed, or
the worker paused past its TTL) unless its id was fenced (`Registry.fence`: it was declared
lost, its node cut off say, and its replica placed elsewhere): then it drains and exits, so
that the replacement alone serves.

Exit status: 0 after a drain, 3 when the drain had to cancel executions, 4 when it cannot
go on serving (its unit reports why, `ComputeUnit.health`, or the GPU weights it attached lost
their publisher), 5 when its event loop stopped turning for
`stall_timeout_s` (a deadlock, or node code blocking the loop): the liveness thread, which
would otherwise keep answering pings for a worker that serves nothing, dumps every thread's
stack on standard error, deregisters the worker and ends the process, so that its calls go
to other replicas and a supervising launcher replaces it. 6 when it was fenced (above).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import hashlib
import itertools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psutil
import uvloop
import zmq
import zmq.asyncio

from engine.data import framed
from engine.data.codec import MiB, WireCodec, WireError
from engine.data.curve import PlaneGuard, PlaneKeys
from engine.data.peer import Peer, PeerConfig, ServerConfig
from engine.data.shm import local_namespace
from engine.data.wire import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    HelloReply,
    HelloRequest,
    LoadReply,
    LoadRequest,
    PingReply,
    PingRequest,
    WorkerMessage,
)
from engine.flow.discovery import (
    FencedWorkerError,
    Registry,
    RegistryUnavailableError,
    UnknownWorkerError,
    WorkerInfo,
    WorkerLoad,
    make_registry,
)
from engine.flow.gpus import VISIBLE_DEVICES_ENV
from engine.flow.links import LoopSocket
from engine.spec.graph import RoleSpec
from engine.spec.kinds import KindRegistry, default_kinds
from engine.spec.ops import OpConfig, default_ops
from engine.spec.userfiles import UsersRoot
from engine.worker.core import RoleWorkerCore
from engine.worker.kv import KVHosting, open_index
from engine.worker.title import set_title

log = logging.getLogger(__name__)

READY_PREFIX = "OMNIFLOW-READY "
FAILED_PREFIX = "OMNIFLOW-FAILED "
_ANSWER_LINGER_MS = 1000
STALLED_EXIT = 5
"""The exit status of a worker whose event loop stopped turning (see the module docstring)."""
FENCED_EXIT = 6
"""The exit status of a worker whose id was fenced: another replica took its place."""
REFUSED_METRIC = "plane.refused"
"""The worker metric counting connections its sockets refused: no CURVE, a key not authorised,
or (the local socket) a process of another uid; with those its unit's own sockets refused
(`ComputeUnit.refused`: a tensor-parallel replica's link and transfer seats, its follower ranks'
included)."""


DEFAULT_LISTEN = "tcp://127.0.0.1:0"
"""A worker's control endpoint unless told otherwise (`--listen`)."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: RoleSpec
    worker_id: str
    workflow: str = ""
    listen: str = DEFAULT_LISTEN
    registry_url: str | None = None
    namespace: str = "omniflow"
    heartbeat_s: float = 0.5
    registry_ttl_s: float = 2.0
    parent_pid: int | None = None
    drain_timeout_s: float = 30.0
    pull_timeout_s: float = 30.0
    max_message_bytes: int = 64 * MiB
    capacity: int | None = None
    tp_rank: int = 0
    tp_address: str | None = None
    """A role with `tp_size > 1`: where this replica's ranks meet (see `engine.compute.tp.unit`)."""
    tp_listen_fd: int | None = None
    """Rank 0: an inherited socket already listening at `tp_address` (`engine.data.rendezvous`)."""
    stall_timeout_s: float = 60.0
    """How long the event loop may go without turning before the worker ends itself (0: never)."""
    allow_module_ops: bool = True
    """Run `module:function` ops besides the registered ones (`--no-module-ops`: refuse them,
    whatever the executor sends: a worker enforces its launcher's rule itself)."""
    host_weights: bool = True
    """Share CPU weights with the host's other workers (`HostWeights`); False: a copy of its own."""
    keys: PlaneKeys | None = None
    """The plane's CURVE keys (`engine.data.curve`): control, liveness and the tensor/KV page
    server admit only their holders. None is the plaintext plane, which only an explicit
    `--plaintext` asks for (the benchmarks' anchor)."""
    users_root: Path | None = None
    """Where this host keeps its owners' folders (a studio node's `<OMNIFLOW_DATA_DIR>/users`): a
    run's output folder names are resolved under it (`engine.spec.userfiles`). None: calls with
    an owner write no files here (the command line's calls have none)."""


def host_of_endpoint(endpoint: str) -> str:
    """The host a worker listening on `endpoint` reports (this machine's name for every interface)."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    return host if host not in ("*", "0.0.0.0") else socket.gethostname()


def _bound(sock: zmq.Socket, host: str) -> str:
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"


class _LoopWatch:
    """Whether the worker's event loop still turns: each heartbeat the liveness thread posts a
    probe to it; a probe left unanswered for `timeout_s`, and still unanswered one check later,
    means the loop is stuck. Compute runs on the units' own threads, so a loop that turns
    answers within microseconds; the check one beat later spares a worker whose threads were
    all held up together (a paused process, a starved machine): once they run again the loop
    answers long before that check."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self._sent: float | None = None
        """When the probe not yet answered was posted (written by the liveness thread only
        while None, and set back to None by the loop)."""
        self._suspect = False

    def _answer(self) -> None:
        self._sent = None

    def stalled(self) -> str | None:
        """From the liveness thread, each heartbeat: why the loop counts as stuck, or None."""
        if self._timeout_s <= 0:
            return None
        now = time.monotonic()
        sent = self._sent
        if sent is None:
            self._suspect = False
            self._sent = now
            self._loop.call_soon_threadsafe(self._answer)
            return None
        if now - sent < self._timeout_s:
            return None
        if not self._suspect:
            self._suspect = True  # confirmed only if it is still unanswered at the next check
            return None
        return (f"the worker's event loop has not turned for {now - sent:.1f} s"
                f" (stall timeout {self._timeout_s:g} s)")


class _Liveness(threading.Thread):
    """Answers pings and keeps the registry entry fresh, independent of the main loop."""

    _STOP_BEAT_S = 3.0
    """How long stopping waits for a heartbeat in progress (each registry call has its own timeout)."""

    def __init__(self, config: WorkerConfig, host: str, load: Callable[[], WorkerLoad],
                 stop_worker: Callable[[str], None], check: Callable[[], str | None] = lambda: None,
                 stalled: Callable[[], str | None] = lambda: None) -> None:
        super().__init__(name="omniflow-liveness", daemon=True)
        self._config = config
        self._host = host
        self._load = load
        self._stop_worker = stop_worker
        self._check = check
        self._stalled = stalled
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._info: WorkerInfo | None = None
        self._registry: Registry | None = None
        self.address = ""
        self.failure: BaseException | None = None
        self.guard: PlaneGuard | None = None
        self.fenced: str | None = None
        """Why the worker stops, once the registry refused it as fenced (it heartbeats no more)."""

    def start_and_bind(self, timeout: float = 10.0) -> str:
        self.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the liveness thread did not start")
        if self.failure is not None:
            raise self.failure
        return self.address

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # noqa: BLE001 - surfaced to the main thread through `failure`
            self.failure = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        context = zmq.asyncio.Context()
        keys = self._config.keys
        guard = self.guard = None if keys is None else PlaneGuard(context, keys, name="liveness")
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
        if guard is not None:
            guard.serve(sock)
        sock.bind(f"tcp://{self._host}:0")
        self.address = _bound(sock, self._host)
        self._ready.set()
        codec = WireCodec(64 * 1024, WorkerMessage)
        beat = asyncio.create_task(self._beat())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            while not self._stopping.is_set():
                receiving = sock.recv_multipart()
                await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not receiving.done():  # asked to stop while waiting for a message
                    receiving.cancel()
                    break
                frames = receiving.result()
                if len(frames) != 2:
                    continue
                identity, payload = frames
                try:
                    message = codec.decode(payload)
                except WireError as exc:
                    reply: WorkerMessage = ErrorReply(None, exc.code, str(exc))
                else:
                    if isinstance(message, PingRequest):
                        reply = PingReply(message.request_id)
                    elif isinstance(message, LoadRequest):
                        load = self._load()
                        reply = LoadReply(message.request_id, load.outstanding, load.queue_depth, load.busy,
                                          load.metrics)
                    elif isinstance(message, HelloRequest):
                        reply = HelloReply(PROTOCOL_VERSION, self._config.worker_id, self._host, 0, 64 * 1024)
                    else:
                        reply = ErrorReply(None, ErrorCode.BAD_REQUEST,
                                           "the liveness endpoint only answers pings and load requests")
                await sock.send_multipart([identity, codec.encode(reply)])
        finally:
            # The beat is asked to stop, not cancelled: redis-py's asyncio client can swallow a
            # cancellation that lands inside a command (redis/redis-py#2028, #2551), leaving the
            # beat running and the thread unjoinable, so the worker would exit without deregistering.
            self._stopping.set()
            stopping.cancel()
            _, pending = await asyncio.wait({beat}, timeout=self._STOP_BEAT_S)
            if pending:
                log.warning("the heartbeat did not stop within %.1f s", self._STOP_BEAT_S)
                beat.cancel()
            if self._registry is not None and self._info is not None:
                with contextlib.suppress(RegistryUnavailableError):
                    await self._registry.deregister(self._info.worker_id)
                await self._registry.close()
            sock.close()
            if guard is not None:
                guard.close()
            context.term()

    async def _register(self, info: WorkerInfo) -> None:
        self._info = info
        if self._config.registry_url is not None:
            self._registry = make_registry(self._config.registry_url, namespace=self._config.namespace,
                                           ttl_s=self._config.registry_ttl_s)
            await self._registry.register(info, self._load())

    def register(self, info: WorkerInfo, timeout: float = 10.0) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._register(info), self._loop).result(timeout)

    async def _stopped_within(self, seconds: float) -> bool:
        assert self._stopping is not None
        try:
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        except TimeoutError:
            return False
        return True

    async def _beat(self) -> None:
        """Heartbeats until `_stopping` is set (never cancelled mid-call; see `_main`)."""
        parent = self._config.parent_pid
        while not await self._stopped_within(self._config.heartbeat_s):
            if parent is not None and os.getppid() != parent:
                log.warning("parent process %d is gone; stopping", parent)
                self._stop_worker(f"parent process {parent} is gone")
                parent = None
            stuck = self._stalled()
            if stuck is not None:
                await self._end_stalled(stuck)
            problem = self._check()
            if problem is not None:
                log.error("%s; stopping", problem)
                self._stop_worker(problem)
                self._check = lambda: None  # said once: the worker is stopping
            if self._registry is None or self._info is None or self.fenced is not None:
                continue
            try:
                await self._registry.heartbeat(self._info.worker_id, self._load())
            except UnknownWorkerError:
                await self._register_again(self._registry, self._info)
            except RegistryUnavailableError as exc:
                log.warning("registry unavailable (%s); the worker keeps serving and retries", exc)

    async def _register_again(self, registry: Registry, info: WorkerInfo) -> None:
        """The registry has no record of us. Lost (a Redis restart or flush, or a pause past the
        TTL): register again, the worker still serves its replica. Fenced (declared lost, its
        node cut off, and replaced): the registry refuses us, and the worker stops, else it
        would serve beside its replacement."""
        log.info("registry lost worker %s; registering again", info.worker_id)
        try:
            await registry.register(info, self._load())
        except FencedWorkerError as exc:
            self.fenced = str(exc)
            log.warning("%s; it drains and exits: its replacement serves instead", exc)
            self._stop_worker(self.fenced)
        except RegistryUnavailableError as exc:
            log.warning("registering again failed (%s); the next heartbeat retries", exc)

    async def _end_stalled(self, reason: str) -> None:
        """The main loop is stuck, so no graceful stop can run: say where every thread is,
        leave the registry and end the process, whatever fails on the way. Written straight
        to standard error: the stuck thread may hold a logging lock."""
        try:
            os.write(2, f"worker {self._config.worker_id}: {reason}; dumping every thread's stack, deregistering"
                        f" and exiting with status {STALLED_EXIT}\n".encode())
            faulthandler.dump_traceback(all_threads=True)
            if self._registry is not None and self._info is not None:
                async with asyncio.timeout(self._STOP_BEAT_S):
                    await self._registry.deregister(self._info.worker_id)
        except Exception as exc:  # noqa: BLE001 - exiting regardless; the registry's TTL ends the record
            with contextlib.suppress(OSError):
                os.write(2, f"worker {self._config.worker_id}: deregistering failed: {exc!r}\n".encode())
        finally:
            os._exit(STALLED_EXIT)

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self.join(timeout)


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
        self.address = _bound(self.sock, self.host)

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
        if config.role.tp_size > 1:
            # Rank 0 of a tensor-parallel replica: its KV pages hold only its heads, so it does not
            # serve them to other workers as if they were whole (`engine.compute.tp.unit`).
            tp_unit, _ = self.kinds.role_kind(config.role.kind).load_tp_runner()
            self.unit = tp_unit(role, tp=tp_seat(config))
            self.kv = KVHosting()
        else:
            index = open_index(config.registry_url, config.namespace)
            seat = TransferSeat(peer, config.worker_id, index)
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
        self.liveness = _Liveness(config, self.host, self.load, lambda reason: loop.call_soon_threadsafe(
            self.stop.set), self.check, _LoopWatch(loop, config.stall_timeout_s).stalled)
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


def report_start_failure(error: str) -> None:
    """Tell the launcher why this worker could not start: the FAILED line on standard output."""
    print(FAILED_PREFIX + json.dumps({"error": error}), flush=True)


def start_failure(output: str) -> str | None:
    """Why a worker could not start, as the last FAILED line in `output` (what it printed) says;
    None when there is none."""
    for line in reversed(output.splitlines()):
        if line.startswith(FAILED_PREFIX):
            try:
                error = json.loads(line[len(FAILED_PREFIX):]).get("error")
            except (json.JSONDecodeError, AttributeError):
                return None
            return error if isinstance(error, str) and error else None
    return None


def run_role_worker(config: WorkerConfig, kinds: KindRegistry | None = None) -> int:
    """Serve `config.role` until told to stop; prints the READY line on standard output (the
    FAILED line, and raises, when it cannot start)."""
    announced = False

    def ready(details: dict) -> None:
        nonlocal announced
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
