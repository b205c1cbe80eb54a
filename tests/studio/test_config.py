"""Environment parsing: embedded defaults, distributed settings, and refusal of bad values."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from studio.config import Dispatch, load_config, parse_database_url


def env(tmp_path: Path, **values: str) -> dict[str, str]:
    return {"OMNIFLOW_DATA_DIR": str(tmp_path), **values}


def test_embedded_defaults(tmp_path: Path) -> None:
    config = load_config(env(tmp_path))
    assert config.database["ENGINE"] == "django.db.backends.sqlite3"
    assert config.database["NAME"] == str(tmp_path / "studio.sqlite3")
    assert config.redis_url is None and not config.distributed
    assert config.dispatch is Dispatch.LOCAL
    assert config.max_upload_bytes == 20 * 1024 * 1024
    assert config.allow_module_ops is False
    assert (config.worker_restart, config.worker_max_restarts, config.worker_restart_backoff_s,
            config.node_supervise_s) == (True, 5, 0.5, 5.0)
    # the generated secret key is kept, so sessions survive a restart
    assert load_config(env(tmp_path)).secret_key == config.secret_key
    assert (tmp_path / "secret_key").stat().st_mode & 0o777 == 0o600


def test_distributed(tmp_path: Path) -> None:
    config = load_config(env(tmp_path, DATABASE_URL="postgres://u:p%40ss@db.example:6543/omni?sslmode=require",
                             REDIS_URL="redis://cache:6379/1", OMNIFLOW_DISPATCH="celery",
                             OMNIFLOW_MAX_UPLOAD_BYTES="1_048_576", OMNIFLOW_RUN_TIMEOUT_S="30"))
    assert config.database == {
        "ENGINE": "django.db.backends.postgresql", "NAME": "omni", "USER": "u", "PASSWORD": "p@ss",
        "HOST": "db.example", "PORT": "6543", "CONN_MAX_AGE": 0,
        "OPTIONS": {"sslmode": "require", "pool": {"min_size": 1, "max_size": 16, "timeout": 10}},
    }
    unpooled = load_config(env(tmp_path, DATABASE_URL="postgres://u@db/omni", OMNIFLOW_DB_POOL="0"))
    assert unpooled.database["OPTIONS"] == {}
    assert config.distributed and config.dispatch is Dispatch.CELERY
    assert config.max_upload_bytes == 1_048_576 and config.run_timeout_s == 30.0


def test_sqlite_urls() -> None:
    assert parse_database_url("sqlite:////var/db/x.sqlite3")["NAME"] == "/var/db/x.sqlite3"
    assert parse_database_url("sqlite:///rel.sqlite3")["NAME"] == "rel.sqlite3"


@pytest.mark.parametrize(("name", "value", "message"), [
    ("OMNIFLOW_DEBUG", "maybe", "not a boolean"),
    ("OMNIFLOW_MAX_UPLOAD_BYTES", "lots", "not an integer"),
    ("OMNIFLOW_MAX_UPLOAD_BYTES", "10", "at least 1024"),
    ("OMNIFLOW_DB_POOL", "many", "not an integer"),
    ("OMNIFLOW_RUN_TIMEOUT_S", "-1", "positive"),
    ("OMNIFLOW_DISPATCH", "ray", "expected one of local, celery"),
    ("OMNIFLOW_DISPATCH", "celery", "needs REDIS_URL"),
    ("DATABASE_URL", "mysql://x/y", "unsupported scheme"),
    ("DATABASE_URL", "postgres://host:5432/", "names no database"),
    ("DATABASE_URL", "postgres://host:port/db", "invalid port"),
    ("REDIS_URL", "http://cache", "expected redis://"),
    ("OMNIFLOW_SECRET_KEY", "short", "at least 32"),
    ("OMNIFLOW_LOG_LEVEL", "LOUD", "not a logging level"),
    ("OMNIFLOW_WORKER_RESTART", "sometimes", "not a boolean"),
    ("OMNIFLOW_WORKER_MAX_RESTARTS", "-1", "at least 0"),
    ("OMNIFLOW_WORKER_RESTART_BACKOFF_S", "0", "positive"),
    ("OMNIFLOW_NODE_SUPERVISE_S", "soon", "not a number"),
    ("OMNIFLOW_METRICS_HISTORY_S", "60", "at least 300"),
    ("OMNIFLOW_METRICS_HISTORY_S", "an hour", "not a number"),
])
def test_bad_values_raise(tmp_path: Path, name: str, value: str, message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message) as info:
        load_config(env(tmp_path, **{name: value}))
    assert name in str(info.value) or name == "OMNIFLOW_DISPATCH"


def test_run_leases_and_the_metrics_token(tmp_path: Path) -> None:
    config = load_config(env(tmp_path))
    assert (config.run_lease_s, config.run_lease_retries, config.metrics_token) == (30.0, 1, None)
    assert config.metrics_history_s == 3600.0
    config = load_config(env(tmp_path, OMNIFLOW_RUN_LEASE_S="1.5", OMNIFLOW_RUN_LEASE_RETRIES="0",
                             OMNIFLOW_METRICS_TOKEN="t" * 32, OMNIFLOW_METRICS_HISTORY_S="7200"))
    assert (config.run_lease_s, config.run_lease_retries, config.metrics_token) == (1.5, 0, "t" * 32)
    assert config.metrics_history_s == 7200.0
    for name, value in (("OMNIFLOW_RUN_LEASE_S", "0"), ("OMNIFLOW_RUN_LEASE_S", "soon"),
                        ("OMNIFLOW_RUN_LEASE_RETRIES", "-1"), ("OMNIFLOW_METRICS_TOKEN", "short")):
        with pytest.raises(ImproperlyConfigured, match=name):
            load_config(env(tmp_path, **{name: value}))


def test_module_ops_setting(tmp_path: Path) -> None:
    assert load_config(env(tmp_path, OMNIFLOW_ALLOW_MODULE_OPS="1")).allow_module_ops is True
    with pytest.raises(ImproperlyConfigured, match="OMNIFLOW_ALLOW_MODULE_OPS"):
        load_config(env(tmp_path, OMNIFLOW_ALLOW_MODULE_OPS="sometimes"))
    # The old allow-list of module prefixes is gone: a studio still setting it is told what replaced it.
    with pytest.raises(ImproperlyConfigured, match="OMNIFLOW_PYTHON_OP_MODULES is gone.*OMNIFLOW_ALLOW_MODULE_OPS=1"):
        load_config(env(tmp_path, OMNIFLOW_PYTHON_OP_MODULES="workflows"))


def test_plane_bulk_setting(tmp_path: Path) -> None:
    from engine.data.curve import BulkMode

    assert load_config(env(tmp_path)).plane_bulk is BulkMode.CLEAR
    assert load_config(env(tmp_path, OMNIFLOW_PLANE_BULK="Encrypted")).plane_bulk is BulkMode.ENCRYPTED
    assert load_config(env(tmp_path, OMNIFLOW_PLANE_BULK="mac")).plane_bulk is BulkMode.MAC
    with pytest.raises(ImproperlyConfigured, match="OMNIFLOW_PLANE_BULK='plain': expected one of clear, mac, encrypted"):
        load_config(env(tmp_path, OMNIFLOW_PLANE_BULK="plain"))


def test_quotas_throttles_and_roots(tmp_path: Path) -> None:
    defaults = load_config(env(tmp_path))
    assert (defaults.quotas.concurrent_runs, defaults.quotas.worker_processes, defaults.quotas.run_timeout_s) == (
        16, 16, 3600.0)
    assert defaults.throttles.run == "600/minute" and defaults.model_dirs == ()
    assert defaults.users_root == tmp_path / "users" and defaults.max_json_depth == 64
    assert (defaults.quotas.hicache_host_bytes, defaults.quotas.hicache_disk_bytes) == (16 * 2**30, 64 * 2**30)
    config = load_config(env(tmp_path, OMNIFLOW_QUOTA_WORKER_PROCESSES="2", OMNIFLOW_QUOTA_MAX_NEW_TOKENS="64",
                             OMNIFLOW_THROTTLE_LOGIN="off", OMNIFLOW_THROTTLE_RUN="5/second",
                             OMNIFLOW_MODEL_DIRS=f"{tmp_path}/a, {tmp_path}/b", OMNIFLOW_MAX_JSON_DEPTH="16",
                             OMNIFLOW_QUOTA_HICACHE_HOST_BYTES="1_000", OMNIFLOW_QUOTA_HICACHE_DISK_BYTES="0"))
    assert (config.quotas.worker_processes, config.quotas.max_new_tokens) == (2, 64)
    assert (config.quotas.hicache_host_bytes, config.quotas.hicache_disk_bytes) == (1000, 0)
    assert (config.throttles.login, config.throttles.run) == (None, "5/second")
    assert config.model_dirs == (tmp_path / "a", tmp_path / "b") and config.max_json_depth == 16


@pytest.mark.parametrize(("name", "value", "message"), [
    ("OMNIFLOW_QUOTA_CONCURRENT_RUNS", "0", "at least 1"),
    ("OMNIFLOW_QUOTA_DEVICE_PAGES", "many", "not an integer"),
    ("OMNIFLOW_QUOTA_RUN_TIMEOUT_S", "0", "positive"),
    ("OMNIFLOW_QUOTA_HICACHE_HOST_BYTES", "-1", "at least 0"),
    ("OMNIFLOW_QUOTA_HICACHE_DISK_BYTES", "64GiB", "not an integer"),
    ("OMNIFLOW_THROTTLE_RUN", "5 per minute", "not a rate"),
    ("OMNIFLOW_MAX_JSON_DEPTH", "2", "at least 8"),
])
def test_bad_quota_and_limit_values_are_refused(tmp_path: Path, name: str, value: str, message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message) as refused:
        load_config(env(tmp_path, **{name: value}))
    assert name in str(refused.value)


def test_node_settings(tmp_path: Path) -> None:
    defaults = load_config(env(tmp_path, OMNIFLOW_NODE="n1"))
    assert defaults.deploy_node is None  # placed by resources unless pinned
    node = defaults.node
    assert (node.labels, node.gpus, node.cpus, node.memory_gb, node.ttl_s, node.host_id) == ({}, None, None, None,
                                                                                             10.0, None)
    assert node.worker_host_id("n1") == "node:n1"
    config = load_config(env(tmp_path, OMNIFLOW_NODE_LABELS="zone=a, kind=gpu", OMNIFLOW_NODE_GPUS="2",
                             OMNIFLOW_NODE_GPU_MODEL="H200", OMNIFLOW_NODE_GPU_MEMORY_GB="141",
                             OMNIFLOW_NODE_CPUS="1.5", OMNIFLOW_NODE_MEMORY_GB="64", OMNIFLOW_NODE_TTL_S="4",
                             OMNIFLOW_HOST_ID="rack1/m7", OMNIFLOW_DEPLOY_NODE="n2"))
    node = config.node
    assert node.labels == {"zone": "a", "kind": "gpu"} and (node.gpus, node.gpu_model, node.gpu_memory_gb) == (
        2, "H200", 141.0)
    assert (node.cpus, node.memory_gb, node.ttl_s, node.worker_host_id("x")) == (1.5, 64.0, 4.0, "rack1/m7")
    assert config.deploy_node == "n2" and config.nodes_namespace == "omniflow-nodes"


@pytest.mark.parametrize(("name", "value", "message"), [
    ("OMNIFLOW_NODE_LABELS", "zone", "expected NAME=VALUE"),
    ("OMNIFLOW_NODE_LABELS", "zone=a,zone=b", "given twice"),
    ("OMNIFLOW_NODE_GPUS", "-1", "at least 0"),
    ("OMNIFLOW_NODE_CPUS", "lots", "not a number"),
    ("OMNIFLOW_NODE_MEMORY_GB", "-2", "at least 0"),
    ("OMNIFLOW_NODE_TTL_S", "0", "positive"),
    ("OMNIFLOW_HOST_ID", "has space", "no spaces"),
    ("OMNIFLOW_DEPLOY_NODE", "bad name!", "a node name"),
])
def test_bad_node_settings_are_refused(tmp_path: Path, name: str, value: str, message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message) as refused:
        load_config(env(tmp_path, **{name: value}))
    assert name in str(refused.value)
