"""LocalCluster: spawn the role workers a GraphSpec asks for on this machine.

Each role gets `replicas` worker processes (`python -m engine.worker`), started with
this process as their parent (they exit if it dies). `start()` waits until every
worker has printed its READY line — readiness, not a sleep — and `stop()` sends
SIGTERM (then SIGKILL after a grace period) and reaps them.

Without a registry URL the cluster fills an in-process registry from the READY lines
and keeps their loads fresh by asking each worker's liveness endpoint every heartbeat
(workers cannot heartbeat into another process's memory); with one, workers register
and heartbeat there themselves and the cluster reads it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from engine.data.codec import WireCodec, WireError
from engine.data.wire import LoadReply, LoadRequest, WorkerMessage
from engine.flow.discovery import (
    InProcessRegistry,
    Registry,
    UnknownWorkerError,
    WorkerInfo,
    WorkerLoad,
    make_registry,
)
from engine.spec.graph import GraphSpec, encode_spec
from engine.worker.process import READY_PREFIX


class LaunchError(RuntimeError):
    """A worker did not come up."""


@dataclass(slots=True)
class LaunchedWorker:
    role: str
    worker_id: str
    process: asyncio.subprocess.Process
    details: dict
    relay: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid


async def _relay(stream: asyncio.StreamReader, worker_id: str) -> None:
    while line := await stream.readline():
        sys.stderr.write(f"[{worker_id}] {line.decode('utf-8', 'replace')}")


class LocalCluster:
    def __init__(
        self,
        spec: GraphSpec,
        *,
        registry_url: str | None = None,
        namespace: str = "omniflow",
        ready_timeout_s: float = 60.0,
        stop_timeout_s: float = 10.0,
        heartbeat_s: float = 0.5,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.spec = spec
        self.registry_url = registry_url
        self.namespace = namespace
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.heartbeat_s = heartbeat_s
        self.extra_args = extra_args
        self.workers: list[LaunchedWorker] = []
        self.registry: Registry = (
            make_registry(registry_url, namespace=namespace) if registry_url else InProcessRegistry(ttl_s=float("inf"))
        )
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._poller: asyncio.Task[None] | None = None

    def _env(self) -> dict[str, str]:
        # Workers import the same workflow modules (python ops) as this process.
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(paths)
        return env

    async def spawn(self, role: str, index: int) -> LaunchedWorker:
        assert self._tmp is not None
        spec_path = Path(self._tmp.name) / "workflow.json"
        worker_id = f"{self.spec.name}-{role}-{index}-{os.getpid()}"
        args = [
            sys.executable, "-m", "engine.worker",
            "--role", role, "--workflow", str(spec_path), "--worker-id", worker_id,
            "--parent-pid", str(os.getpid()), "--namespace", self.namespace,
            "--heartbeat", str(self.heartbeat_s), "--registry-ttl", str(4 * self.heartbeat_s),
            *self.extra_args,
        ]
        if self.registry_url:
            args += ["--registry", self.registry_url]
        process = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, env=self._env())
        assert process.stdout is not None
        try:
            while True:
                line = await asyncio.wait_for(process.stdout.readline(), self.ready_timeout_s)
                if not line:
                    code = await process.wait()
                    raise LaunchError(f"worker {worker_id} of role {role!r} exited with status {code}"
                                      " before it was ready (its error is on standard error above)")
                text = line.decode("utf-8", "replace")
                if text.startswith(READY_PREFIX):
                    details = json.loads(text[len(READY_PREFIX):])
                    break
        except TimeoutError:
            process.kill()
            await process.wait()
            raise LaunchError(f"worker {worker_id} of role {role!r} was not ready within"
                              f" {self.ready_timeout_s} s") from None
        worker = LaunchedWorker(role, worker_id, process, details)
        # Keep reading what the worker prints (node code may print), so its pipe never fills.
        worker.relay = asyncio.get_running_loop().create_task(_relay(process.stdout, worker_id))
        self.workers.append(worker)
        if isinstance(self.registry, InProcessRegistry):
            await self.registry.register(WorkerInfo(
                worker_id=worker_id, role=role, address=details["address"], capacity=details["capacity"],
                host=details["host"], pid=details["pid"],
                meta={"liveness": details["liveness"], "data": details["data"]},
            ))
        return worker

    async def start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="omniflow-cluster-")
        (Path(self._tmp.name) / "workflow.json").write_bytes(encode_spec(self.spec))
        try:
            await asyncio.gather(*(self.spawn(role.name, i) for role in self.spec.roles for i in range(role.replicas)))
        except BaseException:
            await self.stop()
            raise
        if isinstance(self.registry, InProcessRegistry):
            self._poller = asyncio.get_running_loop().create_task(self._poll_loads(self.registry))

    async def _poll_loads(self, registry: InProcessRegistry) -> None:
        """Heartbeat the in-process registry on the workers' behalf with the load each
        reports on its liveness endpoint; a worker that does not answer keeps its last load."""
        context = zmq.asyncio.Context()
        codec = WireCodec(16 * 1024 * 1024, WorkerMessage)
        sockets: dict[str, zmq.asyncio.Socket] = {}
        ids = itertools.count(1)
        try:
            while True:
                await asyncio.sleep(self.heartbeat_s)
                for worker in list(self.workers):
                    sock = sockets.get(worker.worker_id)
                    if sock is None:
                        sock = sockets[worker.worker_id] = context.socket(zmq.DEALER)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.connect(worker.details["liveness"])
                    rid = next(ids)
                    await sock.send(codec.encode(LoadRequest(rid)))
                    try:
                        while True:
                            reply = codec.decode(await asyncio.wait_for(sock.recv(), self.heartbeat_s))
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

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        workers, self.workers = self.workers, []
        for worker in workers:
            if worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                await asyncio.wait_for(worker.process.wait(), self.stop_timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                await worker.process.wait()
            if worker.relay is not None:
                worker.relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await worker.relay
        await self.registry.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def __aenter__(self) -> LocalCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
