"""Endpoints, tokens and guided editing in real Chromium (`frontend/e2e/ux.e2e.mjs`) against the
live studio of `tests/e2e/conftest.py`: an API token made on its page and used by the `openai`
client on a deployment reached by its name, then revoked and refused; the deploy dialog's and the
deployment view's endpoint, snippets (run as pasted: bash for curl, this interpreter for the Python
one) and live workers; a model-less llm role and an unregistered op flagged before save and fixed
with the pickers; the README's quick start imported and run; the largest example readable at
1024x768. Screenshots land in tests/e2e/artifacts/ux/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, LiveStudio
from tests.e2e.test_studio_e2e import CHROMIUM, FRONTEND, _missing_tool

ARTIFACTS = Path(__file__).resolve().parent / "artifacts" / "ux"

pytestmark = pytest.mark.skipif(_missing_tool() is not None, reason=str(_missing_tool()))


@pytest.mark.timeout(420)
def test_endpoints_tokens_and_guided_editing_in_chromium(live_studio: LiveStudio) -> None:
    assert (FRONTEND / "dist" / "index.html").is_file(), "build the frontend first: bash scripts/frontend.sh build"
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    env = {
        **os.environ,
        "STUDIO_URL": live_studio.url,
        "STUDIO_USER": live_studio.user,
        "STUDIO_PASSWORD": live_studio.password,
        "E2E_ARTIFACTS": str(ARTIFACTS),
        "E2E_PYTHON": sys.executable,  # has the openai package (a dependency of the project)
        "E2E_HELLO": str(ROOT / "workflows" / "hello.py"),
        "CHROMIUM": CHROMIUM,
    }
    result = subprocess.run(["node", "e2e/ux.e2e.mjs"], cwd=FRONTEND, env=env, capture_output=True, text=True,
                            timeout=400)
    if result.returncode != 0:
        server_log = live_studio.log.read_text(errors="replace")[-4000:]
        pytest.fail(f"browser test failed (screenshots in {ARTIFACTS}):\n{result.stdout[-6000:]}\n"
                    f"{result.stderr[-3000:]}\n--- studio log ---\n{server_log}")
    shots = sorted(p.name for p in ARTIFACTS.glob("*.png"))
    for page in ("tokens-created", "deploy-endpoint-workers", "deployment-view", "tokens-last-used", "tokens-revoked",
                 "editor-op-unregistered", "editor-model-missing", "editor-op-picked", "run-hello-done",
                 "editor-large-1024"):
        assert any(name.endswith(f"-{page}.png") for name in shots), f"no screenshot of {page}: {shots}"
