#!/usr/bin/env bash
# The checks that need a CUDA GPU, which CI does not have: CUDA IPC on the transfer plane and
# weight sharing between processes on one GPU (tests/gpu), then the CUDA hand-off benchmark
# (`omniflow bench cuda_transfer`, one JSON line). Run it on a machine with a GPU and a Python
# whose torch sees it.
#
#   scripts/gpu_check.sh [pytest args]        with $PYTHON (default python3) as it is
#   WHEELS=DIR scripts/gpu_check.sh           first installs the wheels in DIR for this run
#                                             (a machine without an index: msgspec, pyzmq)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
site=""
cleanup() { [[ -n "$site" ]] && rm -rf "$site"; return 0; }
trap cleanup EXIT
if [[ -n "${WHEELS:-}" ]]; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
"$PY" - <<'PY'
import torch

if not torch.cuda.is_available():
    raise SystemExit("gpu_check: torch sees no CUDA GPU here")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY
status=0
"$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu "$@" || status=$?
echo "== omniflow bench cuda_transfer"
"$PY" -m engine.bench.cuda_transfer --repeats 10 || status=$?
exit "$status"
