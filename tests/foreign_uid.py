"""A process of another user on a local stream, for the tests of what the plane refuses it.

`call_as(uid, address, payload)` forks a child that takes `uid` (the tests run as root),
connects to the abstract Unix socket `address`, sends `payload` as one framed message and
reports what came back: the first answer's bytes, or that the connection was closed (or
reset) unanswered, or that nothing came within the timeout. Call it off the event loop
(`asyncio.to_thread`) when the listener runs in this process.
"""

from __future__ import annotations

import enum
import os
import socket
import struct
from dataclasses import dataclass

NOBODY = 65534
_HEADER = struct.Struct("<I")


class Outcome(enum.Enum):
    ANSWERED = "answered"
    CLOSED = "closed"
    SILENT = "silent"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True, slots=True)
class Reply:
    outcome: Outcome
    data: bytes = b""


def call_as(uid: int, address: str, payload: bytes, timeout_s: float = 2.0) -> Reply:
    assert address.startswith("unix:@"), address
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, whatever happens
        code = 1
        try:
            os.close(read_end)
            os.setgid(uid)
            os.setuid(uid)
            os.write(write_end, _ask("\0" + address.removeprefix("unix:@"), payload, timeout_s))
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        report = reader.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and report, f"the uid {uid} child failed (status {status})"
    outcome, _, data = report.partition(b"\n")
    return Reply(Outcome(outcome.decode()), data)


def _ask(name: str, payload: bytes, timeout_s: float) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(name)
        except OSError:
            return b"unreachable\n"
        try:
            sock.sendall(_HEADER.pack(len(payload)) + payload)
            data = sock.recv(1 << 16)
        except TimeoutError:
            return b"silent\n"
        except OSError:  # reset by the listener
            return b"closed\n"
        return b"answered\n" + data if data else b"closed\n"
