"""Ending the processes tests start."""

from __future__ import annotations

import signal
import subprocess


def stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM `proc` (if it still runs) and reap it; SIGKILL when it outlives `grace_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
