"""Endpoints, tokens and guided editing in real Chromium (`frontend/e2e/ux.e2e.mjs`) against the
live studio of `tests/e2e/conftest.py`: an API token made on its page and used by the `openai`
client on a deployment reached by its name, then revoked and refused; the deploy dialog's and the
deployment view's endpoint, snippets (run as pasted: bash for curl, this interpreter for the Python
one) and live workers; a model-less llm role and an unregistered op flagged before save and fixed
with the pickers; the README's quick start imported and run; the largest example readable at
1024x768. Screenshots land in tests/e2e/artifacts/ux/. Port labels on the canvas read whole
(`frontend/e2e/ports.e2e.mjs`), in tests/e2e/artifacts/ports/. Runs of large graphs open readable and
notices leave a dialog's buttons clear (`frontend/e2e/views.e2e.mjs`), in tests/e2e/artifacts/views/. What a
newcomer meets first (`frontend/e2e/firstlook.e2e.mjs`), in tests/e2e/artifacts/firstlook/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.browser import ARTIFACTS, assert_shots, needs_browser, run_script
from tests.e2e.conftest import ROOT, LiveStudio

pytestmark = needs_browser


@pytest.mark.timeout(420)
def test_endpoints_tokens_and_guided_editing_in_chromium(live_studio: LiveStudio) -> None:
    shots = run_script("ux.e2e.mjs", live_studio, ARTIFACTS / "ux", timeout_s=400, env={
        "E2E_PYTHON": sys.executable,  # has the openai package (a dependency of the project)
        "E2E_HELLO": str(ROOT / "workflows" / "hello.py"),
    })
    assert_shots(shots, ("tokens-created", "deploy-endpoint-workers", "deployment-view", "tokens-last-used", "tokens-revoked",
                 "editor-op-unregistered", "editor-model-missing", "editor-op-picked", "run-hello-done",
                 "editor-large-1024"))


@pytest.mark.timeout(240)
def test_a_worker_that_cannot_start_shows_failed_with_its_reason_in_chromium(live_studio: LiveStudio) -> None:
    """`frontend/e2e/failed.e2e.mjs`: an llm role on a checkpoint folder with a config and no weights
    deploys, its worker exits before it registers, and the deploy dialog and the deployment view show
    that worker's row failed with its reason. Screenshots land in tests/e2e/artifacts/failed/."""
    shots = run_script("failed.e2e.mjs", live_studio, ARTIFACTS / "failed", timeout_s=220, env={
        "E2E_FIXTURES": str(Path(__file__).resolve().parent / "workflows"),
    })
    assert_shots(shots, ("editor-no-weights-valid", "deploy-dialog-worker-failed", "deployment-view-worker-failed"))


@pytest.mark.timeout(180)
def test_every_port_label_reads_whole_in_chromium(live_studio: LiveStudio) -> None:
    """`frontend/e2e/ports.e2e.mjs`: in every example workflow (`workflows/*.py`, loaded for the demo
    user) and on a node of every kind in the palette, no port name on the canvas is cut short, runs
    past its node or into the output label beside it (issue #20: the llm node showed 'toke…')."""
    examples = sorted(p.stem for p in (ROOT / "workflows").glob("*.py") if p.stem != "__init__")
    shots = run_script("ports.e2e.mjs", live_studio, ARTIFACTS / "ports", timeout_s=160,
                       env={"E2E_EXAMPLES": ",".join(examples)})
    assert_shots(shots, ("chat-llm-ports", "every-kind"))


@pytest.mark.timeout(320)
def test_run_views_open_readable_and_toasts_leave_dialog_buttons_clear_in_chromium(live_studio: LiveStudio) -> None:
    """`frontend/e2e/views.e2e.mjs`: a run of image_generation and of omni_dialogue (the largest
    example), at 1440x960 and 1024x768 (image_generation at 1440x900 too), opens at a zoom where node
    titles are legible with the inputs in view (as the editor opens them); fit-to-view, there and on
    every example in the editor, leaves no node under the minimap or the zoom buttons (at 1440x900
    not even a node the canvas's edge cuts, on the New run form and the run page); the run page's
    node table keeps each node's id, its "random weights" pill and its time on one line; a toast shown while the wide deploy dialog is open
    overlaps none of its footer's buttons, and they take a click; a saved version with issues cannot be
    run (its Run button is disabled, naming the version and its issue count)."""
    shots = run_script("views.e2e.mjs", live_studio, ARTIFACTS / "views", timeout_s=300)
    assert_shots(shots, ("run-image_generation-1440", "run-omni_dialogue-1440", "run-image_generation-1024",
                         "new-run-image_generation-1440x900", "run-image_generation-1440x900",
                         "run-omni_dialogue-1024", "deploy-dialog-toast-1024", "editor-draft-cannot-run"))


@pytest.mark.timeout(180)
def test_what_a_newcomer_meets_first_in_chromium(live_studio: LiveStudio) -> None:
    """`frontend/e2e/firstlook.e2e.mjs` (issue #20): the workflows list dates its updates and says
    how long ago; the image_generation editor opens with its graph (the time it took printed), its
    model picker marking smollm2-135m random for the diffusion role only; an llm node with no prompt
    wired is flagged on its node and port before save, and no longer once an input feeds it; an input
    retyped to json while it feeds llm.tokens is a type mismatch on both ends; a version 1 compared with nothing reads as added throughout."""
    shots = run_script("firstlook.e2e.mjs", live_studio, ARTIFACTS / "firstlook", timeout_s=160)
    assert_shots(shots, ("workflows-dates", "editor-image_generation", "editor-model-weights-per-role",
                         "editor-llm-no-prompt", "editor-llm-prompt-wired", "editor-input-type-mismatch",
                         "history-first-version"))
