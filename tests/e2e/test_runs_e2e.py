"""Runs people can watch, in real Chromium (`frontend/e2e/runs.e2e.mjs`) against the live studio of
`tests/e2e/conftest.py`: what a run waits for while its llm role loads the model, a progress bar seen
moving on the real model's llm node, an image no workflow output carries previewed full size from the
run's files and a node's tone in a player, the streamed reply read as text, where each node ran,
"Run again" from the previous inputs, and the runs list updating (and cancelling) without a reload.
Screenshots land in tests/e2e/artifacts/runs/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.browser import ARTIFACTS, assert_shots, needs_browser, run_script
from tests.e2e.conftest import LiveStudio

pytestmark = needs_browser


@pytest.mark.timeout(240)
def test_runs_people_can_watch_in_chromium(live_studio: LiveStudio) -> None:
    shots = run_script("runs.e2e.mjs", live_studio, ARTIFACTS / "runs", timeout_s=220, env={
        "E2E_FIXTURES": str(Path(__file__).resolve().parent / "workflows"),
        "E2E_DATA_DIR": str(live_studio.data_dir),
    })
    assert_shots(shots, ("run-loading-model", "run-progress-moving", "intermediate-image-full-size", "run-watch-done",
                         "run-again-form", "runs-list-live", "runs-list-cancelled"))
