"""The studio's configuration: every environment variable is parsed here, once.

`load_config(os.environ)` returns a `StudioConfig`; `studio/settings.py` turns it into
Django settings and nothing else reads the environment. A malformed value raises
`ImproperlyConfigured` naming the variable, never a silent fallback.

Two shapes:

* **embedded** (no `DATABASE_URL`, no `REDIS_URL`): SQLite under the data directory,
  the in-memory channel layer, runs executed in this process.
* **distributed**: `DATABASE_URL` (PostgreSQL) and `REDIS_URL` (channels-redis layer,
  Celery broker, worker registry, KV index). `OMNIFLOW_DISPATCH=celery` hands runs to
  Celery workers instead of the web process, and deployments to the Celery worker of a
  node (queue `node.<OMNIFLOW_NODE>`), which starts that deployment's role workers there.
"""

from __future__ import annotations

import enum
import re
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

from engine.client.keys import BulkMode
from engine.client.models import model_cache_root

if TYPE_CHECKING:  # settings load before the engine: imported where it is used
    from engine.client.workers import RestartPolicy

BASE_DIR = Path(__file__).resolve().parent.parent

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class Dispatch(enum.StrEnum):
    LOCAL = "local"
    """Runs execute on the engine loop of the process that accepted them."""
    CELERY = "celery"
    """Runs are queued as the Celery task `execute_run`; needs REDIS_URL."""


@dataclass(frozen=True, slots=True)
class Quotas:
    """Per-user limits (`OMNIFLOW_QUOTA_*`), checked by `studio.workflows.quotas` where they bite.
    Staff users are exempt: they are the operator's people and may size work past them (the
    engine's own ceilings in the kind catalogue still apply to everyone)."""

    concurrent_runs: int
    """Runs of one user executing at once (checked when a run is submitted)."""
    queued_runs: int
    """Runs of one user waiting to execute (pending) at once."""
    deployments: int
    """Live (not stopped or failed) deployments of one user."""
    worker_processes: int
    """Role worker processes over a user's live deployments: `replicas x tp_size` of every role."""
    device_pages: int
    """`device_pages` one role may ask for (per replica)."""
    host_pages: int
    disk_pages: int
    hicache_host_bytes: int
    """Host memory the hierarchical caches of a user's `sglang_llm` roles may take over their live
    deployments (a run: its own roles): per process Omni-Flow's host tier (`hicache.host_capacity_bytes`)
    and SGLang's host pool (`hicache_ratio` times the device pool that `sglang.max_total_tokens`
    caps: a role without that cap, or whose checkpoint does not say its KV shape, is refused), times
    `replicas x tp_size` (`engine.compute.sglang.sizes`)."""
    hicache_disk_bytes: int
    """Disk their HiCache disk tiers may take (`hicache.disk_capacity_bytes` where a `disk_path` is
    set), counted the same way."""
    max_iterations: int
    """The largest `max_iterations` of a node."""
    max_new_tokens: int
    """The largest `max_new_tokens` of a node (spec, REST run or chat request)."""
    upload_bytes: int
    """Bytes of the files one run submission uploads."""
    run_timeout_s: float
    """The timeout of a user's run that asks for none, and the longest one it may ask for."""
    workflows: int
    """Workflows one user keeps (each holds its versions' specs in the database)."""
    versions: int
    """Versions one workflow keeps."""
    websockets: int
    """WebSockets one user holds open at once in one web process (`studio.workflows.sockets`): the
    default (256) lets a client follow each of its concurrent and queued runs on a socket of its own."""


