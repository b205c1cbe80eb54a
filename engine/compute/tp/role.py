"""`TPRole`: one role's `tp_size` rank processes, driven from the caller's process.

The driver (the executor's side of the role, a test, `omniflow bench tp`) starts every rank
as a subprocess (`python -m engine.compute.tp.role`, the `RankSpec` as msgspec JSON on its
command line) and talks to each over its stdin and stdout pipes in length-prefixed msgpack
frames (`messages.py`: `TPRoleCall`, `TPStop` in; `TPHello`, `TPRoleResult`,
`TPRoleFailure` out; tensors as raw bytes under a header). Nothing is pickled. A rank's
frames go out on a duplicate of its original stdout; its fd 1 then points at stderr, so
stray prints cannot corrupt them.

Each call goes to every rank in the same order (followers first), and every rank runs it on
its own shard; the collectives inside the forward keep them in step, and rank 0's result is
the answer (followers send nothing but their hello). An idle role waits on its pipes, not in
a collective, so no gloo timeout fires while nothing runs. A command's result travels as the
type its `RankState.cmd_<name>` return annotation names.

Failure: a rank that dies makes the others' next collective fail within the group's
timeout (`TPRankError`, never a hang); a follower whose command raised exits, which fails
the group the same way. `call()` waits for rank 0's answer while watching every rank's
pipe (a rank's exit closes it): a dead rank fails the call (with rank 0's own error when it
reports one within the group timeout), the role is closed, and every later call fails at
once. A rank exits when its driver is gone (its stdin closes, or its parent pid changes).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import struct
import subprocess
import sys
import time
import traceback
import typing
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from engine.compute.diffusion import DiffusionConfig
from engine.compute.llm.config import EngineConfig
from engine.compute.models.catalog import ModelConfig
from engine.compute.tp.group import TPError, TPGroup, TPRankError
from engine.compute.tp.messages import (
    TPHello,
    TPRoleCall,
    TPRoleFailure,
    TPRoleReply,
    TPRoleRequest,
    TPRoleResult,
    TPStop,
    TPTensor,
)
from engine.compute.tp.worker import RankState
from engine.data.codec import TensorData, check_header, flatten_tensor
from engine.data.rendezvous import listening_socket
from engine.data.wire import Transport

_LENGTH = struct.Struct("<Q")
_HEARTBEAT_S = 1.0
"""How often an idle rank checks that its driver is still its parent."""
_READ_CHUNK = 1 << 20


class RankSpec(msgspec.Struct, frozen=True):
    """What every rank builds: the model (a built-in name or a seeded `ModelConfig`), the engine
    and diffusion configs, torch threads per rank and the collective timeout. Travels to the
    ranks as msgspec JSON."""

    model: str | ModelConfig
    engine: EngineConfig | None = None
    diffusion: DiffusionConfig | None = None
    threads: int = 1
    timeout_s: float = 10.0


# -- frames and values ----------------------------------------------------------------------------


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        flat = flatten_tensor(obj)
        return TPTensor(flat.header, flat.data.tobytes())
    raise NotImplementedError(f"a {type(obj).__name__} cannot travel between TP ranks")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is torch.Tensor:
        tensor = msgspec.convert(obj, TPTensor)
        check_header(tensor.header)
        return TensorData(tensor.header, bytearray(tensor.data), Transport.INLINE).torch()
    raise NotImplementedError(f"a {kind!r} cannot travel between TP ranks")


def _result_type(name: str) -> Any:
    """The type `RankState.cmd_<name>`'s result travels as (its return annotation)."""
    handler = getattr(RankState, f"cmd_{name}", None)
    if handler is None:
        return Any
    return typing.get_type_hints(handler).get("return", Any)


