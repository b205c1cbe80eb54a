"""The studio in real Chromium (Debian's `chromium`, driven by Playwright from Node)
against a live studio: `frontend/e2e/studio.e2e.mjs` logs in, builds a workflow by
dragging and connecting nodes, sees and fixes a validation error, saves versions, diffs
them, exports, runs workflows (inputs, an image upload, streamed text, a PNG output),
watches node states live, cancels a run, imports and deletes, deploys
`workflows/image_generation.py` onto role workers and runs it there (its PNG on the run
page), sees the cluster page's KV hit rate rise after a second run of the same prompt, and
visits every page.
Screenshots of each page land in tests/e2e/artifacts/.

Needs `node`, the frontend's packages and build (`bash scripts/frontend.sh build`) and
Chromium (`apt-get install chromium`, or CHROMIUM=/path); skipped when a tool is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, LiveStudio
from tests.e2e.fns import png

FRONTEND = ROOT / "frontend"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def _missing_tool() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed"
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)"
    if not (FRONTEND / "node_modules" / "playwright-core").is_dir():
        return "frontend packages are not installed (bash scripts/frontend.sh install)"
    return None


pytestmark = pytest.mark.skipif(_missing_tool() is not None, reason=str(_missing_tool()))


@pytest.mark.timeout(300)
def test_studio_in_chromium(live_studio: LiveStudio, tmp_path: Path) -> None:
    assert (FRONTEND / "dist" / "index.html").is_file(), "build the frontend first: bash scripts/frontend.sh build"
    picture = tmp_path / "picture.png"
    picture.write_bytes(png(48, 32, (220, 90, 40)))
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    env = {
        **os.environ,
        "STUDIO_URL": live_studio.url,
        "STUDIO_USER": live_studio.user,
        "STUDIO_PASSWORD": live_studio.password,
        "E2E_ARTIFACTS": str(ARTIFACTS),
        "E2E_FIXTURES": str(Path(__file__).resolve().parent / "workflows"),
        "E2E_PICTURE": str(picture),
        "CHROMIUM": CHROMIUM,
    }
    result = subprocess.run(["node", "e2e/studio.e2e.mjs"], cwd=FRONTEND, env=env, capture_output=True,
                            text=True, timeout=240)
    if result.returncode != 0:
        server_log = live_studio.log.read_text(errors="replace")[-4000:]
        pytest.fail(f"browser test failed (screenshots in {ARTIFACTS}):\n{result.stdout[-6000:]}\n"
                    f"{result.stderr[-3000:]}\n--- studio log ---\n{server_log}")
    shots = sorted(p.name for p in ARTIFACTS.glob("*.png"))
    for page in ("login", "workflows", "editor-validation-error", "history-diff", "run-diamond-done",
                 "run-media-done", "run-live-running", "run-cancelled", "runs", "cluster",
                 "run-image-generation-done", "cluster-kv-hit-rate-rise"):
        assert any(name.endswith(f"-{page}.png") for name in shots), f"no screenshot of {page}: {shots}"
