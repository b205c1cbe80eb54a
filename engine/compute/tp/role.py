"""`TPRole`: one role's `tp_size` rank processes, driven through rank 0.

The caller (the executor's side of the role) talks only to rank 0, over a pipe. Rank 0
forwards each command to the other ranks in order (one pipe each: an idle role waits
without a collective, so no gloo timeout fires while nothing runs), and every rank runs
it on its own shard; the collectives inside the forward keep them in step, and rank 0's
result is the answer. The ranks follow rank 0's schedule: they execute exactly its
sequence of commands on identical, deterministic engines.

Failure: a rank that dies makes the others' next collective fail within the group's
timeout (`TPRankError`, never a hang); a follower whose command raised exits, which
fails the group the same way. `call()` waits for rank 0's answer while watching every
rank's process: a dead rank fails the call (with rank 0's own error when it reports one
within `timeout_s`), the role is closed, and every later call fails at once.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from engine.compute.tp.group import TPError, TPGroup, TPRankError


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank builds: the model (a built-in name or a seeded `ModelConfig`), the engine
    and diffusion configs, torch threads per rank and the collective timeout."""

    model: Any
    engine: Any = None
    diffusion: Any = None
    threads: int = 1
    timeout_s: float = 10.0
    extra: dict[str, Any] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, size: int, address: str, spec: RankSpec, upstream: Connection,
               followers: Sequence[Connection]) -> None:
    """A rank process: join the group, build the shard, then run commands until told to stop."""
    from engine.compute.tp.worker import RankState

    torch.set_num_threads(spec.threads)
    group = TPGroup.init(rank, size, address, timeout_s=spec.timeout_s)
    state = RankState(spec, group)
    if rank == 0:
        upstream.send(("ready", os.getpid()))
    try:
        while True:
            try:
                cmd = upstream.recv()
            except EOFError:
                return  # the driver (or rank 0) is gone
            if rank == 0:
                try:
                    for conn in followers:
                        conn.send(cmd)
                except OSError as exc:
                    upstream.send(("error", f"rank 0: cannot reach a follower rank: {exc!r}"))
                    continue
            if cmd is None:
                return
            try:
                result = state.run(cmd)
            except Exception as exc:  # noqa: BLE001 - reported to the driver (rank 0) or fatal (others)
                if rank != 0:
                    os._exit(3)  # the group fails at rank 0's next collective
                status = "rank_error" if isinstance(exc, TPRankError) else "error"
                upstream.send((status, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
                continue
            if rank == 0:
                upstream.send(("ok", result))
    finally:
        state.close()
        group.close()


class TPRole:
    """A role of `size` ranks over `spec`; `call(cmd)` runs a command on every rank (see the
    module docstring). Use as a context manager, or `close()` it."""

    def __init__(self, spec: RankSpec, size: int, *, start_timeout_s: float = 120.0) -> None:
        if size < 1:
            raise TPError(f"tp_size must be >= 1, got {size}")
        self.size = size
        self.spec = spec
        self.failed: str | None = None
        ctx = mp.get_context("spawn")
        address = f"tcp://127.0.0.1:{_free_port()}"
        self._conn, leader_end = ctx.Pipe()
        pipes = [ctx.Pipe() for _ in range(size - 1)]
        self.procs = []
        for rank in range(size):
            upstream = leader_end if rank == 0 else pipes[rank - 1][1]
            followers = [p[0] for p in pipes] if rank == 0 else []
            proc = ctx.Process(target=_rank_main, args=(rank, size, address, spec, upstream, followers),
                               name=f"omniflow-tp{rank}", daemon=True)
            proc.start()
            self.procs.append(proc)
        leader_end.close()
        for a, b in pipes:
            a.close()
            b.close()
        try:
            self._wait(start_timeout_s, "start")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]  # type: ignore[misc]

    def _wait(self, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        dead: list[int] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no answer from rank 0 to {what} within {timeout_s:.1f}s"
                                 + (f" (dead ranks: {dead})" if dead else ""))
            watch = [self._conn] + [p.sentinel for i, p in enumerate(self.procs) if i not in dead]
            ready = wait(watch, timeout=left)
            if self._conn in ready:
                try:
                    status, value = self._conn.recv()
                except (EOFError, OSError):
                    raise self._fail(f"rank 0 died during {what} (exit code {self.procs[0].exitcode})") from None
                if status == "rank_error":  # the group is broken: fail the role
                    raise self._fail(f"{what} failed" + (f"; rank(s) {dead} died" if dead else "") + f": {value}")
                if status == "error":
                    if dead:
                        raise self._fail(f"rank(s) {dead} died during {what}; rank 0: {value}")
                    raise TPError(value)
                return value
            for index, proc in enumerate(self.procs):
                if index not in dead and proc.sentinel in ready:
                    dead.append(index)
            if 0 in dead:
                raise self._fail(f"rank 0 died during {what} (exit code {self.procs[0].exitcode})")
            # A follower died: rank 0 reports its own failed collective within the group timeout.
            deadline = min(deadline, time.monotonic() + self.spec.timeout_s + 5.0)

    def _fail(self, message: str) -> TPRankError:
        self.failed = message
        self.close()
        return TPRankError(message)

    def call(self, cmd: tuple, timeout_s: float = 300.0) -> Any:
        """Run `cmd` (a tuple, see `engine.compute.tp.worker.RankState.run`) on every rank; rank 0's result."""
        if self.failed is not None:
            raise TPRankError(f"the role has failed: {self.failed}")
        try:
            self._conn.send(cmd)
        except OSError as exc:
            raise self._fail(f"rank 0 is unreachable: {exc!r}") from exc
        return self._wait(timeout_s, repr(cmd[0]))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every rank (asking first, then terminating, then killing)."""
        with contextlib.suppress(OSError):  # rank 0 may be gone already
            self._conn.send(None)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._conn.close()

    def __enter__(self) -> TPRole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
