"""A fork server for role workers: import torch, transformers, diffusers and the units once, fork each worker.

A worker process spends seconds importing its libraries before it builds a (tiny) model;
a cluster of seven roles on a small machine spent most of its start there. `Zygote`
starts one process (`python -m engine.worker.zygote`) that imports the modules the
workers will need (`preload`) and then forks each worker from that state, so the import
happens once and the children share its pages copy-on-write.

The zygote never runs a torch operation, never makes a ZeroMQ context, an event loop or a
thread of its own before forking: a child starts as a clean single-threaded process and
runs `python -m engine.worker ARGS` (`engine.worker.__main__.main`), as a spawned worker
would. Each child has its own process title, prints its READY line on its own standard
output (a pipe the launcher made and passed to the zygote), inherits the zygote's
standard error, and gets SIGTERM when the zygote dies (`PR_SET_PDEATHSIG`), besides its
own `--parent-pid` check.

The launcher and the zygote talk over a Unix `SOCK_SEQPACKET` socket pair, one msgspec
JSON message per packet, never pickle. Requests: `SpawnRequest` with the child's stdout
pipe attached (`SCM_RIGHTS`), and, when it says so, one more descriptor for the child to
inherit (a tensor-parallel rank 0's rendezvous socket), whose number in the child replaces
`INHERITED_FD` in its arguments, and the variables its environment gets besides the zygote's
(a replica's `CUDA_VISIBLE_DEVICES`: set before the child touches CUDA, which the zygote never
initialises). Events: `ZygoteReadyEvent`; `SpawnedEvent` with a pidfd of
the child attached, so the launcher signals and watches the child race-free although it
is not its parent; `SpawnFailedEvent`; `ExitedEvent` once the zygote has reaped a child.
The zygote exits when the launcher's end closes (the launcher exited or was killed): it
sends SIGTERM to its children, SIGKILL to those alive after a grace period, reaps them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import importlib
import itertools
import os
import random
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Mapping, Sequence

import msgspec

from engine.worker.title import set_title

_MAX_PACKET = 256 * 1024
_PR_SET_PDEATHSIG = 1


class ZygoteError(RuntimeError):
    """The fork server did not start, did not answer in time, or is gone."""


INHERITED_FD = "{inherited-fd}"
"""In a spawn's arguments: the number, in the child, of the descriptor it inherits."""


class SpawnRequest(msgspec.Struct, tag="spawn", frozen=True):
    """Fork a worker running `python -m engine.worker *argv`; fds attached: its stdout, then
    (with `inherit`) the descriptor the child keeps open, named in `argv` by `INHERITED_FD`."""

    request_id: int
    argv: list[str]
    title: str
    inherit: bool = False
    env: dict[str, str] = msgspec.field(default_factory=dict)
    """Set in the child's environment before it runs the worker."""


class ZygoteReadyEvent(msgspec.Struct, tag="ready", frozen=True):
    pid: int
    preloaded: list[str]


class SpawnedEvent(msgspec.Struct, tag="spawned", frozen=True):
    """The child is forked; one fd attached: a pidfd of it."""

    request_id: int
    pid: int


class SpawnFailedEvent(msgspec.Struct, tag="spawn_failed", frozen=True):
    """`request_id` None: a request too malformed to name one."""

    request_id: int | None
    error: str


class ExitedEvent(msgspec.Struct, tag="exited", frozen=True):
    """The zygote reaped child `pid`; `returncode` as `asyncio` reports it (-N: killed by signal N)."""

    pid: int
    returncode: int


ZygoteRequest = SpawnRequest
ZygoteEvent = ZygoteReadyEvent | SpawnedEvent | SpawnFailedEvent | ExitedEvent

_encode = msgspec.json.Encoder().encode
_decode_request = msgspec.json.Decoder(ZygoteRequest).decode
_decode_event = msgspec.json.Decoder(ZygoteEvent).decode


# -- the launcher's side ---------------------------------------------------------------------------