@dataclass(frozen=True, slots=True)
class Throttles:
    """DRF rates (`N/second|minute|hour|day`) per scope, `OMNIFLOW_THROTTLE_<SCOPE>`; None: unthrottled."""

    login: str | None
    token: str | None
    """Creating API tokens."""
    run: str | None
    """Submitting runs: `POST /api/runs/` and `/v1/chat/completions`."""


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """What a node agent announces about its machine (`OMNIFLOW_NODE_*`): its labels, and the
    operator's overrides of the resources it detects (None: detected). Placement reads these;
    nothing checks that a role uses no more than it asked for."""

    labels: dict[str, str] = field(default_factory=dict)
    """`OMNIFLOW_NODE_LABELS=zone=a,kind=gpu`: matched against roles' `resources.labels`."""
    gpus: int | None = None
    """`OMNIFLOW_NODE_GPUS`: how many GPUs to offer (default: those `nvidia-smi` lists)."""
    gpu_model: str | None = None
    """`OMNIFLOW_NODE_GPU_MODEL`: the model name of GPUs given by `OMNIFLOW_NODE_GPUS`."""
    gpu_memory_gb: float | None = None
    """`OMNIFLOW_NODE_GPU_MEMORY_GB`: the memory of each of them."""
    cpus: float | None = None
    """`OMNIFLOW_NODE_CPUS` (default: the CPUs this process may run on)."""
    memory_gb: float | None = None
    """`OMNIFLOW_NODE_MEMORY_GB` (default: the machine's memory)."""
    address: str | None = None
    """`OMNIFLOW_NODE_ADDRESS`: the address shown for the node (default: `OMNIFLOW_WORKER_LISTEN`'s host)."""
    ttl_s: float = 10.0
    """`OMNIFLOW_NODE_TTL_S`: a node whose agent has not announced it for this long is lost (it
    announces every third of it); its replicas are placed again within two of these."""
    host_id: str | None = None
    """`OMNIFLOW_HOST_ID`: the transfer plane's host identity the node's role workers get
    (default `node:<name>`): workers that share it use shared memory and local streams, any
    other peer TCP (network namespaces on one machine share /dev/shm and the hostname)."""

    def worker_host_id(self, node: str) -> str:
        return self.host_id or f"node:{node}"


@dataclass(frozen=True, slots=True)
class StudioConfig:
    debug: bool
    secret_key: str
    allowed_hosts: tuple[str, ...]
    csrf_trusted_origins: tuple[str, ...]
    data_dir: Path
    database: dict[str, Any]
    """Django's `DATABASES["default"]`."""
    redis_url: str | None
    redis_prefix: str
    dispatch: Dispatch
    max_upload_bytes: int
    max_run_file_bytes: int
    """`OMNIFLOW_MAX_RUN_FILE_BYTES`: the largest file a run wrote in its owner's folder that is stored
    as a run file (larger ones are shown by name and size, and read no further)."""
    run_timeout_s: float | None
    allow_module_ops: bool
    """`OMNIFLOW_ALLOW_MODULE_OPS`: python nodes may name `module:function` ops besides the
    registered ones. It lets every user run any code on the server (and its workers): off by default."""
    log_level: str
    node_name: str
    """This process's node: its Celery worker consumes the queue `node.<node_name>`."""
    deploy_node: str | None
    """`OMNIFLOW_DEPLOY_NODE`: the node every deployment that names none is pinned to (distributed
    mode); None: deployments are placed over the live nodes by their roles' resources."""
    worker_listen: str
    """Control endpoint of the role workers this process starts (`tcp://0.0.0.0:0` in containers)."""
    max_replicas: int
    """The most replicas of one role a deployment may ask for."""
    worker_ready_timeout_s: float
    """How long a starting role worker may take to register."""
    worker_restart: bool
    """Replace the role workers of an embedded deployment that end unasked (`RestartPolicy`)."""
    worker_max_restarts: int
    """Replacements of one worker in a row (each lived under a minute) before its place is given up."""
    worker_restart_backoff_s: float
    """The wait before the first replacement; it doubles with each further one in a row (up to 30 s)."""
    node_supervise_s: float
    """Distributed mode: how often a node's Celery worker replaces the lost workers of its running
    deployments (with `worker_restart`)."""
    chat_timeout_s: float
    """How long a chat completion or session turn may take."""
    metrics_interval_s: float
    """Seconds between two messages of `/ws/metrics/`."""
    run_queue: str
    """The Celery queue `execute_run` tasks are sent to (distributed mode)."""
    model_dirs: tuple[Path, ...]
    """`OMNIFLOW_MODEL_DIRS`: directories a role's `model` may name a checkpoint in (relative to one)."""
    model_cache: Path
    """Where packaged models' checkpoints are built (`OMNIFLOW_CACHE_DIR`, else `<data dir>/cache`)."""
    quotas: Quotas
    """Per-user limits (staff exempt)."""
    throttles: Throttles
    max_json_depth: int
    """`OMNIFLOW_MAX_JSON_DEPTH`: the deepest nesting a JSON body or WebSocket message may have."""
    max_ws_message_bytes: int
    """`OMNIFLOW_MAX_WS_MESSAGE_BYTES`: the largest WebSocket message a client may send."""
    run_lease_s: float = 30.0
    """A run's lease: whoever executes it renews it every third of this; a Celery worker of the
    run queue that finds it expired re-executes the run (or fails it, see `run_lease_retries`)."""
    max_runs: int = 0
    """`OMNIFLOW_MAX_RUNS`: how many runs this process executes at once (0: no limit); the rest wait,
    pending, in the order they came (the runs list shows each one's place)."""
    run_lease_retries: int = 1
    """How often a run whose executor stopped is executed again before it is failed."""
    metrics_token: str | None = None
    """Bearer token Prometheus sends to `/metrics`; without one only staff sessions may scrape."""
    plane_bulk: BulkMode = BulkMode.CLEAR
    """`OMNIFLOW_PLANE_BULK`: how deployments' worker planes carry tensors and KV pages between
    hosts (`engine.data.bulk`): `clear` outside CURVE under one-time grants (readable on the wire),
    `mac` the same with each chunk MAC'd, `encrypted` inside CURVE (networks others can read)."""
    metrics_history_s: float = 3600.0
    """`OMNIFLOW_METRICS_HISTORY_S` (at least 300): how far back the studio keeps each worker's
    metrics, one point per `metrics_interval_s` (`studio.workflows.history`)."""
    node: NodeSettings = field(default_factory=NodeSettings)
    """This process as a node agent: its labels and resources (distributed mode)."""

    @property
    def nodes_namespace(self) -> str:
        """The Redis namespace of the node directory (`engine.flow.discovery.nodes`)."""
        return f"{self.redis_prefix}-nodes"

    @property
    def distributed(self) -> bool:
        return self.redis_url is not None

    @property
    def restart_policy(self) -> RestartPolicy:
        """How lost role workers are replaced, in both modes (when `worker_restart`)."""
        from engine.client.workers import RestartPolicy

        backoff_s = self.worker_restart_backoff_s
        return RestartPolicy(backoff_s=backoff_s, max_backoff_s=max(30.0, backoff_s),
                             max_restarts=self.worker_max_restarts)

    @property
    def media_root(self) -> Path:
        return self.data_dir / "files"

    @property
    def users_root(self) -> Path:
        """Where each user's own files live, `<users_root>/<user id>/` (see `studio.workflows.paths`)."""
        return self.data_dir / "users"


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use one of 1/0, true/false, yes/no, on/off)")


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip().replace("_", ""))
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name}={value} must be at least {minimum}")
    return value