class _FrameReader:
    """Length-prefixed frames from a pipe fd, read as they arrive."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.eof = False
        self._buffer = bytearray()

    def fill(self) -> None:
        """Read what the pipe holds (call when it is readable); sets `eof` when it is closed."""
        try:
            chunk = os.read(self.fd, _READ_CHUNK)
        except BlockingIOError:
            return
        if chunk:
            self._buffer += chunk
        else:
            self.eof = True

    def next_frame(self) -> bytes | None:
        if len(self._buffer) < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(self._buffer)
        end = _LENGTH.size + length
        if len(self._buffer) < end:
            return None
        frame = bytes(self._buffer[_LENGTH.size:end])
        del self._buffer[:end]
        return frame


def _write_frame(fd: int, payload: bytes, deadline: float | None = None) -> None:
    """Write one frame; with a `deadline` the fd is non-blocking and a full pipe fails in time."""
    data = memoryview(_LENGTH.pack(len(payload)) + payload)
    while data:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise TimeoutError("the pipe stayed full")
        try:
            written = os.write(fd, data)
        except BlockingIOError:
            continue
        data = data[written:]


# -- a rank ---------------------------------------------------------------------------------------


def _rank_main(rank: int, size: int, address: str, spec: RankSpec, parent_pid: int, start_timeout_s: float,
               listen_fd: int | None = None) -> int:
    """A rank process: join the group, build the shard, say hello, then run commands until told
    to stop or the driver is gone. Returns the exit status."""
    out = os.dup(1)
    os.dup2(2, 1)  # prints go to stderr; frames go to `out`
    encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
    decoder = msgspec.msgpack.Decoder(TPRoleRequest)
    torch.set_num_threads(spec.threads)
    # The shard lives on the CPU (`RankState`), so the collectives are gloo's even where CUDA is.
    group = TPGroup.init(rank, size, address, timeout_s=spec.timeout_s, rendezvous_timeout_s=start_timeout_s,
                         backend="gloo", listen_fd=listen_fd)
    state = RankState(spec, group)
    reader = _FrameReader(0)
    try:
        _write_frame(out, encoder.encode(TPHello(rank, os.getpid())))
        while True:
            frame = reader.next_frame()
            if frame is None:
                if reader.eof:
                    return 0  # the driver is gone
                if select.select([0], [], [], _HEARTBEAT_S)[0]:
                    reader.fill()
                elif os.getppid() != parent_pid:
                    return 2
                continue
            message = decoder.decode(frame)
            if isinstance(message, TPStop):
                return 0
            try:
                reply: Any = TPRoleResult(msgspec.Raw(encoder.encode(state.run((message.name, *message.args)))))
            except Exception as exc:  # noqa: BLE001 - reported to the driver (rank 0) or fatal (others)
                if rank != 0:
                    traceback.print_exc()
                    sys.stderr.flush()
                    os._exit(3)  # the group fails at rank 0's next collective
                reply = TPRoleFailure(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}",
                                      isinstance(exc, TPRankError))
            if rank == 0:
                _write_frame(out, encoder.encode(reply))
    finally:
        state.close()
        group.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.compute.tp.role",
                                     description="One rank of a TPRole (started by TPRole, not by hand).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--listen-fd", type=int, default=None,
                        help="rank 0: an inherited socket already listening at --address")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--start-timeout", type=float, required=True)
    parser.add_argument("--spec", required=True, help="the RankSpec, msgspec JSON")
    args = parser.parse_args(argv)
    spec = msgspec.json.decode(args.spec, type=RankSpec)
    return _rank_main(args.rank, args.size, args.address, spec, args.parent_pid, args.start_timeout, args.listen_fd)


# -- the driver -----------------------------------------------------------------------------------


@dataclass(slots=True)
class RankProcess:
    """One rank's process and its pipes, as the driver holds them."""

    rank: int
    popen: subprocess.Popen[bytes]
    reader: _FrameReader = field(init=False)

    def __post_init__(self) -> None:
        assert self.popen.stdout is not None
        os.set_blocking(self.popen.stdout.fileno(), False)
        self.reader = _FrameReader(self.popen.stdout.fileno())

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def stdin_fd(self) -> int:
        assert self.popen.stdin is not None
        return self.popen.stdin.fileno()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def exitcode(self, wait_s: float = 2.0) -> int | None:
        """The exit status, waiting up to `wait_s` for an exit its closed pipe announced."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.popen.wait(wait_s)
        return None


class TPRole:
    """A role of `size` ranks over `spec`; `call(cmd)` runs a command on every rank (see the
    module docstring). Use as a context manager, or `close()` it."""

    def __init__(self, spec: RankSpec, size: int, *, start_timeout_s: float = 120.0) -> None:
        if size < 1:
            raise TPError(f"tp_size must be >= 1, got {size}")
        self.size = size
        self.spec = spec
        self.failed: str | None = None
        self._closed = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(TPRoleReply)
        payload = msgspec.json.encode(spec).decode()
        self.procs: list[RankProcess] = []
        with contextlib.ExitStack() as undo:
            undo.callback(self.close)  # ranks of a role that did not come up are stopped
            # Rank 0 serves the rendezvous store on a socket bound here: no other process can
            # take its port between the choice and rank 0's start.
            listener, address = listening_socket()
            with listener:
                for rank in range(size):
                    argv = [sys.executable, "-m", "engine.compute.tp.role", "--rank", str(rank), "--size", str(size),
                            "--address", address, "--parent-pid", str(os.getpid()),
                            "--start-timeout", str(start_timeout_s), "--spec", payload]
                    passed = (listener.fileno(),) if rank == 0 else ()
                    if passed:
                        argv += ["--listen-fd", str(listener.fileno())]
                    popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=passed)
                    self.procs.append(RankProcess(rank, popen))
            for proc in self.procs:
                os.set_blocking(proc.stdin_fd, False)
            self._wait_hello(start_timeout_s)
            undo.pop_all()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _poll(self, alive: list[RankProcess], left: float) -> list[RankProcess]:
        """Read what the pipes of `alive` hold within `left` seconds; the ranks read from."""
        fds = {p.reader.fd: p for p in alive}
        ready, _, _ = select.select(list(fds), [], [], left)
        for fd in ready:
            fds[fd].reader.fill()
        return [fds[fd] for fd in ready]

    def _wait_hello(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = {p.rank for p in self.procs}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"rank(s) {sorted(waiting)} did not start within {timeout_s:.1f}s")
            for proc in self._poll([p for p in self.procs if p.rank in waiting], left):
                frame = proc.reader.next_frame()
                if frame is not None:
                    hello = self._decoder.decode(frame)
                    if not isinstance(hello, TPHello) or hello.rank != proc.rank:
                        raise self._fail(f"rank {proc.rank} said {hello!r} instead of hello")
                    waiting.discard(proc.rank)
                elif proc.reader.eof:
                    raise self._fail(f"rank {proc.rank} died during start (exit code {proc.exitcode()})")

    def _wait(self, timeout_s: float, what: str, result_type: Any) -> Any:
        deadline = time.monotonic() + timeout_s
        dead: list[int] = []
        leader = self.procs[0]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no answer from rank 0 to {what} within {timeout_s:.1f}s"
                                 + (f" (dead ranks: {dead})" if dead else ""))
            for proc in self._poll([p for p in self.procs if p.rank not in dead], left):
                if proc is leader and (frame := proc.reader.next_frame()) is not None:
                    return self._answer(self._decoder.decode(frame), what, dead, result_type)
                if proc is not leader and proc.reader.next_frame() is not None:
                    raise self._fail(f"rank {proc.rank} sent a frame nobody asked for during {what}")
                if proc.reader.eof:
                    dead.append(proc.rank)
            if 0 in dead:
                raise self._fail(f"rank 0 died during {what} (exit code {leader.exitcode()})")
            if dead:
                # A follower died: rank 0 reports its own failed collective within the group timeout.
                deadline = min(deadline, time.monotonic() + self.spec.timeout_s + 5.0)

    def _answer(self, reply: Any, what: str, dead: list[int], result_type: Any) -> Any:
        if isinstance(reply, TPRoleResult):
            return msgspec.msgpack.decode(reply.value, type=result_type, dec_hook=_dec_hook)
        if not isinstance(reply, TPRoleFailure):
            raise self._fail(f"rank 0 answered {what} with {type(reply).__name__}")
        if reply.broken:  # the group is broken: fail the role
            raise self._fail(f"{what} failed" + (f"; rank(s) {dead} died" if dead else "") + f": {reply.message}")
        if dead:
            raise self._fail(f"rank(s) {dead} died during {what}; rank 0: {reply.message}")
        raise TPError(reply.message)

    def _fail(self, message: str) -> TPRankError:
        self.failed = message
        self.close()
        return TPRankError(message)

    def call(self, cmd: tuple, timeout_s: float = 300.0) -> Any:
        """Run `cmd` (a tuple, see `engine.compute.tp.worker.RankState.run`) on every rank; rank 0's result."""
        if self.failed is not None:
            raise TPRankError(f"the role has failed: {self.failed}")
        name, *args = cmd
        what = repr(name)
        payload = self._encoder.encode(TPRoleCall(name, args))
        deadline = time.monotonic() + self.spec.timeout_s
        for proc in [*self.procs[1:], self.procs[0]]:  # a dead follower is found before rank 0 runs it
            try:
                _write_frame(proc.stdin_fd, payload, deadline)
            except BrokenPipeError as exc:
                raise self._fail(f"rank(s) [{proc.rank}] died before {what} (exit code {proc.exitcode()})") from exc
            except OSError as exc:  # TimeoutError included: the rank stopped reading
                raise self._fail(f"rank {proc.rank} did not take {what}: {exc!r}") from exc
        return self._wait(timeout_s, what, _result_type(name))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every rank (asking first, then terminating, then killing). Idempotent."""
        if self._closed:
            return
        self._closed = True
        stop = self._encoder.encode(TPStop())
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            with contextlib.suppress(OSError):  # the rank may be gone already (or stuck: it is ended below)
                _write_frame(proc.stdin_fd, stop, min(deadline, time.monotonic() + 1.0))
            assert proc.popen.stdin is not None
            with contextlib.suppress(OSError):
                proc.popen.stdin.close()  # EOF: a rank that missed the stop frame stops too
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.popen.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(2.0)
            if proc.is_alive():
                proc.popen.kill()
                proc.popen.wait()
            assert proc.popen.stdout is not None
            proc.popen.stdout.close()

    def __enter__(self) -> TPRole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