class ForkedProcess:
    """A worker forked by the zygote, with the part of `asyncio.subprocess.Process` the launcher uses.

    Signals go through a pidfd (never to a recycled pid). `returncode` is set once the zygote
    reports the exit status; if the zygote is gone first, `wait()` still returns when the process
    exits (the pidfd says so) but the status is unknown and `wait()` returns None.
    """

    def __init__(self, pid: int, pidfd: int, stdout: asyncio.StreamReader) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._done = asyncio.get_running_loop().create_future()

    def send_signal(self, signum: int) -> None:
        """Raises ProcessLookupError when the process has exited."""
        if self._done.done():
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def wait(self) -> int | None:
        return await asyncio.shield(self._done)

    def _exited(self, returncode: int | None) -> None:
        if self._done.done():
            return
        self.returncode = returncode
        self._done.set_result(returncode)
        os.close(self._pidfd)

    def _orphaned(self) -> None:
        """The zygote is gone: learn of the exit from the pidfd (readable once the process ends)."""
        if self._done.done():
            return
        loop = asyncio.get_running_loop()

        def readable() -> None:
            loop.remove_reader(self._pidfd)
            self._exited(None)

        loop.add_reader(self._pidfd, readable)


class Zygote:
    """The launcher's handle on a fork server (see the module docstring). Use from one event loop."""

    def __init__(self, process: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self.process = process
        self._sock = sock
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[int, int]]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._unclaimed: set[int] = set()
        """Pids forked for a waiting `spawn` that has not registered them yet."""
        self._early_exits: dict[int, int] = {}
        self._ready: asyncio.Future[ZygoteReadyEvent] = asyncio.get_running_loop().create_future()
        self._lost: ZygoteError | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def start(cls, preload: Sequence[str], *, env: dict[str, str] | None = None,
                    ready_timeout_s: float = 60.0) -> Zygote:
        """Start the fork server and wait until it has imported `preload` (module names)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with contextlib.ExitStack() as undo:
                undo.callback(ours.close)  # no fork server: our end of its socket goes too
                args = [sys.executable, "-m", "engine.worker.zygote", "--control-fd", str(theirs.fileno()),
                        "--parent-pid", str(os.getpid())]
                for module in preload:
                    args += ["--preload", module]
                process = await asyncio.create_subprocess_exec(
                    *args, pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL, env=env)
                undo.pop_all()
        finally:
            theirs.close()
        ours.setblocking(False)
        zygote = cls(process, ours)
        asyncio.get_running_loop().add_reader(ours, zygote._readable)
        ready = False
        try:
            try:
                async with asyncio.timeout(ready_timeout_s):
                    await asyncio.shield(zygote._ready)
            except TimeoutError:
                raise ZygoteError(f"the fork server did not import its modules within {ready_timeout_s} s") from None
            ready = True
        finally:
            if not ready:  # any failure, cancellation included: the fork server goes
                await zygote.close(timeout_s=5.0)
        return zygote

    async def spawn(self, argv: Sequence[str], *, title: str, timeout_s: float = 10.0,
                    inherit: int | None = None, env: Mapping[str, str] | None = None) -> ForkedProcess:
        """Fork a worker running `python -m engine.worker *argv`; returns once it is forked.
        `inherit`: a descriptor of this process the child gets a copy of, its number in the
        child put in place of `INHERITED_FD` in `argv`. `env`: set in the child's environment."""
        if self._lost is not None:
            raise self._lost
        if (inherit is not None) != (INHERITED_FD in argv):
            raise ValueError(f"a spawn that inherits a descriptor names it in its arguments as {INHERITED_FD!r}"
                             " (and only such a spawn)")
        loop = asyncio.get_running_loop()
        read_end, write_end = os.pipe()
        request_id = next(self._ids)
        forked = self._pending[request_id] = loop.create_future()
        forked_in_time = False
        try:
            try:
                request = SpawnRequest(request_id, list(argv), title, inherit is not None, dict(env or {}))
                socket.send_fds(self._sock, [_encode(request)], [write_end, *([inherit] if inherit is not None else [])])
            except BlockingIOError:
                raise ZygoteError("the fork server's control channel is full") from None
            finally:
                os.close(write_end)
            try:
                async with asyncio.timeout(timeout_s):
                    pid, pidfd = await asyncio.shield(forked)
            except TimeoutError:
                raise ZygoteError(f"the fork server did not fork within {timeout_s} s") from None
            forked_in_time = True
        finally:
            if not forked_in_time:
                os.close(read_end)
                if forked.done() and not forked.cancelled() and forked.exception() is None:
                    # Forked just as this spawn gave up (timeout, cancellation).
                    self._abandon(*forked.result())
            self._pending.pop(request_id, None)
        reader = asyncio.StreamReader()
        with contextlib.ExitStack() as undo:
            undo.callback(self._abandon, pid, pidfd)  # a child whose output cannot be read is not kept
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_end, "rb", 0))
            undo.pop_all()
        child = ForkedProcess(pid, pidfd, reader)
        self._unclaimed.discard(pid)
        if pid in self._early_exits:
            child._exited(self._early_exits.pop(pid))
        elif self._lost is not None:
            child._orphaned()
        else:
            self._children[pid] = child
        return child

    def _abandon(self, pid: int, pidfd: int) -> None:
        """A child whose `spawn` gave up: nobody will read its output or hold its pidfd, so it
        must not run (its exit, when the zygote reports it, is ignored)."""
        self._unclaimed.discard(pid)
        self._early_exits.pop(pid, None)
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.close(pidfd)

    def _readable(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, _MAX_PACKET, 1)
            except BlockingIOError:
                return
            except OSError as exc:
                self._fail(ZygoteError(f"the fork server's channel failed: {exc}"))
                return
            if not data:
                self._fail(ZygoteError("the fork server exited"))
                return
            try:
                event = _decode_event(data)
            except msgspec.DecodeError as exc:
                for fd in fds:
                    os.close(fd)
                self._fail(ZygoteError(f"the fork server sent a malformed message: {exc}"))
                return
            self._handle(event, fds)

    def _handle(self, event: ZygoteEvent, fds: list[int]) -> None:
        if isinstance(event, ZygoteReadyEvent):
            if not self._ready.done():
                self._ready.set_result(event)
        elif isinstance(event, SpawnedEvent):
            future = self._pending.get(event.request_id)
            if not fds and future is not None and not future.done():
                future.set_exception(ZygoteError(f"the fork server forked pid {event.pid} but sent no pidfd of it"))
            if not fds or future is None or future.done():
                # Forked after its `spawn` gave up: nobody reads its output, so it must not run.
                for fd in fds:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                    os.close(fd)
                return
            self._unclaimed.add(event.pid)
            future.set_result((event.pid, fds[0]))
        elif isinstance(event, SpawnFailedEvent):
            if event.request_id is None:  # we sent something it could not read: a protocol error
                self._fail(ZygoteError(f"the fork server refused a request: {event.error}"))
                return
            future = self._pending.get(event.request_id)
            if future is not None and not future.done():
                future.set_exception(ZygoteError(f"the fork server could not fork: {event.error}"))
        else:
            child = self._children.pop(event.pid, None)
            if child is not None:
                child._exited(event.returncode)
            elif event.pid in self._unclaimed:  # reaped before `spawn` got to register it
                self._early_exits[event.pid] = event.returncode
            # Otherwise a child whose spawn gave up (and killed it): remembering its exit would
            # mark a later child that reuses the pid as exited.

    def _fail(self, error: ZygoteError) -> None:
        if self._lost is not None:
            return
        self._lost = error
        asyncio.get_running_loop().remove_reader(self._sock)
        if not self._ready.done():
            self._ready.set_exception(error)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        children, self._children = self._children, {}
        for child in children.values():
            child._orphaned()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Close the channel: the zygote stops its remaining children (SIGTERM, then SIGKILL after
        its grace period) and exits; SIGKILL it if it has not within `timeout_s`."""
        if self._lost is None:
            self._fail(ZygoteError("the fork server was closed"))
        if not self._ready.cancelled():
            self._ready.exception()  # retrieved: a start that failed has raised it already
        if self._sock.fileno() >= 0:
            self._sock.close()
        try:
            async with asyncio.timeout(timeout_s):
                await self.process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()


# -- the zygote process ----------------------------------------------------------------------------


class _Server:
    """The zygote's loop: single-threaded, `select` over the control socket and a SIGCHLD wakeup pipe."""

    def __init__(self, sock: socket.socket, grace_s: float) -> None:
        self.sock = sock
        self.grace_s = grace_s
        self.children: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def send(self, event: ZygoteEvent, fds: Sequence[int] = ()) -> None:
        socket.send_fds(self.sock, [_encode(event)], list(fds))

    def serve(self, preloaded: list[str]) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        try:
            # A launcher that gave up while the zygote imported has closed the channel: the
            # zygote then has no one to serve and exits like any other closed channel.
            self.send(ZygoteReadyEvent(os.getpid(), preloaded))
            while True:
                readable, _, _ = select.select([self.sock, self.wake_r], [], [])
                if self.wake_r in readable:
                    self._drain_wakeups()
                    self.reap()
                if self.sock in readable:
                    data, fds, _, _ = socket.recv_fds(self.sock, _MAX_PACKET, 2)
                    if not data:
                        return
                    self._spawn(data, fds)
        except (BrokenPipeError, ConnectionResetError):
            return
        finally:
            self.stop_children()

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 512):
                pass

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            with contextlib.suppress(OSError):
                self.send(ExitedEvent(pid, os.waitstatus_to_exitcode(status)))

    def _spawn(self, data: bytes, fds: list[int]) -> None:
        try:
            request = _decode_request(data)
        except msgspec.DecodeError as exc:
            for fd in fds:
                os.close(fd)
            self.send(SpawnFailedEvent(None, f"malformed request: {exc}"))
            return
        expected = 2 if request.inherit else 1
        if len(fds) != expected:
            for fd in fds:
                os.close(fd)
            self.send(SpawnFailedEvent(request.request_id, f"this spawn request carries exactly {expected} fd(s)"
                                                           " (stdout, then the one to inherit)"))
            return
        stdout_fd = fds[0]
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:  # out of processes or memory: this request fails, the zygote serves on
            for fd in fds:
                os.close(fd)
            self.send(SpawnFailedEvent(request.request_id, f"fork: {exc}"))
            return
        if pid == 0:
            code = 1
            try:
                code = self._child(request, stdout_fd, fds[1] if request.inherit else None)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # noqa: BLE001 - the child must never return into the zygote's loop
                traceback.print_exc()
            finally:
                with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        for fd in fds:
            os.close(fd)
        self.children.add(pid)
        pidfd = os.pidfd_open(pid)
        try:
            self.send(SpawnedEvent(request.request_id, pid), [pidfd])
        finally:
            os.close(pidfd)

    def _child(self, request: SpawnRequest, stdout_fd: int, inherited: int | None) -> int:
        zygote_pid = os.getppid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        _die_with_parent()
        if os.getppid() != zygote_pid:  # the zygote died before the death signal was armed
            return 1
        os.dup2(stdout_fd, 1)
        os.close(stdout_fd)
        random.seed()  # a fresh interpreter would seed from the OS; the zygote's state is shared
        set_title(request.title)
        os.environ.update(request.env)
        argv = [str(inherited) if arg == INHERITED_FD else arg for arg in request.argv]
        sys.argv = ["python -m engine.worker", *argv]
        from engine.worker.__main__ import main

        return main(argv)

    def stop_children(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while self.children and (left := deadline - time.monotonic()) > 0:
            select.select([self.wake_r], [], [], left)
            self._drain_wakeups()
            self.reap()
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while self.children:
            try:
                pid, _ = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            self.children.discard(pid)


def _die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Have the kernel send `signum` to this process when its parent (the zygote) exits."""
    name = ctypes.util.find_library("c")
    if name is None:
        raise ZygoteError("libc not found: cannot arm the parent-death signal")
    if ctypes.CDLL(name, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise ZygoteError(f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.worker.zygote", description="fork server of role workers")
    parser.add_argument("--control-fd", type=int, required=True, help="the launcher's SOCK_SEQPACKET socket")
    parser.add_argument("--parent-pid", type=int, required=True, help="the launcher (for the process title)")
    parser.add_argument("--preload", action="append", default=[], help="a module to import before forking")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds children get to exit after SIGTERM when the launcher is gone")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.control_fd)
    # Ctrl-C reaches the whole process group: the launcher and the workers act on it, the
    # zygote follows the launcher (its channel closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_title(f"omniflow-zygote parent={args.parent_pid}")
    for module in args.preload:
        importlib.import_module(module)
    _Server(sock, args.grace).serve(list(args.preload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
