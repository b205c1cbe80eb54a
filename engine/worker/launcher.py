"""LocalCluster: spawn the role workers a GraphSpec asks for on this machine.

Each role gets `replicas` worker processes (`python -m engine.worker`), started with
this process as their parent (they exit if it dies). `start()` waits until every
worker has printed its READY line — readiness, not a sleep — and `stop()` sends
SIGTERM (then SIGKILL after a grace period) and reaps them.

A role with `tp_size` N > 1 gets N processes per replica, its tensor-parallel ranks
(`engine.compute.tp.unit`): rank 0 is the replica's worker (the one endpoint registered
for the executor), ranks 1.. follow it and are listed in its `LaunchedWorker.ranks`, with
worker ids `rank_worker_id(rank 0's id, rank)`. A replica is ready when all its ranks are;
stopping it stops rank 0 first (it drains, then tells the others to stop) and then the rest.

How a process is started, known ready and ended is `engine.worker.ranks`'s (`ProcessLauncher`);
the cluster decides which replicas run, registers them, reports them and supervises them.

Without a registry URL the cluster fills an in-process registry from the READY lines
and keeps their loads fresh by asking each worker's liveness endpoint every heartbeat
(workers cannot heartbeat into another process's memory); with one, workers register
and heartbeat there themselves and the cluster reads it back.

With a `RestartPolicy` the cluster also supervises its replicas (`engine.worker.supervise`):
a replica that ends unasked is deregistered, stopped whole and replaced under a new worker id.

`on_launch` hears each replica come up, a `WorkerLaunch` per step (`LaunchState`): STARTING once
its process (rank 0's, for a tensor-parallel replica) is spawned, then READY once it is registered,
or FAILED (with the error) or ABANDONED (its start was cancelled: the cluster stopped, another
worker of the start failed, a pending replacement was given up). Replacements are reported too.

GPUs: on a machine with GPUs (a `GpuPool`, by default one of those `nvidia-smi` lists), each
replica of a role asking for `resources.gpus` gets GPUs of its own (`engine.flow.gpus`: all
replicas of the spec at start, packed together; a replica added later, the free ones), its
processes started with `CUDA_VISIBLE_DEVICES` naming them; a replacement keeps its replica's,
a retired replica gives them back. Replicas that do not fit are a `LaunchError` naming them.
Roles asking for none, and every role on a machine without GPUs, are left as before: no
`CUDA_VISIBLE_DEVICES` set, they run where their `device` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import zmq
import zmq.asyncio

from engine.data.codec import WireCodec, WireError
from engine.data.curve import PlaneKeys, connect_as_client
from engine.data.wire import LoadReply, LoadRequest, WorkerMessage
from engine.flow.discovery import (
    InProcessRegistry,
    Registry,
    UnknownWorkerError,
    WorkerInfo,
    WorkerLoad,
    make_registry,
)
from engine.flow.discovery.machine import detect_gpus
from engine.flow.gpus import GpuAssignmentError, GpuPool, GpuRequest
from engine.spec.graph import GraphSpec
from engine.spec.resources import role_resources
from engine.worker.config import DEFAULT_LISTEN, host_of_endpoint
from engine.worker.ranks import (
    TP_RANK_SUFFIX,
    LaunchedWorker,
    LaunchError,
    ProcessLauncher,
    leader_worker_id,
    rank_worker_id,
)
from engine.worker.supervise import ReplicaEvent, RestartPolicy, Supervisor
from engine.worker.zygote import ZygoteError

__all__ = [  # the rank processes' names a cluster's users need, with the cluster's own
    "TP_RANK_SUFFIX", "LaunchError", "LaunchListener", "LaunchState", "LaunchedWorker", "LocalCluster",
    "WorkerLaunch", "leader_worker_id", "rank_worker_id",
]


class LaunchState(StrEnum):
    STARTING = "starting"
    """The replica's process (rank 0's) is spawned: `host` and `pid` say where; not ready yet."""
    READY = "ready"
    """Every rank printed its READY line and the replica is registered (`worker`)."""
    FAILED = "failed"
    """It did not come up (`error`); nothing of it is left running."""
    ABANDONED = "abandoned"
    """Its start was cancelled (the cluster is stopping, another worker of the same start failed,
    or a pending replacement was given up); nothing of it is left running."""


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """One step of a replica coming up, as `LocalCluster(on_launch=...)` hears it. A replica's
    steps are STARTING (unless it failed before its process was spawned), then one of READY,
    FAILED or ABANDONED; a tensor-parallel replica is one stream, named by its rank 0."""

    state: LaunchState
    role: str
    index: int
    """Its replica index within the role (a replacement keeps the index of the replica it replaces)."""
    worker_id: str
    """Rank 0's worker id."""
    host: str
    """The host its workers report (the host of their `--listen` endpoint)."""
    pid: int | None = None
    """Rank 0's process id; None when it failed before it was spawned."""
    generation: int = 0
    """0: a first start; N > 0: the Nth replacement of the replica at `index` (`-rN` ids)."""
    error: str = ""
    """FAILED: why, in words."""
    worker: LaunchedWorker | None = None
    """READY: the replica, with its follower ranks."""
    gpus: tuple[int, ...] = ()
    """The machine's GPUs the replica holds (none on a machine without GPUs, or a role asking none)."""


