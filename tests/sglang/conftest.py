"""SGLang integration tests: run in `.venv-sglang` by `scripts/sglang_env.sh test`.

These tests import `sglang` (0.5.23) and need torch 2.14.1; the main suite runs with
`--ignore=tests/sglang`. Nothing here changes collection under the main venv.
"""

from __future__ import annotations

import os

# SGLang reads some settings at import; keep it off accelerators and quiet.
os.environ.setdefault("SGLANG_LOG_LEVEL", "warning")
