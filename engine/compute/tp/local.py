"""A tensor-parallel group in one process tree, without workers: rank 0 here, followers as children.

`LocalRanks` starts follower ranks 1.. of a role as subprocesses of the caller
(`python -m engine.compute.tp.local`, the `RoleSpec` as msgspec JSON on the command line; each
runs its kind's `follow()`, as a worker's rank would) and gives the caller rank 0's seat, for it
to lead in-process (`leader.lead`, `TPLLMUnit`). What tests and `omniflow bench tp` use to run a
group without a cluster; a deployment starts ranks with `engine.worker.launcher`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys

import msgspec

from engine.compute.threads import thread_environment
from engine.compute.tp.group import TPError
from engine.compute.tp.seat import TPSeat
from engine.data.rendezvous import listening_socket
from engine.spec.graph import RoleSpec

STOP_TIMEOUT_S = 10.0


class LocalRanks:
    """Follower ranks of `role` (its `tp_size`) as child processes; `seat` is rank 0's, to join the
    group with once (its `listen_fd` is then the group's). Use as a context manager, or `close()`
    it (after rank 0 stopped them, it waits for their exit; a rank still running then is killed)."""

    def __init__(self, role: RoleSpec, *, threads: int | None = None) -> None:
        """`threads`: the followers' torch threads (`OMP_NUM_THREADS`; default: torch's own choice)."""
        if role.tp_size < 2:
            raise TPError(f"role {role.name!r} has tp_size {role.tp_size}: no follower ranks to start")
        self.role = role
        self.procs: list[subprocess.Popen[bytes]] = []
        listener, address = listening_socket()
        self._listener = listener
        # Rank 0's group store takes over (and closes) a duplicate; this one is closed by `close`.
        self.seat = TPSeat(0, role.tp_size, address, listen_fd=os.dup(listener.fileno()))
        payload = msgspec.json.encode(role).decode()
        env = {**thread_environment(os.environ), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        with contextlib.ExitStack() as undo:
            undo.callback(self.close)
            for rank in range(1, role.tp_size):
                argv = [sys.executable, "-m", "engine.compute.tp.local", "--rank", str(rank), "--address", address,
                        "--parent-pid", str(os.getpid()), "--role", payload]
                self.procs.append(subprocess.Popen(argv, env=env))
            undo.pop_all()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        self._listener.close()
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_S)

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    from engine.spec.kinds import default_kinds  # the kinds' runners import torch

    parser = argparse.ArgumentParser(prog="python -m engine.compute.tp.local",
                                     description="A follower rank started by LocalRanks (not by hand).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--role", required=True, help="the RoleSpec, msgspec JSON")
    args = parser.parse_args(argv)
    role = msgspec.json.decode(args.role, type=RoleSpec)
    _, follow = default_kinds().role_kind(role.kind).load_tp_runner()
    seat = TPSeat(args.rank, role.tp_size, args.address)
    return int(follow(role, seat, ready=lambda details: None, parent_pid=args.parent_pid))


if __name__ == "__main__":
    sys.exit(main())
