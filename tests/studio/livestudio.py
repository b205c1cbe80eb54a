"""One live studio (daphne in a subprocess) shared by the tests of a module that deploy workflows on
real role workers (the `live_studio` fixture), and waiting on it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import psutil
from django.conf import settings

from studio.workflows.models import ACTIVE_DEPLOYMENT_STATUSES, Deployment, Worker
from tests.liveserver import free_port, wait_ready
from tests.studio.test_live_server import METRICS_TOKEN, Server, database_url

ROOT = Path(__file__).resolve().parents[2]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class LiveStudio:
    """One daphne for the tests of this module (starting one imports the studio, torch with it: seconds
    on two cores). A test must leave no deployment active and no role worker alive (they stop theirs);
    one that does has the server stopped with them, and the next test gets a fresh server."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server: Server | None = None
        self.log: BinaryIO | None = None
        self.before: set[Any] = set()  # deployments there before the test (not its to wait for)

    def acquire(self) -> Server:
        self.before = set(Deployment.objects.values_list("id", flat=True))
        if self.server is not None and self.server.proc.poll() is None:
            return self.server
        self.close()
        port = free_port()
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "studio.settings", "DATABASE_URL": database_url(),
               "OMNIFLOW_DATA_DIR": str(settings.OMNIFLOW.data_dir), "PYTHONPATH": str(ROOT),
               "OMNIFLOW_METRICS_INTERVAL_S": "0.2", "HF_HUB_OFFLINE": "1", "OMNIFLOW_METRICS_TOKEN": METRICS_TOKEN}
        self.log = (self.tmp / "server.log").open("ab")
        proc = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                                 "studio.asgi:application"], cwd=ROOT, env=env, stdout=self.log,
                                stderr=subprocess.STDOUT)
        self.server = Server(proc, f"http://127.0.0.1:{port}")
        wait_ready(proc, f"http://127.0.0.1:{port}/healthz")
        return self.server

    @contextlib.contextmanager
    def serving(self) -> Iterator[Server]:
        """The server for one test, left as the test found it: nothing deployed."""
        server = self.acquire()
        yield server
        self.release()

    def release(self) -> None:
        """After a test: wait until its deployments have stopped and their workers are gone (what a
        passing test leaves), else stop the server (its role workers exit with it)."""
        if self.server is None:
            return

        def settled() -> bool:
            made = Deployment.objects.exclude(id__in=self.before)
            if made.filter(status__in=ACTIVE_DEPLOYMENT_STATUSES).exists():
                return False
            pids = Worker.objects.filter(deployment__in=made).exclude(pid=None).values_list("pid", flat=True)
            return all(gone(pid) for pid in pids)

        try:
            poll(self.server, settled, bool, "the test's deployments stopped", 60.0)
        except (TimeoutError, RuntimeError):
            self.close()
            raise

    def close(self) -> None:
        if self.server is not None:
            self.server.proc.terminate()  # its role workers exit with it (they watch their parent)
            try:
                self.server.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.server.proc.kill()
                self.server.proc.wait(timeout=10)
            self.server = None
        if self.log is not None:
            self.log.close()
            self.log = None


def poll(server: Server, read: Callable[[], Any], ready: Callable[[Any], bool], what: str,
         deadline_s: float = 60.0) -> Any:
    """`read()` again until `ready` says so (readiness), and return it; the pause is the server's."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = read()
        if ready(value):
            return value
        try:
            server.proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            continue
        raise RuntimeError("the server exited")
    raise TimeoutError(f"{what}: not within {deadline_s} s")


def wait_running(server: Server, deployment_id: str, token: str) -> dict[str, Any]:
    """The deployment once its workers are up (or it failed)."""
    def read() -> dict[str, Any]:
        status, body = server.request("GET", f"/api/deployments/{deployment_id}/", token=token)
        assert status == 200, body
        return body

    return poll(server, read, lambda body: body["status"] not in ("pending", "starting"),
                f"deployment {deployment_id} starts")
