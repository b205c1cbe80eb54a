"""The studio in real Chromium (Debian's `chromium`, driven by Playwright from Node)
against a live studio: `frontend/e2e/studio.e2e.mjs` logs in, builds a workflow by
dragging and connecting nodes, sees and fixes a validation error, saves versions, diffs
them, exports, runs workflows (inputs, an image upload, streamed text, a PNG output),
watches node states live, cancels a run, imports and deletes, deploys
`workflows/image_generation.py` onto role workers and runs it there (its PNG on the run
page), sees the cluster page's KV hit rate rise after a second run of the same prompt, and
visits every page.
Screenshots of each page land in tests/e2e/artifacts/studio/.

Needs `node`, the frontend's packages and build (`bash scripts/frontend.sh build`) and
Chromium (`apt-get install chromium`, or CHROMIUM=/path); skipped when a tool is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.browser import ARTIFACTS, assert_shots, needs_browser, run_script
from tests.e2e.conftest import LiveStudio
from tests.e2e.fns import png

pytestmark = needs_browser


@pytest.mark.timeout(300)
def test_studio_in_chromium(live_studio: LiveStudio, tmp_path: Path) -> None:
    picture = tmp_path / "picture.png"
    picture.write_bytes(png(48, 32, (220, 90, 40)))
    shots = run_script("studio.e2e.mjs", live_studio, ARTIFACTS / "studio", timeout_s=240, env={
        "E2E_FIXTURES": str(Path(__file__).resolve().parent / "workflows"),
        "E2E_PICTURE": str(picture),
    })
    assert_shots(shots, ("login", "workflows", "editor-validation-error", "history-diff", "run-diamond-done",
                 "run-media-done", "run-live-running", "run-cancelled", "runs", "cluster",
                 "run-image-generation-done", "cluster-kv-hit-rate-rise"))
