"""docker-compose.yml and the Dockerfile, checked for structure (docker cannot run here):
the services the distributed mode needs, wired to the same Redis and PostgreSQL, nodes
consuming their own queue, GPU reservations for model roles, and the studio settings
each process reads parsed by the studio's own configuration loader. The file is read as
`docker compose` reads it: `${VAR:?…}` refuses to start without VAR (from `.env`),
`${VAR:-default}` falls back, `$$` is a literal `$`."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from studio.config import Dispatch, load_config

ROOT = Path(__file__).resolve().parents[2]


SECRETS = {"POSTGRES_USER": "omni", "POSTGRES_PASSWORD": "pg0secret", "POSTGRES_DB": "omnidb",
           "REDIS_PASSWORD": "redis0secret", "OMNIFLOW_SECRET_KEY": "k" * 40}
"""What an operator's `.env` holds."""

_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:\?|:-)(?P<arg>[^}]*))?\})")


class MissingVariable(KeyError):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution over a parsed document."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        name = match["name"]
        if name is None:
            return "$"
        if env.get(name):
            return env[name]
        if match["op"] == ":?":
            raise MissingVariable(f"{name}: {match['arg']}")
        return match["arg"] or ""

    return _VARIABLE.sub(one, value)


def raw() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(raw(), SECRETS)


def _argv(command: list[str]) -> list[str]:
    """The program's arguments, also when it runs through `sh -c "VAR=... exec program ..."`."""
    if command[:2] != ["sh", "-c"]:
        return command
    return shlex.split(command[2].split("exec ", 1)[1])


def _queues(command: list[str]) -> list[str]:
    argv = _argv(command)
    return argv[argv.index("-Q") + 1].split(",")


def _gpu(service: dict[str, Any]) -> bool:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any("gpu" in d.get("capabilities", []) for d in devices)


