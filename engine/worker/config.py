"""What one role worker process is told at its start (`WorkerConfig`, built from the command line
by `engine.worker.options`), and how it names its endpoints (`host_of_endpoint`, `bound_endpoint`)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import zmq

from engine.data.codec import MiB
from engine.data.curve import PlaneKeys
from engine.spec.graph import RoleSpec

__all__ = ["DEFAULT_LISTEN", "WorkerConfig", "bound_endpoint", "host_of_endpoint"]

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


def bound_endpoint(sock: zmq.Socket, host: str) -> str:
    """The endpoint `sock`, bound to any port (port 0), listens at, as `host` names its interface."""
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"
