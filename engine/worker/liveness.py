"""The role worker's liveness thread: proof that the worker is alive, kept apart from its main loop.

`Liveness` runs its own thread and event loop with its own ROUTER socket: it answers pings, load
requests and hellos, and heartbeats the registry (when it has one) each `heartbeat_s`, so that a
worker busy in a long blocking forward pass still looks alive. Each beat it also

* stops the worker when the launcher that spawned it is gone (`parent_pid`), or when `check`
  (the process's health: its unit, its attached weights) says why it cannot go on serving;
* registers the worker again when the registry has lost its record (Redis restarted or was
  flushed, or the worker paused past its TTL), unless its id was fenced: then it stops the worker
  (`fenced` says why) so that its replacement alone serves;
* asks `stalled` (a `LoopWatch` on the main loop) whether the worker's event loop still turns. One
  that does not for `stall_timeout_s` means the worker serves nothing while this thread would
  keep answering pings: it dumps every thread's stack on standard error, deregisters the worker
  and ends the process with `STALLED_EXIT`, so that its calls go to other replicas and a
  supervising launcher replaces it.

On `stop` it deregisters the worker and closes its socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import threading
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from engine.data.codec import WireCodec, WireError
from engine.data.curve import PlaneGuard
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
from engine.worker.config import WorkerConfig, bound_endpoint

__all__ = ["STALLED_EXIT", "Liveness", "LoopWatch"]

log = logging.getLogger(__name__)

STALLED_EXIT = 5
"""The exit status of a worker whose event loop stopped turning (see the module docstring)."""


class LoopWatch:
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


class Liveness(threading.Thread):
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
        self.address = bound_endpoint(sock, self._host)
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
