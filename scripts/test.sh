#!/usr/bin/env bash
# The whole suite: lint, import layering, then pytest.
# Tests that need Redis use REDIS_URL (default redis://127.0.0.1:6379/0). When nothing
# answers there, a private redis-server is started on a free port for the run (the Debian
# package is installed if missing) and stopped afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONHASHSEED=0
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}

private_redis_pid=""
private_redis_dir=""
cleanup() {
    if [[ -n "$private_redis_pid" ]]; then
        kill "$private_redis_pid" 2>/dev/null || true
        wait "$private_redis_pid" 2>/dev/null || true
    fi
    if [[ -n "$private_redis_dir" ]]; then
        rm -rf "$private_redis_dir"
    fi
    if [[ -n "${OMNIFLOW_DATA_DIR:-}" ]]; then
        rm -rf "$OMNIFLOW_DATA_DIR"
    fi
    return 0
}
trap cleanup EXIT

if ! "$PY" scripts/redis_ping.py "$REDIS_URL"; then
    if ! command -v redis-server >/dev/null; then
        echo "redis-server is missing: installing Debian's redis-server package"
        apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    fi
    port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    private_redis_dir=$(mktemp -d)
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$private_redis_dir" --logfile "$private_redis_dir/redis.log" &
    private_redis_pid=$!
    export REDIS_URL="redis://127.0.0.1:$port/0"
    echo "No Redis answered; started a private redis-server at $REDIS_URL"
    "$PY" scripts/redis_ping.py "$REDIS_URL" --wait 10
fi

# PostgreSQL for the studio's tests when it answers; otherwise SQLite, said out loud.
if [[ -z "${DATABASE_URL:-}" ]]; then
    if "$PY" scripts/pg_ping.py "postgres://postgres@127.0.0.1:5432/test"; then
        export DATABASE_URL="postgres://postgres@127.0.0.1:5432/test"
    else
        echo "No PostgreSQL answered at 127.0.0.1:5432: the studio's tests run on SQLite"
    fi
fi
OMNIFLOW_DATA_DIR=$(mktemp -d)
export OMNIFLOW_DATA_DIR

echo "== ruff"
"$VENV/bin/ruff" check .
echo "== import layering"
"$VENV/bin/lint-imports"
echo "== pytest (REDIS_URL=$REDIS_URL DATABASE_URL=${DATABASE_URL:-sqlite})"
# tests/sglang need SGLang's own torch; they run in .venv-sglang (make test-sglang).
# tests/gpu need a CUDA GPU, which CI does not have: scripts/gpu_check.sh runs them on one.
"$PY" -m pytest -q -rs --ignore=tests/sglang --ignore=tests/gpu "$@"