LaunchListener = Callable[[WorkerLaunch], Awaitable[None]]


async def _poll_loads(registry: InProcessRegistry, workers: list[LaunchedWorker], keys: PlaneKeys | None,
                      interval_s: float) -> None:
    """Heartbeat the in-process registry on the workers' behalf with the load each reports on its
    liveness endpoint, every `interval_s`; a worker that does not answer keeps its last load."""
    context = zmq.asyncio.Context()
    codec = WireCodec(16 * 1024 * 1024, WorkerMessage)
    sockets: dict[str, zmq.asyncio.Socket] = {}
    ids = itertools.count(1)
    try:
        while True:
            await asyncio.sleep(interval_s)
            for worker in list(workers):
                sock = sockets.get(worker.worker_id)
                if sock is None:
                    sock = sockets[worker.worker_id] = context.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    connect_as_client(sock, keys)
                    sock.connect(worker.details["liveness"])
                rid = next(ids)
                await sock.send(codec.encode(LoadRequest(rid)))
                try:
                    while True:
                        async with asyncio.timeout(interval_s):
                            reply = codec.decode(await sock.recv())
                        if isinstance(reply, LoadReply) and reply.request_id == rid:
                            break
                except (TimeoutError, WireError):
                    continue
                load = WorkerLoad(outstanding=reply.outstanding, queue_depth=reply.queue_depth,
                                  busy=reply.busy, metrics=reply.metrics)
                with contextlib.suppress(UnknownWorkerError):
                    await registry.heartbeat(worker.worker_id, load)
    finally:
        for sock in sockets.values():
            sock.close()
        context.term()


