"""docker-compose.yml and the Dockerfile, checked for structure (docker cannot run here):
the services the distributed mode needs, wired to the same Redis and PostgreSQL, nodes
consuming their own queue, GPU reservations for model roles, and the studio settings
each process reads parsed by the studio's own configuration loader."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from studio.config import Dispatch, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _queues(command: list[str]) -> list[str]:
    return command[command.index("-Q") + 1].split(",")


def _gpu(service: dict[str, Any]) -> bool:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any("gpu" in d.get("capabilities", []) for d in devices)


def test_services_and_their_wiring(compose: dict[str, Any], tmp_path: Path) -> None:
    services = compose["services"]
    assert {"redis", "postgres", "web", "celery", "gpu-node", "cpu-node"} <= set(services)
    studio = [name for name, s in services.items() if s.get("build") == "."]
    assert set(studio) == {"web", "celery", "gpu-node", "cpu-node", "llm-worker"}
    for name in studio:
        service = services[name]
        env = service["environment"]
        assert env["REDIS_URL"] == "redis://redis:6379/0" and env["DATABASE_URL"].startswith("postgres://")
        assert "@postgres:5432/" in env["DATABASE_URL"]
        assert service["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                         "redis": {"condition": "service_healthy"}}
        config = load_config({**env, "OMNIFLOW_DATA_DIR": str(tmp_path)})  # every value parses
        assert config.distributed and config.dispatch is Dispatch.CELERY
    for infra in ("redis", "postgres"):
        assert "healthcheck" in services[infra]
    assert services["web"]["ports"] == ["8000:8000"] and "daphne" in " ".join(services["web"]["command"])
    assert _queues(services["celery"]["command"]) == [load_config(
        {**services["celery"]["environment"], "OMNIFLOW_DATA_DIR": str(tmp_path)}).run_queue]

    nodes = {name: s for name, s in services.items() if "OMNIFLOW_NODE" in s.get("environment", {})}
    assert set(nodes) == {"gpu-node", "cpu-node"}
    for name, node in nodes.items():
        env = node["environment"]
        assert node["command"][:4] == ["celery", "-A", "studio", "worker"] and "solo" in node["command"]
        assert _queues(node["command"]) == [f"node.{env['OMNIFLOW_NODE']}"]
        assert env["OMNIFLOW_WORKER_LISTEN"] == "tcp://0.0.0.0:0" and node["hostname"] == name
        assert re.match(r"^\d+[gm]b$", node["shm_size"])
    assert services["web"]["environment"]["OMNIFLOW_DEPLOY_NODE"] in {n["environment"]["OMNIFLOW_NODE"]
                                                                      for n in nodes.values()}
    assert _gpu(services["gpu-node"]) and not _gpu(services["cpu-node"]) and _gpu(services["llm-worker"])
    joiner = services["llm-worker"]
    assert joiner["profiles"] == ["join"]
    command = joiner["command"]
    assert command[:2] == ["omniflow", "worker"] and command[command.index("--registry") + 1] == "redis://redis:6379/0"
    assert (ROOT / command[command.index("--workflow") + 1]).is_file()
    assert set(compose["volumes"]) == {"omniflow-data", "postgres-data"}


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert stages[-1] == "python:3.11-slim"
    assert "pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "COPY --from=frontend /src/frontend/dist frontend/dist" in text
    for path in ("engine/", "studio/", "workflows/", "manage.py", "pyproject.toml"):
        assert path in text