def test_services_and_their_wiring(compose: dict[str, Any], tmp_path: Path) -> None:
    services = compose["services"]
    assert {"redis", "postgres", "web", "celery", "gpu-node", "node"} <= set(services)
    studio = [name for name, s in services.items() if s.get("build") == "."]
    assert set(studio) == {"web", "celery", "gpu-node", "node", "llm-worker"}
    for name in studio:
        service = services[name]
        env = service["environment"]
        assert env["REDIS_URL"] == "redis://:redis0secret@redis:6379/0"
        assert env["DATABASE_URL"] == "postgres://omni:pg0secret@postgres:5432/omnidb"
        assert env["OMNIFLOW_SECRET_KEY"] == SECRETS["OMNIFLOW_SECRET_KEY"]
        assert service["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                         "redis": {"condition": "service_healthy"}}
        config = load_config({**env, "OMNIFLOW_DATA_DIR": str(tmp_path)})  # every value parses
        assert config.distributed and config.dispatch is Dispatch.CELERY and config.metrics_token is None
        assert config.database["USER"] == "omni" and config.database["PASSWORD"] == "pg0secret"
    for infra in ("redis", "postgres"):
        assert "healthcheck" in services[infra]
    assert services["web"]["ports"] == ["8000:8000"] and "daphne" in " ".join(services["web"]["command"])
    assert _queues(services["celery"]["command"]) == [load_config(
        {**services["celery"]["environment"], "OMNIFLOW_DATA_DIR": str(tmp_path)}).run_queue]

    nodes = {name: s for name, s in services.items() if "OMNIFLOW_NODE_LABELS" in s.get("environment", {})}
    assert set(nodes) == {"gpu-node", "node"}
    for name, node in nodes.items():
        env = node["environment"]
        argv = _argv(node["command"])
        assert argv[:4] == ["celery", "-A", "studio", "worker"] and "solo" in argv
        config = load_config({**env, "OMNIFLOW_DATA_DIR": str(tmp_path)})
        assert config.node.labels["kind"] == ("gpu" if name == "gpu-node" else "cpu")
        assert "OMNIFLOW_WORKER_LISTEN" not in env
        assert _listens_on_the_compose_network(node["command"])
        assert re.match(r"^\d+[gm]b$", node["shm_size"])
    # the GPU node is one, named; `node` scales: each replica is named by its container's hostname
    assert _queues(nodes["gpu-node"]["command"]) == ["node.gpu-node"] == [
        f"node.{nodes['gpu-node']['environment']['OMNIFLOW_NODE']}"]
    assert nodes["gpu-node"]["hostname"] == "gpu-node"
    assert "hostname" not in nodes["node"] and "container_name" not in nodes["node"]
    assert "OMNIFLOW_NODE" not in nodes["node"]["environment"]  # the node's name is its hostname
    assert _queues(nodes["node"]["command"]) == ["node.$(hostname)"]
    assert "OMNIFLOW_DEPLOY_NODE" not in services["web"]["environment"]  # placed by resources
    assert _gpu(services["gpu-node"]) and not _gpu(services["node"]) and _gpu(services["llm-worker"])
    joiner = services["llm-worker"]
    assert joiner["profiles"] == ["join"]
    command = _argv(joiner["command"])
    assert command[:2] == ["omniflow", "worker"] and command[command.index("--registry") + 1] == "$REDIS_URL"
    assert joiner["environment"]["REDIS_URL"].startswith("redis://:redis0secret@")
    assert (ROOT / command[command.index("--workflow") + 1]).is_file()
    assert _listens_on_the_compose_network(joiner["command"])
    assert "--keys /keys" in " ".join(command) and any(v.endswith(":/keys:ro") for v in joiner["volumes"])
    # registered ops only, as the studio's own workers (this compose file leaves OMNIFLOW_ALLOW_MODULE_OPS unset)
    assert command[-1] == "--no-module-ops" and "OMNIFLOW_ALLOW_MODULE_OPS" not in joiner["environment"]
    assert set(compose["volumes"]) == {"omniflow-data", "postgres-data", "redis-data"}


def _listens_on_the_compose_network(command: list[str]) -> bool:
    """Role workers bind the container's own address (`hostname -i`), never every interface."""
    text = command[2] if command[:2] == ["sh", "-c"] else " ".join(command)
    return "0.0.0.0" not in text and "tcp://$(hostname -i | cut -d' ' -f1):0" in text


def test_only_the_studio_is_published_and_redis_needs_a_password(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {name for name, s in services.items() if "ports" in s} == {"web"}
    assert not any(s.get("network_mode") == "host" for s in services.values())
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--requirepass") + 1] == "redis0secret"
    assert command[command.index("--appendonly") + 1] == "yes"
    assert redis["volumes"] == ["redis-data:/data"]
    assert "$REDIS_PASSWORD" in redis["healthcheck"]["test"][1]  # the health check authenticates too
    postgres = services["postgres"]["environment"]
    assert (postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"], postgres["POSTGRES_DB"]) == (
        "omni", "pg0secret", "omnidb")


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_the_stack_refuses_to_start_without_each_secret(missing: str) -> None:
    env = {k: v for k, v in SECRETS.items() if k != missing}
    with pytest.raises(MissingVariable, match=f"^'{missing}: set it in .env \\(see README\\)'$"):
        interpolate(raw(), env)


def test_env_example_names_every_secret_and_env_is_ignored() -> None:
    example = (ROOT / ".env.example").read_text()
    names = set(re.findall(r"^#? ?([A-Z_]+)=", example, re.M))
    assert set(SECRETS) | {"OMNIFLOW_METRICS_TOKEN"} <= names
    assert not re.search(r"^(POSTGRES_PASSWORD|REDIS_PASSWORD|OMNIFLOW_SECRET_KEY)=\S", example, re.M)
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert not (ROOT / ".env").exists() or ".env" in (ROOT / ".gitignore").read_text().split()


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert stages[-1] == "python:3.11-slim"
    assert "pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "COPY --from=frontend /src/frontend/dist frontend/dist" in text
    for path in ("engine/", "studio/", "workflows/", "manage.py", "pyproject.toml"):
        assert path in text


def _load(name: str, env: dict[str, str]) -> dict[str, Any]:
    return interpolate(yaml.safe_load((ROOT / name).read_text()), env)


NODE_ENV = {**SECRETS, "OMNIFLOW_NODE": "gpu-b"}
"""A joining machine's `.env`: the first machine's secrets and this node's name."""


def test_the_span_override_puts_the_stack_on_an_external_overlay_and_publishes_nothing_more(
        compose: dict[str, Any]) -> None:
    span = _load("docker-compose.span.yml", SECRETS)
    assert set(span) == {"networks"}  # the network only: services, ports and URLs stay as they are
    assert span["networks"]["default"] == {"name": "omniflow-span", "external": True}
    assert "networks" not in compose  # so the override's default network is the one every service joins
    text = (ROOT / "docker-compose.span.yml").read_text()
    assert "--driver overlay --attachable --opt encrypted omniflow-span" in text


def test_a_node_on_another_machine_joins_the_same_redis_postgres_and_network(
        compose: dict[str, Any], tmp_path: Path) -> None:
    node_file = _load("docker-compose.node.yml", NODE_ENV)
    services = node_file["services"]
    assert set(services) == {"node", "gpu-node"}
    first = compose["services"]["node"]["environment"]
    for name, service in services.items():
        env = service["environment"]
        for key in ("REDIS_URL", "DATABASE_URL", "OMNIFLOW_SECRET_KEY", "OMNIFLOW_DISPATCH", "OMNIFLOW_PLANE_BULK"):
            assert env[key] == first[key], key  # the first machine's services, by their compose names
        config = load_config({**env, "OMNIFLOW_DATA_DIR": str(tmp_path)})
        assert config.distributed and config.node_name == "gpu-b" == service["hostname"]
        assert config.node.labels == {"kind": "gpu" if name == "gpu-node" else "cpu"}
        assert _queues(service["command"]) == ["node.$OMNIFLOW_NODE"]  # sh expands it: node.gpu-b
        assert _listens_on_the_compose_network(service["command"])
        assert "ports" not in service and "network_mode" not in service
        assert _gpu(service) == (name == "gpu-node")
    assert services["gpu-node"]["profiles"] == ["gpu"] and "profiles" not in services["node"]
    span = _load("docker-compose.span.yml", SECRETS)
    assert node_file["networks"] == span["networks"]  # the overlay the first machine's stack is on


def test_a_joining_node_refuses_to_start_without_its_name_or_a_secret() -> None:
    with pytest.raises(MissingVariable, match="^.OMNIFLOW_NODE: name this machine's node \\(unique"):
        _load("docker-compose.node.yml", SECRETS)
    for missing in sorted(SECRETS):
        with pytest.raises(MissingVariable, match=f"^'{missing}: set it in .env"):
            _load("docker-compose.node.yml", {k: v for k, v in NODE_ENV.items() if k != missing})