class LocalCluster:
    def __init__(
        self,
        spec: GraphSpec,
        *,
        allow_module_ops: bool,
        registry_url: str | None = None,
        namespace: str = "omniflow",
        ready_timeout_s: float = 60.0,
        stop_timeout_s: float = 10.0,
        heartbeat_s: float = 0.5,
        extra_args: tuple[str, ...] = (),
        fork_server: bool = True,
        restart: RestartPolicy | None = None,
        on_event: Callable[[ReplicaEvent], Awaitable[None]] | None = None,
        on_launch: LaunchListener | None = None,
        keys: PlaneKeys | None = None,
        plaintext: bool = False,
        listen: str = DEFAULT_LISTEN,
        gpus: GpuPool | None = None,
        users_root: Path | None = None,
    ) -> None:
        """`allow_module_ops`: whether the workers run `module:function` ops besides the registered
        ones (the command line: yes; a studio: its operator's setting); each worker enforces it.
        `restart`: supervise the replicas (None: a replica that ends stays gone);
        `on_event` hears of each loss and replacement. `on_launch` hears each replica's steps as it
        comes up, replacements included (`WorkerLaunch`); awaited in line, so a listener that
        raises fails that start (and leaves nothing of it running). `listen`: the workers' control
        endpoint (`tcp://HOST:0`: any free port). `keys`: the worker plane's CURVE keys
        (default: a fresh keypair for this cluster), which the workers get as files only this
        user can read and whoever dispatches to them uses too (`keys`, give them to the
        dispatcher's `Peer`); `plaintext`: no CURVE at all (only to measure what it costs).
        `gpus`: the machine's GPUs its replicas are seated on, shared with whatever else launches
        replicas here (default: a pool of its own over those `nvidia-smi` lists, read at start).
        `users_root`: where the workers write a run's files, in its owner's folder
        (`engine.spec.userfiles`; a studio: its node's `<data dir>/users`; None: they write none)."""
        if plaintext and keys is not None:
            raise ValueError("a plaintext cluster takes no keys")
        self.keys: PlaneKeys | None = None if plaintext else keys or PlaneKeys.generate()
        self.spec = spec
        self.heartbeat_s = heartbeat_s
        self.listen = listen
        self.launcher = ProcessLauncher(
            spec, allow_module_ops=allow_module_ops, registry_url=registry_url, namespace=namespace,
            ready_timeout_s=ready_timeout_s, stop_timeout_s=stop_timeout_s, heartbeat_s=heartbeat_s, listen=listen,
            extra_args=extra_args, fork_server=fork_server, keys=self.keys, users_root=users_root)
        self._on_launch = on_launch
        self.workers: list[LaunchedWorker] = []
        self.registry: Registry = (
            make_registry(registry_url, namespace=namespace) if registry_url else InProcessRegistry(ttl_s=float("inf"))
        )
        self._poller: asyncio.Task[None] | None = None
        self.gpus = gpus
        self._seats: dict[tuple[str, int], tuple[int, ...]] = {}
        """(role, replica index) -> the GPUs of that replica (only those holding some)."""
        self._replica_of: dict[str, tuple[str, int]] = {}
        """Rank 0's worker id -> (role, replica index)."""
        self._supervisor = None if restart is None else Supervisor(
            restart, registry=self.registry, workers=self.workers, start=self._spawn_replica, end=self.launcher.end,
            on_event=on_event)

    async def spawn(self, role: str, index: int) -> LaunchedWorker:
        """Start replica `index` of `role`: one worker, or `tp_size` rank processes (returned as
        rank 0 with the others in `.ranks`); only rank 0 is registered and in `workers`."""
        started = False
        try:
            worker = await self._spawn_replica(role, index)
            started = True
        finally:
            if not started:  # a replica added that did not come up holds no GPUs
                self._give_back(role, index)
        if self._supervisor is not None:
            self._supervisor.watch(worker, index)
        return worker

    async def _spawn_replica(self, role: str, index: int, generation: int = 0) -> LaunchedWorker:
        """Replica `index` of `role`, ready, registered and in `workers`; `generation` N > 0: its
        Nth replacement (worker id suffix `-rN`). Reports its steps to `on_launch`."""
        worker_id = f"{self.spec.name}-{role}-{index}-{os.getpid()}"
        if generation:
            worker_id += f"-r{generation}"
        launch = WorkerLaunch(LaunchState.STARTING, role, index, worker_id, host_of_endpoint(self.listen),
                              generation=generation)

        async def spawned(pid: int) -> None:
            nonlocal launch
            launch = dataclasses.replace(launch, pid=pid)
            await self._report(launch)

        try:
            gpus = self._seat(role, index)
            launch = dataclasses.replace(launch, gpus=gpus)
            worker = await self._start_replica(role, worker_id, gpus, spawned)
            self._replica_of[worker.worker_id] = (role, index)
        except asyncio.CancelledError:
            await self._report(dataclasses.replace(launch, state=LaunchState.ABANDONED))
            raise
        except (LaunchError, ZygoteError, OSError) as exc:  # OSError: its process could not be spawned
            await self._report(dataclasses.replace(launch, state=LaunchState.FAILED, error=str(exc)))
            raise
        await self._report(dataclasses.replace(launch, state=LaunchState.READY, worker=worker))
        return worker

    async def _report(self, launch: WorkerLaunch) -> None:
        if self._on_launch is not None:
            await self._on_launch(launch)

    async def _start_replica(self, role: str, worker_id: str, gpus: tuple[int, ...],
                             spawned: Callable[[int], Awaitable[None]]) -> LaunchedWorker:
        """The replica whose rank 0 is `worker_id`, ready, registered and in `workers`;
        `spawned(pid)` once rank 0's process is."""
        worker = await self.launcher.replica(role, worker_id, self.spec.role(role).tp_size, gpus, spawned)
        if isinstance(self.registry, InProcessRegistry):  # the record the worker itself made, from its READY line
            try:
                info = WorkerInfo.from_dict(worker.details["info"])
            except (KeyError, ValueError) as exc:
                await self.launcher.end([worker, *worker.ranks])
                raise LaunchError(f"worker {worker_id} of role {role!r} announced no usable record: {exc}") from None
            await self.registry.register(info)
        self.workers.append(worker)
        return worker

    def restarting(self, role: str) -> int:
        """How many replicas of `role` are lost and waiting for (or starting) their replacement."""
        return 0 if self._supervisor is None else self._supervisor.pending(role)

    async def cancel_restarts(self, role: str, count: int) -> int:
        """Give up to `count` pending replacements of `role` (scaling down while a replica is
        being replaced); returns how many were given up."""
        return 0 if self._supervisor is None else await self._supervisor.cancel_pending(role, count)

    def _take_gpus(self, replicas: list[tuple[str, int]]) -> None:
        """Seat those of `replicas` (role, index) that ask for GPUs and have none yet, together;
        nothing on a machine without GPUs. Raises LaunchError when they do not fit."""
        assert self.gpus is not None
        if not self.gpus.count:
            return
        requests = []
        for role, index in replicas:
            spec = self.spec.role(role)
            per_process = role_resources(spec.resources).per_process.gpus
            if per_process and (role, index) not in self._seats:
                requests.append(GpuRequest(role, index, per_process, spec.tp_size))
        try:
            grants = self.gpus.take(requests)
        except GpuAssignmentError as exc:
            raise LaunchError(f"this machine's GPUs cannot hold the replicas: {exc}") from None
        self._seats.update(((g.role, g.replica), g.gpus) for g in grants)

    def _seat(self, role: str, index: int) -> tuple[int, ...]:
        """The GPUs of replica `index` of `role` (seated now if it has none yet)."""
        if self.gpus is None:
            self.gpus = GpuPool(len(detect_gpus()))
        self._take_gpus([(role, index)])
        return self._seats.get((role, index), ())

    def _give_back(self, role: str, index: int) -> None:
        if self.gpus is not None:
            self.gpus.give_back(self._seats.pop((role, index), ()))

    async def start(self) -> None:
        spawns: list[asyncio.Task[LaunchedWorker]] = []
        started = False
        try:
            if self.gpus is None:
                self.gpus = GpuPool(len(detect_gpus()))
            # Every replica at once: packed together, larger ones first (`engine.flow.gpus`).
            self._take_gpus([(role.name, i) for role in self.spec.roles for i in range(role.replicas)])
            await self.launcher.open()
            spawns = [asyncio.ensure_future(self.spawn(role.name, i))
                      for role in self.spec.roles for i in range(role.replicas)]
            await asyncio.gather(*spawns)
            started = True
        finally:
            if not started:
                # One worker failed: the others still starting are ended (a cancelled start kills its
                # process) before stop(), which only knows the workers that finished starting.
                for task in spawns:
                    task.cancel()
                await asyncio.gather(*spawns, return_exceptions=True)
                await self.stop()
        if isinstance(self.registry, InProcessRegistry):
            self._poller = asyncio.get_running_loop().create_task(
                _poll_loads(self.registry, self.workers, self.keys, self.heartbeat_s))

    async def stop(self) -> None:
        if self._supervisor is not None:
            await self._supervisor.close()  # nothing is replaced while the cluster stops
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        workers = list(self.workers)
        self.workers.clear()  # the same list: the supervisor holds it
        # Rank 0 of a tensor-parallel replica first: it drains, then stops its followers.
        await self.launcher.end(workers)
        await self.launcher.end([rank for worker in workers for rank in worker.ranks])
        await self.launcher.close()
        await self.registry.close()
        for role, index in list(self._seats):
            self._give_back(role, index)
        self._replica_of.clear()

    async def retire(self, worker: LaunchedWorker) -> None:
        """Stop one replica of a running cluster (scaling down): rank 0 drains and deregisters,
        then its follower ranks stop. A replica lost meanwhile is not replaced."""
        if self._supervisor is not None:
            await self._supervisor.unsupervise(worker)
        if worker in self.workers:
            self.workers.remove(worker)
        await self.launcher.end([worker])
        await self.launcher.end(worker.ranks)
        replica = self._replica_of.pop(worker.worker_id, None)
        if replica is not None:
            self._give_back(*replica)
        if isinstance(self.registry, InProcessRegistry):
            await self.registry.deregister(worker.worker_id)

    async def __aenter__(self) -> LocalCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
