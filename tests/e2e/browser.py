"""Running a browser test script (`frontend/e2e/*.e2e.mjs`: Playwright driving Debian's Chromium
from Node) against a live studio, and checking the screenshots it took."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, LiveStudio

FRONTEND = ROOT / "frontend"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def missing_tool() -> str | None:
    """Why browser tests cannot run here (they are skipped, saying so), or None."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)"
    if not (FRONTEND / "node_modules" / "playwright-core").is_dir():
        return "frontend packages are not installed (bash scripts/frontend.sh install)"
    return None


needs_browser = pytest.mark.skipif(missing_tool() is not None, reason=str(missing_tool()))


def run_script(script: str, studio: LiveStudio, artifacts: Path, *, timeout_s: float,
               env: dict[str, str] | None = None) -> list[str]:
    """Run `frontend/e2e/<script>` against `studio` (logged in as its demo user), its screenshots in
    `artifacts` (emptied first); fails the test with the script's output and the studio's log when
    the script fails. The names of the screenshots taken, sorted."""
    assert (FRONTEND / "dist" / "index.html").is_file(), "build the frontend first: bash scripts/frontend.sh build"
    shutil.rmtree(artifacts, ignore_errors=True)
    full_env = {**os.environ, "STUDIO_URL": studio.url, "STUDIO_USER": studio.user,
                "STUDIO_PASSWORD": studio.password, "E2E_ARTIFACTS": str(artifacts), "CHROMIUM": CHROMIUM,
                **(env or {})}
    result = subprocess.run(["node", f"e2e/{script}"], cwd=FRONTEND, env=full_env, capture_output=True, text=True,
                            timeout=timeout_s)
    if result.returncode != 0:
        server_log = studio.log.read_text(errors="replace")[-4000:]
        pytest.fail(f"browser test failed (screenshots in {artifacts}):\n{result.stdout[-6000:]}\n"
                    f"{result.stderr[-3000:]}\n--- studio log ---\n{server_log}")
    return sorted(p.name for p in artifacts.glob("*.png"))


def assert_shots(shots: list[str], pages: tuple[str, ...]) -> None:
    """Every page in `pages` has its screenshot (`NN-<page>.png`)."""
    for page in pages:
        assert any(name.endswith(f"-{page}.png") for name in shots), f"no screenshot of {page}: {shots}"
