#!/usr/bin/env bash
# A separate virtual environment for the SGLang integration tests (tests/sglang).
#
#   scripts/sglang_env.sh          create/refresh .venv-sglang (idempotent; minutes the first time)
#   scripts/sglang_env.sh test     create it if missing, then run the SGLang tests in it
#
# The main .venv pins torch==2.13.0 and is never touched here. sglang==0.5.23 pins
# torch==2.14.1 and CUDA-only kernels, so it is installed with --no-deps next to the
# light dependencies that make its CPU-side components import (see
# the SGLang notes of the design docs). pip takes torch/torchvision from its configured local wheels.
# SGLang's get_hash_str JIT-compiles a C++ helper on first use: it needs g++, ninja and
# libssl-dev; the Debian packages are installed when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-.venv-sglang}
PY="$VENV/bin/python"
STAMP="$VENV/.omniflow-sglang-env-v2"

TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
SGLANG_PIN=sglang==0.5.23
# Light dependencies of sglang's CPU-side modules (never a bare `torch`).
SGLANG_LIGHT=(
    numpy==2.4.6 orjson psutil==7.2.2 pybase64 requests packaging pillow==13.0.0 starlette
    msgspec==0.23.0 pydantic pyzmq==27.3.0 tqdm ipython aiohttp dill gguf partial-json-parser
    openai==2.8.0 triton transformers==5.19.0 tokenizers==0.23.2 apache-tvm-ffi==0.1.11
    sentencepiece==0.2.1 compressed-tensors==0.18.0 ninja
)
# This project's own runtime dependencies used by the tested modules, plus the test runner.
PROJECT_LIGHT=(redis==8.1.0 safetensors==0.8.0 jsonschema==4.26.0 setproctitle==1.3.8
    pytest==9.2.0 pytest-timeout==2.4.0 pytest-asyncio==1.5.0)

system_packages() {
    local missing=()
    command -v g++ >/dev/null || missing+=(g++)
    command -v ninja >/dev/null || missing+=(ninja-build)
    dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
    if ((${#missing[@]})); then
        echo "installing Debian packages for SGLang's JIT C++ helper: ${missing[*]}"
        apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

setup() {
    system_packages
    if [[ -f "$STAMP" ]]; then
        return 0
    fi
    [[ -x "$PY" ]] || python3 -m venv "$VENV"
    local pip=("$PY" -m pip install -q --progress-bar off)
    "${pip[@]}" "${TORCH_PINS[@]}"
    "${pip[@]}" --no-deps "$SGLANG_PIN"
    "${pip[@]}" "${TORCH_PINS[@]}" "${SGLANG_LIGHT[@]}" "${PROJECT_LIGHT[@]}"
    "${pip[@]}" --no-deps -e .
    "$PY" -c 'import torch, sglang, sglang.srt.mem_cache.hicache_storage; print("torch", torch.__version__, "sglang", sglang.__version__)'
    touch "$STAMP"
}

case "${1:-setup}" in
    setup) setup ;;
    test)
        shift
        setup
        export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONHASHSEED=0
        "$PY" -m pytest -q -p no:cacheprovider tests/sglang "$@"
        ;;
    *) echo "usage: $0 [setup|test [pytest args]]" >&2; exit 2 ;;
esac