def _env_float(env: Mapping[str, str], name: str) -> float | None:
    """`name`'s value as a number, None when unset or empty."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None


def env_float_or_none(env: Mapping[str, str], name: str) -> float | None:
    value = _env_float(env, name)
    if value is not None and not value > 0:
        raise ImproperlyConfigured(f"{name}={env[name]!r} must be a positive number of seconds")
    return value


def env_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    value = env_float_or_none(env, name)
    return default if value is None else value


_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def node_name(raw: str, name: str) -> str:
    """A node name usable in a Celery queue name (`node.<name>`)."""
    if not _NODE_NAME.match(raw):
        raise ImproperlyConfigured(f"{name}={raw!r}: a node name is 1-63 letters, digits, '_', '.' or '-'")
    return raw


_HOST_ID = re.compile(r"^[\x21-\x7e]{1,200}$")


def env_float_at_least(env: Mapping[str, str], name: str, minimum: float) -> float | None:
    value = _env_float(env, name)
    if value is not None and not minimum <= value < float("inf"):
        raise ImproperlyConfigured(f"{name}={env[name]!r} must be a number of at least {minimum:g}")
    return value


def load_node_settings(env: Mapping[str, str]) -> NodeSettings:
    from engine.spec.resources import parse_labels

    try:
        labels = parse_labels(env.get("OMNIFLOW_NODE_LABELS") or "")
    except ValueError as exc:
        raise ImproperlyConfigured(f"OMNIFLOW_NODE_LABELS: {exc}") from None
    gpus = env.get("OMNIFLOW_NODE_GPUS")
    host_id = (env.get("OMNIFLOW_HOST_ID") or "").strip() or None
    if host_id is not None and not _HOST_ID.match(host_id):
        raise ImproperlyConfigured(f"OMNIFLOW_HOST_ID={host_id!r}: 1-200 printable characters, no spaces")
    model = (env.get("OMNIFLOW_NODE_GPU_MODEL") or "").strip() or None
    return NodeSettings(
        labels=labels,
        gpus=None if gpus is None or not gpus.strip() else env_int(env, "OMNIFLOW_NODE_GPUS", 0),
        gpu_model=model,
        gpu_memory_gb=env_float_at_least(env, "OMNIFLOW_NODE_GPU_MEMORY_GB", 0.0),
        cpus=env_float_at_least(env, "OMNIFLOW_NODE_CPUS", 0.0),
        memory_gb=env_float_at_least(env, "OMNIFLOW_NODE_MEMORY_GB", 0.0),
        address=(env.get("OMNIFLOW_NODE_ADDRESS") or "").strip() or None,
        ttl_s=env_seconds(env, "OMNIFLOW_NODE_TTL_S", 10.0),
        host_id=host_id,
    )


def _allow_module_ops(env: Mapping[str, str]) -> bool:
    if "OMNIFLOW_PYTHON_OP_MODULES" in env:
        raise ImproperlyConfigured(
            "OMNIFLOW_PYTHON_OP_MODULES is gone: python nodes name registered ops (the `omniflow.ops` entry"
            " points); set OMNIFLOW_ALLOW_MODULE_OPS=1 to let them name any `module:function` too (which lets"
            " every user run any code on the server)")
    return env_bool(env, "OMNIFLOW_ALLOW_MODULE_OPS", False)


def _plane_bulk(env: Mapping[str, str]) -> BulkMode:
    raw = (env.get("OMNIFLOW_PLANE_BULK") or BulkMode.CLEAR.value).strip().lower()
    try:
        return BulkMode(raw)
    except ValueError:
        raise ImproperlyConfigured(
            f"OMNIFLOW_PLANE_BULK={raw!r}: expected one of {', '.join(m.value for m in BulkMode)}") from None


def env_list(env: Mapping[str, str], name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    raw = env.get(name)
    if raw is None:
        return default
    return tuple(part.strip() for part in raw.split(",") if part.strip())


_RATE = re.compile(r"^\d+/(s|sec|second|m|min|minute|h|hour|d|day)$")


def env_rate(env: Mapping[str, str], name: str, default: str | None) -> str | None:
    """A DRF throttle rate (`100/minute`); `off` (or empty) for none."""
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("", "off", "none"):
        return None
    if not _RATE.match(value):
        raise ImproperlyConfigured(f"{name}={raw!r} is not a rate (write N/second, N/minute, N/hour or N/day, or off)")
    return value


def load_quotas(env: Mapping[str, str]) -> Quotas:
    """The defaults let one person use the studio as before (every example workflow fits)."""
    return Quotas(
        concurrent_runs=env_int(env, "OMNIFLOW_QUOTA_CONCURRENT_RUNS", 16, minimum=1),
        queued_runs=env_int(env, "OMNIFLOW_QUOTA_QUEUED_RUNS", 64, minimum=0),
        deployments=env_int(env, "OMNIFLOW_QUOTA_DEPLOYMENTS", 4, minimum=0),
        worker_processes=env_int(env, "OMNIFLOW_QUOTA_WORKER_PROCESSES", 16, minimum=0),
        device_pages=env_int(env, "OMNIFLOW_QUOTA_DEVICE_PAGES", 16384, minimum=1),
        host_pages=env_int(env, "OMNIFLOW_QUOTA_HOST_PAGES", 65536, minimum=1),
        disk_pages=env_int(env, "OMNIFLOW_QUOTA_DISK_PAGES", 262144, minimum=1),
        hicache_host_bytes=env_int(env, "OMNIFLOW_QUOTA_HICACHE_HOST_BYTES", 16 << 30, minimum=0),
        hicache_disk_bytes=env_int(env, "OMNIFLOW_QUOTA_HICACHE_DISK_BYTES", 64 << 30, minimum=0),
        max_iterations=env_int(env, "OMNIFLOW_QUOTA_MAX_ITERATIONS", 1000, minimum=1),
        max_new_tokens=env_int(env, "OMNIFLOW_QUOTA_MAX_NEW_TOKENS", 4096, minimum=1),
        upload_bytes=env_int(env, "OMNIFLOW_QUOTA_UPLOAD_BYTES", 20 * 1024 * 1024, minimum=0),
        run_timeout_s=env_seconds(env, "OMNIFLOW_QUOTA_RUN_TIMEOUT_S", 3600.0),
        workflows=env_int(env, "OMNIFLOW_QUOTA_WORKFLOWS", 1000, minimum=1),
        versions=env_int(env, "OMNIFLOW_QUOTA_VERSIONS", 1000, minimum=1),
        websockets=env_int(env, "OMNIFLOW_QUOTA_WEBSOCKETS", 256, minimum=1),
    )


def parse_database_url(url: str, *, name: str = "DATABASE_URL", pool_size: int = 0) -> dict[str, Any]:
    """`postgres://user:password@host:port/dbname?sslmode=...` or `sqlite:///path`.

    With `pool_size`, PostgreSQL connections come from a psycopg pool of at most that many
    per process instead of a new connection per request (ASGI requests and consumers run
    on many threads: Django's persistent connections do not suit them, a pool does)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("postgres", "postgresql", "pgsql"):
        dbname = unquote(parts.path.lstrip("/"))
        if not dbname:
            raise ImproperlyConfigured(f"{name}={url!r} names no database (postgres://user@host:port/DBNAME)")
        try:
            port = parts.port
        except ValueError:
            raise ImproperlyConfigured(f"{name}={url!r} has an invalid port") from None
        options: dict[str, Any] = dict(parse_qsl(parts.query))
        if pool_size:
            options["pool"] = {"min_size": 1, "max_size": pool_size, "timeout": 10}
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": dbname,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(port or ""),
            "OPTIONS": options,
            "CONN_MAX_AGE": 0,
        }
    if scheme == "sqlite":
        path = unquote(parts.path)
        if parts.netloc or not path or path == "/":
            raise ImproperlyConfigured(f"{name}={url!r}: write sqlite:////absolute/path.db or sqlite:///relative.db")
        # sqlite:///x.db is relative, sqlite:////x.db absolute (the SQLAlchemy convention).
        return sqlite_database(Path(path[1:]))
    raise ImproperlyConfigured(f"{name}={url!r}: unsupported scheme {scheme!r} (use postgres:// or sqlite://)")


