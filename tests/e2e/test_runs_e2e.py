"""Runs people can watch, in real Chromium (`frontend/e2e/runs.e2e.mjs`) against the live studio of
`tests/e2e/conftest.py`: a progress bar seen moving on the real model's llm node, an image no
workflow output carries previewed full size from the run's files and a node's tone in a player,
the streamed reply read as text, where each node ran, "Run again" from the previous inputs, and
the runs list updating (and cancelling) without a reload. Screenshots land in tests/e2e/artifacts/runs/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import LiveStudio
from tests.e2e.test_studio_e2e import CHROMIUM, FRONTEND, _missing_tool

ARTIFACTS = Path(__file__).resolve().parent / "artifacts" / "runs"

pytestmark = pytest.mark.skipif(_missing_tool() is not None, reason=str(_missing_tool()))


@pytest.mark.timeout(240)
def test_runs_people_can_watch_in_chromium(live_studio: LiveStudio) -> None:
    assert (FRONTEND / "dist" / "index.html").is_file(), "build the frontend first: bash scripts/frontend.sh build"
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    env = {
        **os.environ,
        "STUDIO_URL": live_studio.url,
        "STUDIO_USER": live_studio.user,
        "STUDIO_PASSWORD": live_studio.password,
        "E2E_ARTIFACTS": str(ARTIFACTS),
        "E2E_FIXTURES": str(Path(__file__).resolve().parent / "workflows"),
        "E2E_DATA_DIR": str(live_studio.data_dir),
        "CHROMIUM": CHROMIUM,
    }
    result = subprocess.run(["node", "e2e/runs.e2e.mjs"], cwd=FRONTEND, env=env, capture_output=True, text=True,
                            timeout=220)
    if result.returncode != 0:
        server_log = live_studio.log.read_text(errors="replace")[-4000:]
        pytest.fail(f"browser test failed (screenshots in {ARTIFACTS}):\n{result.stdout[-6000:]}\n"
                    f"{result.stderr[-3000:]}\n--- studio log ---\n{server_log}")
    shots = sorted(p.name for p in ARTIFACTS.glob("*.png"))
    for page in ("run-progress-moving", "intermediate-image-full-size", "run-watch-done", "run-again-form",
                 "runs-list-live", "runs-list-cancelled"):
        assert any(name.endswith(f"-{page}.png") for name in shots), f"no screenshot of {page}: {shots}"
