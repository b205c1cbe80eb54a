"""Helpers for tests that start a live server process: a free port, and readiness."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen[bytes], url: str, deadline_s: float = 60.0) -> None:
    """Poll `url` (a health check) until it answers 200; fail early if the server exits."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        try:  # doubles as the pause between polls
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            continue
        raise RuntimeError(f"the server exited with status {proc.returncode}")
    raise TimeoutError(f"{url} did not become ready in {deadline_s} s")
