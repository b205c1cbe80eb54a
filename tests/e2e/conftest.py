"""A live studio for the browser tests: daphne in a subprocess on a free port, with its
own data directory (SQLite, files), the demo user and workflows, and `tests.e2e.fns`
among the modules python nodes may name."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.liveserver import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]
USER = "demo"
PASSWORD = "e2e-demo-password"

# The studio under test is embedded and private: none of the suite's shared services.
_DROPPED = ("DATABASE_URL", "REDIS_URL", "OMNIFLOW_DISPATCH", "OMNIFLOW_SECRET_KEY", "OMNIFLOW_DATA_DIR")


@dataclass(frozen=True, slots=True)
class LiveStudio:
    url: str
    user: str
    password: str
    log: Path



def studio_env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
    env.update(
        DJANGO_SETTINGS_MODULE="studio.settings",
        OMNIFLOW_DATA_DIR=str(data_dir),
        OMNIFLOW_ALLOW_MODULE_OPS="1",
        OMNIFLOW_METRICS_INTERVAL_S="0.25",  # the cluster page's readings follow the workers closely
        PYTHONPATH=str(ROOT),
    )
    return env




@pytest.fixture(scope="session")
def live_studio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStudio]:
    data_dir = tmp_path_factory.mktemp("studio-data")
    env = studio_env(data_dir)
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=120)
    subprocess.run([*manage, "setup_demo", "--username", USER, "--password", PASSWORD], cwd=ROOT, env=env,
                   check=True, timeout=120, stdout=subprocess.DEVNULL)
    port = free_port()
    log_path = data_dir / "studio.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "studio.asgi:application"],
            # In the data directory: what nodes write relative to the working directory (the example
            # workflows' `omniflow-out/`, on the studio's role workers too) stays out of the checkout.
            cwd=data_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}/healthz")
            yield LiveStudio(f"http://127.0.0.1:{port}", USER, PASSWORD, log_path)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
