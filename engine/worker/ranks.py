"""The worker processes of a `LocalCluster`: how one rank process is started, known ready and ended.

A worker process is `python -m engine.worker`, forked from the cluster's zygote (`fork_server`:
`engine.worker.zygote`, which has imported the spec's compute units already) or started as a
fresh interpreter. It is ready once it prints its READY line (`_ready_details`); one that exits
first (saying why in its FAILED line, when it could), prints a malformed line or is not ready
within `ready_timeout_s` is a `LaunchError`, and is never left running. A tensor-parallel replica is its `tp_size` rank processes, started
together (ranks meet on a socket bound here and handed to rank 0), ready when all are; if one
fails, none is left. Ending a process is SIGTERM (it drains), then SIGKILL after
`stop_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.compute.threads import thread_environment
from engine.data.curve import PlaneKeys
from engine.data.rendezvous import listening_socket
from engine.flow.gpus import gpu_environment
from engine.spec.graph import GraphSpec, encode_spec
from engine.spec.kinds import default_kinds
from engine.worker.announce import READY_PREFIX, start_failure
from engine.worker.zygote import INHERITED_FD, ForkedProcess, Zygote


class LaunchError(RuntimeError):
    """A worker did not come up."""


@dataclass(slots=True)
class LaunchedWorker:
    role: str
    worker_id: str
    process: asyncio.subprocess.Process | ForkedProcess
    details: dict
    relay: asyncio.Task[None] | None = None
    tp_rank: int = 0
    ranks: list[LaunchedWorker] = field(default_factory=list)
    """Rank 0 of a tensor-parallel replica: its follower ranks 1.. (empty otherwise)."""
    gpus: tuple[int, ...] = ()
    """The machine's GPUs this rank holds (it sees its whole replica's)."""
    tp_address: str | None = None
    """Rank 0 of a tensor-parallel replica: where its ranks meet (rank 0's rendezvous store)."""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def processes(self) -> list[LaunchedWorker]:
        """This worker and its follower ranks, rank order."""
        return [self, *self.ranks]


TP_RANK_SUFFIX = ".tp"


def rank_worker_id(worker_id: str, rank: int) -> str:
    """The worker id of rank `rank` of the tensor-parallel replica whose rank 0 is `worker_id`."""
    return worker_id if rank == 0 else f"{worker_id}{TP_RANK_SUFFIX}{rank}"


def leader_worker_id(worker_id: str) -> str | None:
    """Rank 0's worker id when `worker_id` is a follower rank's (`rank_worker_id`), else None."""
    head, sep, rank = worker_id.rpartition(TP_RANK_SUFFIX)
    return head if sep and rank.isdigit() and int(rank) > 0 else None


async def _relay(stream: asyncio.StreamReader, worker_id: str) -> None:
    while line := await stream.readline():
        sys.stderr.write(f"[{worker_id}] {line.decode('utf-8', 'replace')}")


async def _ready_details(process: asyncio.subprocess.Process | ForkedProcess, role: str, worker_id: str,
                         timeout_s: float) -> dict[str, Any]:
    """What a starting worker's READY line says, once it printed it; a worker that exits first, is
    not ready within `timeout_s`, or is cancelled meanwhile (another rank failed) is ended."""
    assert process.stdout is not None
    settled = False  # ready, or ended by the timeout branch: the finally leaves it alone
    reason: str | None = None  # what its FAILED line said
    try:
        while True:
            async with asyncio.timeout(timeout_s):
                line = await process.stdout.readline()
            if not line:
                code = await process.wait()
                why = f": {reason}" if reason else " (its error is on standard error above)"
                raise LaunchError(f"worker {worker_id} of role {role!r} exited with status {code}"
                                  f" before it was ready{why}")
            text = line.decode("utf-8", "replace")
            reason = start_failure(text) or reason
            if text.startswith(READY_PREFIX):
                try:
                    details = json.loads(text[len(READY_PREFIX):])
                except json.JSONDecodeError as exc:
                    raise LaunchError(f"worker {worker_id} of role {role!r} printed a malformed READY line:"
                                      f" {exc}") from None
                break
        settled = True
    except TimeoutError:
        settled = True
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            process.kill()
        await process.wait()
        raise LaunchError(f"worker {worker_id} of role {role!r} was not ready within {timeout_s} s") from None
    finally:
        if not settled:  # cancelled (e.g. another rank failed), its READY line unreadable: never leave it running
            # A rank that failed the same way may have exited already: kill() raising
            # ProcessLookupError would replace the cancellation (and the replica's real error).
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    return details


class ProcessLauncher:
    """Starts and ends the worker processes of one cluster's spec (see the module docstring)."""

    def __init__(self, spec: GraphSpec, *, allow_module_ops: bool, registry_url: str | None, namespace: str,
                 ready_timeout_s: float, stop_timeout_s: float, heartbeat_s: float, listen: str,
                 extra_args: tuple[str, ...], fork_server: bool, keys: PlaneKeys | None,
                 users_root: Path | None = None) -> None:
        """`keys`: the plane's keys the workers get as files (None: a plaintext plane); `users_root`:
        where the workers resolve a run's output folder names (`--users-root`; None: nowhere)."""
        self.spec = spec
        self.allow_module_ops = allow_module_ops
        self.registry_url = registry_url
        self.namespace = namespace
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.heartbeat_s = heartbeat_s
        self.listen = listen
        self.extra_args = extra_args
        self.fork_server = fork_server
        self.keys = keys
        self.users_root = users_root
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.zygote: Zygote | None = None

    async def open(self) -> None:
        """The spec and keys as files the workers read (a directory only this user can read), and
        the zygote, when forking."""
        self._tmp = tempfile.TemporaryDirectory(prefix="omniflow-cluster-")
        (Path(self._tmp.name) / "workflow.json").write_bytes(encode_spec(self.spec))
        if self.keys is not None:
            self.keys.write(Path(self._tmp.name) / "keys")  # the directory is this user's, 0700
        if self.fork_server:
            self.zygote = await Zygote.start(self._preload(), env=self._env(), ready_timeout_s=self.ready_timeout_s)

    async def close(self) -> None:
        if self.zygote is not None:
            await self.zygote.close(self.stop_timeout_s)
            self.zygote = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _env(self) -> dict[str, str]:
        # Workers import the same workflow modules (python ops) as this process.
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env = thread_environment(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(paths)
        return env

    async def replica(self, role: str, worker_id: str, tp_size: int, gpus: tuple[int, ...],
                      spawned: Callable[[int], Awaitable[None]]) -> LaunchedWorker:
        """The processes of one replica whose rank 0 is `worker_id`, once all are ready: rank 0,
        with its followers in `.ranks`; `spawned(pid)` once rank 0's process is."""
        if tp_size == 1:
            return await self._spawn_rank(role, worker_id, spawned=spawned, gpus=gpus, rank_gpus=gpus)
        return await self._spawn_ranks(role, worker_id, tp_size, spawned, gpus)

    async def _spawn_ranks(self, role: str, worker_id: str, tp_size: int,
                           spawned: Callable[[int], Awaitable[None]], gpus: tuple[int, ...]) -> LaunchedWorker:
        """The `tp_size` rank processes of one tensor-parallel replica, once all are ready:
        rank 0, with the others in its `.ranks`; `spawned(pid)` once rank 0's process is. Each
        rank sees all of `gpus` and holds its share."""
        share = len(gpus) // tp_size
        # The replica's ranks meet on a socket bound here and handed to rank 0 (its rendezvous
        # store serves on it): the port is the replica's from the start.
        listener, address = listening_socket()
        with listener:  # rank 0 holds its own copy once forked
            started = await self._all_ready(role, [
                asyncio.create_task(self._spawn_rank(role, rank_worker_id(worker_id, rank),
                                                     ("--tp-rank", str(rank), "--tp-address", address),
                                                     inherit=listener.fileno() if rank == 0 else None,
                                                     spawned=spawned if rank == 0 else None, gpus=gpus,
                                                     rank_gpus=gpus[rank * share:(rank + 1) * share]))
                for rank in range(tp_size)])
        worker, worker.ranks, worker.tp_address = started[0], started[1:], address
        return worker

    async def _all_ready(self, role: str, tasks: list[asyncio.Task[LaunchedWorker]]) -> list[LaunchedWorker]:
        """The workers `tasks` start, once all are ready; if one fails (or this is cancelled),
        none is left starting or running."""
        # A rank that fails to start dooms its replica: the others would only wait for it.
        waited = False
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            waited = True
        finally:
            if not waited:  # failed or cancelled while waiting: no rank is left starting or running
                for task in tasks:
                    task.cancel()
                spawned = await asyncio.gather(*tasks, return_exceptions=True)
                await self.end([w for w in spawned if isinstance(w, LaunchedWorker)])
        for task in tasks:
            task.cancel()  # no-op for the finished ones
        spawned = await asyncio.gather(*tasks, return_exceptions=True)
        started = [w for w in spawned if isinstance(w, LaunchedWorker)]
        failed = [e for e in spawned if isinstance(e, BaseException) and not isinstance(e, asyncio.CancelledError)]
        if failed or len(started) < len(tasks):
            await self.end(started)
            raise failed[0] if failed else LaunchError(f"a rank of role {role!r} was cancelled while starting")
        return started

    def _preload(self) -> list[str]:
        """What the zygote imports before forking: the worker and the spec's compute units."""
        kinds = default_kinds()
        modules = ["engine.worker.__main__", "engine.compute.weights.store"]
        for role in self.spec.roles:
            kind = kinds.role_kind(role.kind)
            runners = [kind.runner] + ([kind.tp_runner] if role.tp_size > 1 and kind.tp_runner else [])
            modules += [runner.partition(":")[0] for runner in runners]
        return list(dict.fromkeys(modules))

    async def _spawn_rank(self, role: str, worker_id: str, tp_args: tuple[str, ...] = (),
                          inherit: int | None = None,
                          spawned: Callable[[int], Awaitable[None]] | None = None,
                          gpus: tuple[int, ...] = (), rank_gpus: tuple[int, ...] = ()) -> LaunchedWorker:
        """One worker process, once it has printed its READY line. `inherit`: rank 0's listening
        socket, which the process gets a copy of (`--tp-listen-fd`); `spawned(pid)` is awaited once
        the process is (if it raises or this is cancelled meanwhile, the process is ended); `gpus`:
        the GPUs it sees (its replica's), `rank_gpus` those it holds."""
        env = gpu_environment(gpus)
        assert self._tmp is not None
        spec_path = Path(self._tmp.name) / "workflow.json"
        # A forked worker's parent is the zygote: it exits with it (and the zygote with us).
        parent = self.zygote.pid if self.zygote is not None else os.getpid()
        args = [
            "--role", role, "--workflow", str(spec_path), "--worker-id", worker_id,
            "--parent-pid", str(parent), "--namespace", self.namespace,
            "--heartbeat", str(self.heartbeat_s), "--registry-ttl", str(4 * self.heartbeat_s), "--listen", self.listen,
            "--module-ops" if self.allow_module_ops else "--no-module-ops",
            *tp_args, *self.extra_args,
        ]
        args += ["--plaintext"] if self.keys is None else ["--keys", str(Path(self._tmp.name) / "keys")]
        if self.registry_url:
            args += ["--registry", self.registry_url]
        if self.users_root is not None:
            args += ["--users-root", str(self.users_root)]
        process: asyncio.subprocess.Process | ForkedProcess
        if self.zygote is not None:
            if inherit is not None:
                args += ["--tp-listen-fd", INHERITED_FD]
            process = await self.zygote.spawn(args, title=f"omniflow-worker role={role} id={worker_id} (starting)",
                                               inherit=inherit, env=env)
        else:
            if inherit is not None:
                args += ["--tp-listen-fd", str(inherit)]
            process = await asyncio.create_subprocess_exec(sys.executable, "-m", "engine.worker", *args,
                                                           stdout=asyncio.subprocess.PIPE, env={**self._env(), **env},
                                                           pass_fds=() if inherit is None else (inherit,))
        announced = spawned is None
        try:
            if spawned is not None:
                await spawned(process.pid)
                announced = True
        finally:
            if not announced:  # the listener failed, or this start was cancelled: never leave it running
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        details = await _ready_details(process, role, worker_id, self.ready_timeout_s)
        worker = LaunchedWorker(role, worker_id, process, details, tp_rank=int(details.get("tp_rank", 0)),
                                gpus=rank_gpus)
        # Keep reading what the worker prints (node code may print), so its pipe never fills.
        worker.relay = asyncio.get_running_loop().create_task(_relay(process.stdout, worker_id))
        return worker

    async def end(self, workers: list[LaunchedWorker]) -> None:
        """SIGTERM `workers` (each drains), SIGKILL those still alive after `stop_timeout_s`, reap them."""
        for worker in workers:
            if worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                async with asyncio.timeout(self.stop_timeout_s):
                    await worker.process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                await worker.process.wait()
            if worker.relay is not None:
                worker.relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await worker.relay
