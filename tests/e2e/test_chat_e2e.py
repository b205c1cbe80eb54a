"""A plain question on the chat workflow's New run form, in real Chromium (`frontend/e2e/chat.e2e.mjs`)
against the live studio of `tests/e2e/conftest.py` (issue #20: it got an empty answer): the prompt's
"Chat message" toggle sends it in smollm2-135m's chat template and the answer mentions Paris;
"Run again" sends the rendered prompt unchanged; the toggle off sends the text as typed. Screenshots
land in tests/e2e/artifacts/chat/."""

from __future__ import annotations

import pytest

from tests.e2e.browser import ARTIFACTS, assert_shots, needs_browser, run_script
from tests.e2e.conftest import LiveStudio

pytestmark = needs_browser


@pytest.mark.timeout(300)
def test_a_plain_question_on_the_chat_workflows_form_is_answered_in_chromium(live_studio: LiveStudio) -> None:
    shots = run_script("chat.e2e.mjs", live_studio, ARTIFACTS / "chat", timeout_s=280)
    assert_shots(shots, ("chat-form-plain-question", "chat-answer-paris", "chat-run-again-rendered", "chat-toggle-off"))
