"""The example workflows (`workflows/*.py`) for tests: as shipped, or with their real LLM
(`smollm2-135m`) swapped for the tiny seeded one (`tiny-llama`) where a test checks the machinery
(sessions, tenants, KV pulls, recomputation) rather than the model, and so runs in seconds without
the model cache. The prompts stay as written (in SmolLM2's chat format): to the tiny model they are
text like any other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.flow.loader import load_workflow
from engine.flow.validate import parse_spec
from engine.spec.graph import GraphSpec, encode_spec

ROOT = Path(__file__).resolve().parents[1]
REAL_LLM = "smollm2-135m"
TINY_LLM = "tiny-llama"


def example_doc(name: str, *, tiny: bool = False) -> dict[str, Any]:
    """The GraphSpec document of workflows/NAME.py (`tiny`: every `smollm2-135m` is `tiny-llama`:
    role models, an encoder's `llm`, an op's `model` param)."""
    text = encode_spec(load_workflow(ROOT / "workflows" / f"{name}.py")).decode()
    if tiny:
        text = text.replace(json.dumps(REAL_LLM), json.dumps(TINY_LLM))
    return json.loads(text)


def example(name: str, *, tiny: bool = False) -> GraphSpec:
    return parse_spec(example_doc(name, tiny=tiny))
