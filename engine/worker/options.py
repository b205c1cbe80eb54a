"""Command-line options of a role worker, shared by `omniflow worker` and `python -m engine.worker`."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import uuid
from pathlib import Path

from engine.data.curve import PlaneKeyError, PlaneKeys
from engine.flow.loader import load_workflow
from engine.worker.announce import report_start_failure
from engine.worker.config import DEFAULT_LISTEN, WorkerConfig
from engine.worker.process import run_role_worker


class WorkerOptionError(ValueError):
    pass


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", required=True, help="the role to host")
    parser.add_argument("--workflow", required=True,
                        help="the workflow (.py DSL module or .json GraphSpec) that declares the role")
    parser.add_argument("--registry", default=None,
                        help="registry URL (redis://HOST:PORT/DB) to register and heartbeat in")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help="control endpoint (port 0: any free port)")
    parser.add_argument("--worker-id", default=None, help="default: ROLE-HOST-PID-RANDOM")
    parser.add_argument("--namespace", default="omniflow", help="registry key namespace")
    parser.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats")
    parser.add_argument("--registry-ttl", type=float, default=2.0,
                        help="seconds without heartbeat after which the registry forgets the worker")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish work on SIGTERM")
    parser.add_argument("--capacity", type=int, default=None, help="node executions run at once")
    parser.add_argument("--stall-timeout", type=float, default=60.0,
                        help="seconds the worker's event loop may go without turning (a deadlock, node code"
                             " blocking it) before the worker dumps its threads' stacks and exits with status 5,"
                             " to be replaced; 0: never")
    parser.add_argument("--tp-rank", type=int, default=0,
                        help="a role with tp_size N > 1: this process's rank (0: the endpoint, 1..N-1 follow it)")
    parser.add_argument("--tp-address", default=None,
                        help="a role with tp_size > 1: tcp://HOST:PORT where the replica's ranks meet (rank 0 hosts it)")
    parser.add_argument("--tp-listen-fd", type=int, default=None,
                        help="rank 0: an inherited socket already listening at --tp-address (default: bind it)")
    parser.add_argument("--module-ops", action=argparse.BooleanOptionalAction, default=True,
                        help="run python nodes whose op is a `module:function` (code named by the request) besides"
                             " the registered ops (default: yes, your own code; a studio's workers get"
                             " --no-module-ops unless its operator allows them)")
    parser.add_argument("--users-root", default=None, metavar="DIR",
                        help="where this host keeps its users' folders (a studio node's <data dir>/users): the"
                             " output folders a server's run names are resolved there, under the run's owner"
                             " (default: none; a run with an owner then writes no files)")
    parser.add_argument("--host-weights", action=argparse.BooleanOptionalAction, default=True,
                        help="share CPU model weights with the other workers of this host: one copy per host"
                             " (default: yes; --no-host-weights loads a copy per worker, only to measure what"
                             " sharing saves, as `omniflow bench weights` does)")
    parser.add_argument("--keys", default=None, metavar="DIR",
                        help="the worker plane's CURVE keys (a directory only this user can read, made by"
                             " `omniflow keys generate DIR` or by the launcher): required")
    parser.add_argument("--plaintext", action="store_true",
                        help="no CURVE: anyone who reaches the worker's sockets may use them (only to measure"
                             " what CURVE costs, as `omniflow bench hops` does)")


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    spec = load_workflow(args.workflow)
    roles = {r.name: r for r in spec.roles}
    if args.role not in roles:
        raise WorkerOptionError(f"--role {args.role}: workflow {spec.name!r} has roles {sorted(roles) or 'none'}")
    if not args.listen.startswith("tcp://"):
        raise WorkerOptionError(f"--listen {args.listen}: expected tcp://HOST:PORT")
    if args.heartbeat <= 0 or args.registry_ttl <= args.heartbeat:
        raise WorkerOptionError("--registry-ttl must be longer than --heartbeat, and both positive")
    if not args.stall_timeout >= 0:
        raise WorkerOptionError(f"--stall-timeout {args.stall_timeout}: must be 0 (never) or a positive number of seconds")
    role = roles[args.role]
    if role.tp_size > 1:
        if args.tp_address is None or not args.tp_address.startswith("tcp://"):
            raise WorkerOptionError(f"role {args.role!r} has tp_size {role.tp_size}: give --tp-address tcp://HOST:PORT"
                                    " (the same for every rank of the replica)")
        if not 0 <= args.tp_rank < role.tp_size:
            raise WorkerOptionError(f"--tp-rank {args.tp_rank}: role {args.role!r} has ranks 0..{role.tp_size - 1}")
        if args.tp_listen_fd is not None and args.tp_rank != 0:
            raise WorkerOptionError(f"--tp-listen-fd: only rank 0 hosts the rendezvous, not rank {args.tp_rank}")
        if args.tp_listen_fd is not None and not _listening_tcp(args.tp_listen_fd):
            raise WorkerOptionError(f"--tp-listen-fd {args.tp_listen_fd}: not an open, listening TCP socket")
    elif args.tp_rank != 0 or args.tp_address is not None or args.tp_listen_fd is not None:
        raise WorkerOptionError(f"--tp-rank/--tp-address/--tp-listen-fd: role {args.role!r} has tp_size 1")
    keys = plane_keys(args)
    worker_id = args.worker_id or f"{args.role}-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return WorkerConfig(
        role=roles[args.role],
        worker_id=worker_id,
        workflow=spec.name,
        listen=args.listen,
        registry_url=args.registry,
        namespace=args.namespace,
        heartbeat_s=args.heartbeat,
        registry_ttl_s=args.registry_ttl,
        parent_pid=args.parent_pid,
        drain_timeout_s=args.drain_timeout,
        capacity=args.capacity,
        stall_timeout_s=args.stall_timeout,
        tp_rank=args.tp_rank,
        tp_address=args.tp_address,
        tp_listen_fd=args.tp_listen_fd,
        allow_module_ops=args.module_ops,
        host_weights=args.host_weights,
        keys=keys,
        users_root=None if args.users_root is None else Path(args.users_root).resolve(),
    )


def plane_keys(args: argparse.Namespace) -> PlaneKeys | None:
    """The keys `--keys` names, or None with `--plaintext`; neither is an error."""
    if args.plaintext:
        if args.keys is not None:
            raise WorkerOptionError("--keys and --plaintext: choose one")
        return None
    if args.keys is None:
        raise WorkerOptionError("--keys DIR is required: the worker plane's CURVE keys (`omniflow keys generate"
                                " DIR` makes them), or --plaintext to run without authentication")
    try:
        return PlaneKeys.load(args.keys)
    except PlaneKeyError as exc:
        raise WorkerOptionError(f"--keys {args.keys}: {exc}") from None


def _listening_tcp(fd: int) -> bool:
    try:
        copy = os.dup(fd)
    except OSError:
        return False
    try:
        sock = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return False
    with sock:
        return sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6) \
            and bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def run_worker(args: argparse.Namespace) -> int:
    """The worker of parsed options until it stops (its exit status); 1 for options that do not
    make one, said on standard error. Both entry points end here."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s", stream=sys.stderr)
    try:
        config = worker_config(args)
    except WorkerOptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        report_start_failure(str(exc))
        return 1
    return run_role_worker(config)
