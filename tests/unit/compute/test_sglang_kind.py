"""The `sglang_llm` role kind in the main catalogue: `llm` nodes validate on it, bad params are
named, and building it where there is no GPU fails with an error that says so (the runner
itself is tested against the real sglang package in tests/sglang)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.compute.sglang.runner import GPURequired
from engine.flow.dsl import Workflow
from engine.flow.validate import GraphValidationError, validate
from engine.spec.graph import RoleSpec
from engine.spec.kinds import default_kinds


def sglang_chat(model: Path, params: dict | None = None, device: str = "cuda") -> Workflow:
    wf = Workflow("sglang_chat")
    llm = wf.role("llm", kind="sglang_llm", model=str(model), device=device, params=params or {})
    prompt = wf.input("prompt", "text", default="hello")
    wf.node("gen", "llm", role=llm, params={"max_new_tokens": 4})
    wf.edge(prompt, "gen.prompt")
    wf.output("text", "gen.text")
    return wf


def test_llm_nodes_validate_on_an_sglang_role(tmp_path: Path):
    kinds = default_kinds()
    assert kinds.role_kind("sglang_llm").runner == "engine.compute.sglang.runner:SGLangLLMUnit"
    validate(sglang_chat(tmp_path, {"page_size": 32, "hicache": {"host_capacity_bytes": 1 << 30}}).to_spec(), kinds)


def test_unknown_and_bad_role_params_are_named(tmp_path: Path):
    with pytest.raises(GraphValidationError) as info:
        validate(sglang_chat(tmp_path, {"page_size": 0, "tp": 2}).to_spec(), default_kinds())
    messages = " | ".join(issue.message for issue in info.value.issues)
    assert "role 'llm'" in messages and "page_size" in messages and "'tp'" in messages


def test_building_the_unit_without_a_gpu_says_a_gpu_is_needed(tmp_path: Path):
    runner = default_kinds().role_kind("sglang_llm").load_runner()
    with pytest.raises(GPURequired, match="needs a GPU: role device is 'cpu'"):
        runner(RoleSpec(name="llm", kind="sglang_llm", model=str(tmp_path), device="cpu"))
