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
# Where the project is not installed (a bare GPU machine), its entry points (the node and role
# kinds, the registered ops) come from a dist-info of its own, written from pyproject.toml.
if ! "$PY" -c 'import importlib.metadata as m; m.distribution("omniflow")' 2>/dev/null; then
    [[ -n "$site" ]] || site=$(mktemp -d)
    "$PY" - "$site" <<'PY'
import sys
import tomllib
from pathlib import Path

project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
info = Path(sys.argv[1]) / f"{project['name']}-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
groups = project.get("entry-points", {})
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {ref}\n" for name, ref in entries.items()) + "\n"
    for group, entries in groups.items()))
PY
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
