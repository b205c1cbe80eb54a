"""A live studio for the browser tests: daphne in a subprocess on a free port, with its
own data directory (SQLite, files), the demo user and workflows (not its chat deployment: the
browser tests deploy what they use), the test run's model cache (the examples run the real
model `smollm2-135m`), `tests.e2e.fns` among the modules python nodes may name, and a model
directory holding one checkpoint folder (`org/tiny-ckpt`, a config only: what the editor's model
picker lists)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.compute.models.cache import ModelCache
from tests.liveserver import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]
USER = "demo"
PASSWORD = "e2e-demo-password"
METRICS_TOKEN = "e2e-metrics-token-0123456789abcdef"

# The studio under test is embedded and private: none of the suite's shared services.
_DROPPED = ("DATABASE_URL", "REDIS_URL", "OMNIFLOW_DISPATCH", "OMNIFLOW_SECRET_KEY", "OMNIFLOW_DATA_DIR")


@dataclass(frozen=True, slots=True)
class LiveStudio:
    url: str
    user: str
    password: str
    log: Path
    env: dict[str, str] = field(repr=False)  # the environment the studio runs in (its commands take it too)

    @property
    def data_dir(self) -> Path:
        return self.log.parent


CHECKPOINT = "org/tiny-ckpt"


def studio_env(data_dir: Path, model_cache: ModelCache) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
    models = data_dir / "models"
    (models / CHECKPOINT).mkdir(parents=True, exist_ok=True)
    (models / CHECKPOINT / "config.json").write_text('{"model_type": "llama"}')
    env.update(
        DJANGO_SETTINGS_MODULE="studio.settings",
        OMNIFLOW_DATA_DIR=str(data_dir),
        OMNIFLOW_MODEL_DIRS=str(models),
        OMNIFLOW_CACHE_DIR=str(model_cache.config.root),
        OMNIFLOW_ALLOW_MODULE_OPS="1",
        OMNIFLOW_METRICS_INTERVAL_S="0.25",  # the cluster page's readings follow the workers closely
        OMNIFLOW_METRICS_TOKEN=METRICS_TOKEN,  # what Prometheus would send to /metrics
        OMNIFLOW_MAX_RUNS="2",  # two runs at a time: the runs list's queue is seen in the browser
        PYTHONPATH=str(ROOT),
    )
    return env


def prepare_studio(env: dict[str, str]) -> None:
    """Migrate the studio's database and make the demo user with the example workflows."""
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=120)
    subprocess.run([*manage, "setup_demo", "--username", USER, "--password", PASSWORD, "--no-chat"], cwd=ROOT, env=env,
                   check=True, timeout=120, stdout=subprocess.DEVNULL)


@contextmanager
def serving(data_dir: Path, env: dict[str, str]) -> Iterator[LiveStudio]:
    """A prepared studio (`prepare_studio`) served by daphne on a free port until the block ends."""
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
            yield LiveStudio(f"http://127.0.0.1:{port}", USER, PASSWORD, log_path, env)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="session")
def live_studio(tmp_path_factory: pytest.TempPathFactory, smollm2_cache: ModelCache) -> Iterator[LiveStudio]:
    data_dir = tmp_path_factory.mktemp("studio-data")
    env = studio_env(data_dir, smollm2_cache)
    prepare_studio(env)
    with serving(data_dir, env) as studio:
        yield studio
