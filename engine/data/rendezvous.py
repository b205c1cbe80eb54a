"""Listening sockets made by one process for another to serve on.

A port picked free and bound again later may be taken in between (by any process that binds
or connects in the meantime). A socket bound and listening here, whose file descriptor the
serving process inherits, holds its port from the start: a tensor-parallel replica's rank 0
serves its rendezvous store on it (`TPGroup.init(listen_fd=...)`), while the other ranks,
given its address, may connect before rank 0 is up (the kernel queues them in the backlog).
"""

from __future__ import annotations

import contextlib
import socket


def listening_socket(host: str = "127.0.0.1", *, port: int = 0, backlog: int = 128) -> tuple[socket.socket, str]:
    """A TCP socket bound to `port` of `host` (0: a free one) and listening, and its address
    `tcp://HOST:PORT`. Hand it on with `pass_fds`, or as SCM_RIGHTS to a fork server; the caller
    closes its copy once the serving process has one."""
    with contextlib.ExitStack() as undo:
        sock = undo.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        sock.bind((host, port))
        sock.listen(backlog)
        undo.pop_all()
    return sock, f"tcp://{host}:{sock.getsockname()[1]}"
