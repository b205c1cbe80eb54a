"""A helper process the GPU tests drive line by line: commands on its stdin, one answer line
each on its stdout, read with a deadline (a child that hangs fails the test, never stalls it)."""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Child:
    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def line(self, timeout: float = 120.0) -> str:
        # One answer per request: nothing is left in the pipe's buffer, so select sees each line.
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        assert ready, f"no answer from {self.process.args} in {timeout}s"
        line = self.process.stdout.readline()
        assert line, f"{self.process.args} exited with status {self.process.wait()}"
        return line

    def ask(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.line().strip()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
