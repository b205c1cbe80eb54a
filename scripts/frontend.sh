#!/usr/bin/env bash
# The studio frontend (frontend/): install, build, unit tests, browser tests.
#
#   scripts/frontend.sh install   npm ci from the committed lockfile (skipped when it is unchanged)
#   scripts/frontend.sh build     install, type-check and build frontend/dist (what Django serves)
#   scripts/frontend.sh unit      vitest: the graph <-> GraphSpec conversion and the run/metrics readers
#   scripts/frontend.sh e2e       build, then the browser tests (tests/e2e) against a live studio
#   scripts/frontend.sh browser   make sure Chromium is there for the browser tests
#   scripts/frontend.sh all       build, unit, e2e
#
# Needs Node >= 20.19 with npm. The browser tests use Debian's chromium (installed with
# apt-get when missing and running as root), or the browser named by CHROMIUM.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
FRONTEND=frontend

need_node() {
    if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
        echo "node and npm are needed for the frontend (Node >= 20.19)" >&2
        exit 1
    fi
}

install() {
    need_node
    local stamp="$FRONTEND/node_modules/.omniflow-lock-sha256"
    local want
    want=$(sha256sum "$FRONTEND/package-lock.json" | cut -d' ' -f1)
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return 0
    fi
    (cd "$FRONTEND" && npm ci --no-audit --no-fund --loglevel=error)
    echo "$want" > "$stamp"
}

build() {
    install
    (cd "$FRONTEND" && npm run --silent build)
}

unit() {
    install
    (cd "$FRONTEND" && npx vitest run)
}

chromium() {
    local browser=${CHROMIUM:-/usr/bin/chromium}
    if [[ -x "$browser" ]]; then
        return 0
    fi
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        echo "Chromium is missing: installing Debian's chromium package"
        apt-get update -qq && apt-get install -y -qq chromium >/dev/null
    else
        echo "no Chromium at $browser: apt-get install chromium, or set CHROMIUM" >&2
        exit 1
    fi
}

e2e() {
    build
    chromium
    "$VENV/bin/python" -m pytest -q -rs tests/e2e "$@"
}

case "${1:-all}" in
    install) install ;;
    build) build ;;
    unit) unit ;;
    e2e) shift; e2e "$@" ;;
    browser) chromium ;;
    all) build; unit; e2e ;;
    *) echo "usage: $0 {install|build|unit|e2e|all}" >&2; exit 2 ;;
esac