def sqlite_database(path: Path) -> dict[str, Any]:
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(path),
        # Runs write events from the engine's database thread while requests write from
        # theirs: take the write lock up front and wait for it rather than failing.
        "OPTIONS": {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
        "TEST": {"NAME": str(path.with_name(path.stem + "-test.sqlite3"))},
    }


def _secret_key(env: Mapping[str, str], data_dir: Path) -> str:
    key = env.get("OMNIFLOW_SECRET_KEY")
    if key is not None:
        if len(key) < 32:
            raise ImproperlyConfigured("OMNIFLOW_SECRET_KEY must be at least 32 characters")
        return key
    # Embedded default: a key made once and kept beside the database.
    path = data_dir / "secret_key"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(48)
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key


def _metrics_token(env: Mapping[str, str]) -> str | None:
    token = (env.get("OMNIFLOW_METRICS_TOKEN") or "").strip()
    if not token:
        return None
    if len(token) < 24:
        raise ImproperlyConfigured("OMNIFLOW_METRICS_TOKEN must be at least 24 characters"
                                   " (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return token


def _metrics_history_s(env: Mapping[str, str]) -> float:
    value = env_float_at_least(env, "OMNIFLOW_METRICS_HISTORY_S", 300.0)
    return 3600.0 if value is None else value


def load_config(env: Mapping[str, str]) -> StudioConfig:
    """Parse the environment; raise ImproperlyConfigured on the first bad value."""
    data_dir = Path(env.get("OMNIFLOW_DATA_DIR") or BASE_DIR / ".omniflow").expanduser().resolve()
    debug = env_bool(env, "OMNIFLOW_DEBUG", False)

    database_url = env.get("DATABASE_URL") or None
    pool_size = env_int(env, "OMNIFLOW_DB_POOL", 16)
    database = (parse_database_url(database_url, pool_size=pool_size) if database_url
                else sqlite_database(data_dir / "studio.sqlite3"))

    redis_url = env.get("REDIS_URL") or None
    if redis_url is not None and urlsplit(redis_url).scheme not in ("redis", "rediss", "unix"):
        raise ImproperlyConfigured(f"REDIS_URL={redis_url!r}: expected redis://, rediss:// or unix://")

    raw_dispatch = (env.get("OMNIFLOW_DISPATCH") or "local").strip().lower()
    try:
        dispatch = Dispatch(raw_dispatch)
    except ValueError:
        raise ImproperlyConfigured(
            f"OMNIFLOW_DISPATCH={raw_dispatch!r}: expected one of {', '.join(d.value for d in Dispatch)}"
        ) from None
    if dispatch is Dispatch.CELERY and redis_url is None:
        raise ImproperlyConfigured("OMNIFLOW_DISPATCH=celery needs REDIS_URL (the Celery broker)")

    log_level = (env.get("OMNIFLOW_LOG_LEVEL") or "INFO").upper()
    if log_level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ImproperlyConfigured(f"OMNIFLOW_LOG_LEVEL={log_level!r} is not a logging level")

    node = node_name((env.get("OMNIFLOW_NODE") or socket.gethostname()).strip(), "OMNIFLOW_NODE")
    worker_listen = (env.get("OMNIFLOW_WORKER_LISTEN") or "tcp://127.0.0.1:0").strip()
    if not re.match(r"^tcp://[^:/]+:\d+$", worker_listen):
        raise ImproperlyConfigured(f"OMNIFLOW_WORKER_LISTEN={worker_listen!r}: expected tcp://HOST:PORT")

    return StudioConfig(
        debug=debug,
        secret_key=_secret_key(env, data_dir),
        allowed_hosts=env_list(env, "OMNIFLOW_ALLOWED_HOSTS", ("127.0.0.1", "localhost", "[::1]", "testserver")),
        csrf_trusted_origins=env_list(env, "OMNIFLOW_CSRF_TRUSTED_ORIGINS", ()),
        data_dir=data_dir,
        database=database,
        redis_url=redis_url,
        redis_prefix=(env.get("OMNIFLOW_REDIS_PREFIX") or "omniflow").strip(),
        dispatch=dispatch,
        max_upload_bytes=env_int(env, "OMNIFLOW_MAX_UPLOAD_BYTES", 20 * 1024 * 1024, minimum=1024),
        max_run_file_bytes=env_int(env, "OMNIFLOW_MAX_RUN_FILE_BYTES", 64 * 1024 * 1024, minimum=1024),
        run_timeout_s=env_float_or_none(env, "OMNIFLOW_RUN_TIMEOUT_S"),
        allow_module_ops=_allow_module_ops(env),
        log_level=log_level,
        node_name=node,
        deploy_node=(node_name(env["OMNIFLOW_DEPLOY_NODE"].strip(), "OMNIFLOW_DEPLOY_NODE")
                     if (env.get("OMNIFLOW_DEPLOY_NODE") or "").strip() else None),
        worker_listen=worker_listen,
        max_replicas=env_int(env, "OMNIFLOW_MAX_REPLICAS", 16, minimum=1),
        worker_ready_timeout_s=env_seconds(env, "OMNIFLOW_WORKER_READY_TIMEOUT_S", 120.0),
        worker_restart=env_bool(env, "OMNIFLOW_WORKER_RESTART", True),
        worker_max_restarts=env_int(env, "OMNIFLOW_WORKER_MAX_RESTARTS", 5),
        worker_restart_backoff_s=env_seconds(env, "OMNIFLOW_WORKER_RESTART_BACKOFF_S", 0.5),
        node_supervise_s=env_seconds(env, "OMNIFLOW_NODE_SUPERVISE_S", 5.0),
        chat_timeout_s=env_seconds(env, "OMNIFLOW_CHAT_TIMEOUT_S", 300.0),
        metrics_interval_s=env_seconds(env, "OMNIFLOW_METRICS_INTERVAL_S", 1.0),
        run_queue=node_name((env.get("OMNIFLOW_RUN_QUEUE") or "omniflow").strip(), "OMNIFLOW_RUN_QUEUE"),
        model_dirs=tuple(Path(d).expanduser().resolve() for d in env_list(env, "OMNIFLOW_MODEL_DIRS", ())),
        model_cache=model_cache_root(env),
        quotas=load_quotas(env),
        throttles=Throttles(
            login=env_rate(env, "OMNIFLOW_THROTTLE_LOGIN", "20/minute"),
            token=env_rate(env, "OMNIFLOW_THROTTLE_TOKEN", "20/hour"),
            run=env_rate(env, "OMNIFLOW_THROTTLE_RUN", "600/minute"),
        ),
        max_json_depth=env_int(env, "OMNIFLOW_MAX_JSON_DEPTH", 64, minimum=8),
        max_ws_message_bytes=env_int(env, "OMNIFLOW_MAX_WS_MESSAGE_BYTES", 1 << 20, minimum=1024),
        run_lease_s=env_seconds(env, "OMNIFLOW_RUN_LEASE_S", 30.0),
        max_runs=env_int(env, "OMNIFLOW_MAX_RUNS", 0, minimum=0),
        run_lease_retries=env_int(env, "OMNIFLOW_RUN_LEASE_RETRIES", 1),
        metrics_token=_metrics_token(env),
        metrics_history_s=_metrics_history_s(env),
        node=load_node_settings(env),
        plane_bulk=_plane_bulk(env),
    )
