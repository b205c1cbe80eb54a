"""The `sglang_llm` role kind in the main catalogue: `llm` nodes validate on it, bad params are
named, and building it where there is no GPU fails with an error that says so (the runner
itself is tested against the real sglang package in tests/sglang)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.compute.sglang.hicache_config import extra_config
from engine.compute.sglang.runner import GPURequired, SGLangRunnerConfig, SGLangRunnerError
from engine.data.kv.errors import KVConfigError
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


# The free-form params hole: `hicache` reached SGLang's `dynamic` backend loader (which imports
# `module_path` and builds `class_name`), and `sglang` reached any ServerArgs field. Each attack is
# refused twice: by validation on the role (what the editor and REST report), and by the runner's
# config builder (a role that never went through validation).
HICACHE_ATTACKS = [
    ({"module_path": "os", "class_name": "system"}, "module_path"),
    ({"class_name": "Evil"}, "class_name"),
    ({"backend_name": "other"}, "backend_name"),
    ({"interface_v1": 0}, "interface_v1"),
    ({"store": "someone-elses"}, "store"),
    ({"nonsense": 1}, "nonsense"),
]
SGLANG_ATTACKS = [
    ({"trust_remote_code": True}, "trust_remote_code"),
    ({"tokenizer_path": "/etc"}, "tokenizer_path"),
    ({"host": "0.0.0.0"}, "host"),
    ({"dist_init_addr": "evil:1234"}, "dist_init_addr"),
    ({"crash_dump_folder": "/tmp/x"}, "crash_dump_folder"),
    ({"model_path": "/elsewhere"}, "model_path"),
    ({"hicache_storage_backend_extra_config": "{}"}, "hicache_storage_backend_extra_config"),
    ({"tp_size": 8}, "tp_size"),
]


def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    return tmp_path


def role_of(tmp_path: Path, **params: object) -> RoleSpec:
    return RoleSpec(name="llm", kind="sglang_llm", model=str(checkpoint(tmp_path)), device="cuda", params=params)


def validation_messages(tmp_path: Path, params: dict) -> list[str]:
    with pytest.raises(GraphValidationError) as info:
        validate(sglang_chat(checkpoint(tmp_path), params).to_spec(), default_kinds())
    assert all(issue.role == "llm" for issue in info.value.issues)
    return [issue.message for issue in info.value.issues]


@pytest.mark.parametrize(("options", "name"), HICACHE_ATTACKS)
def test_hicache_options_cannot_name_the_backend_or_anything_unknown(tmp_path: Path, options: dict, name: str):
    [message] = validation_messages(tmp_path, {"hicache": options})
    assert message.startswith("role 'llm': params.hicache:") and repr(name) in message
    with pytest.raises(SGLangRunnerError, match=f"params.hicache: .*{name!r}"):
        SGLangRunnerConfig.from_role(role_of(tmp_path, hicache=options))
    # A config built by hand (no validation at all) is refused where the extra config is built.
    with pytest.raises(SGLangRunnerError, match=f"`hicache` params: .*{name!r}"):
        SGLangRunnerConfig(model_path=str(tmp_path), hicache=options).engine_kwargs()
    with pytest.raises(KVConfigError, match=repr(name)):
        extra_config(options)


@pytest.mark.parametrize(("settings", "name"), SGLANG_ATTACKS)
def test_sglang_passthrough_takes_only_whitelisted_engine_settings(tmp_path: Path, settings: dict, name: str):
    [message] = validation_messages(tmp_path, {"sglang": settings})
    assert message.startswith("role 'llm': params.sglang:") and repr(name) in message
    with pytest.raises(SGLangRunnerError, match=f"params.sglang: .*{name!r}"):
        SGLangRunnerConfig.from_role(role_of(tmp_path, sglang=settings))
    with pytest.raises(SGLangRunnerError, match=f"`sglang` params \\[{name!r}\\] are not engine settings"):
        SGLangRunnerConfig(model_path=str(tmp_path), sglang=settings).engine_kwargs()


def test_whitelisted_settings_reach_the_engine_and_the_fixed_keys_stay_the_runners(tmp_path: Path):
    options = {"host_capacity_bytes": 1 << 20, "disk_path": str(tmp_path / "kv"), "disk_capacity_bytes": 1 << 24}
    settings = {"attention_backend": "triton", "chunked_prefill_size": -1, "max_running_requests": 8,
                "skip_tokenizer_init": True, "hicache_write_policy": "write_back"}
    validate(sglang_chat(checkpoint(tmp_path), {"hicache": options, "sglang": settings}).to_spec(), default_kinds())
    kwargs = SGLangRunnerConfig.from_role(role_of(tmp_path, hicache=options, sglang=settings)).engine_kwargs()
    assert {k: kwargs[k] for k in settings} == settings
    assert json.loads(kwargs["hicache_storage_backend_extra_config"]) == {
        **options, "backend_name": "omniflow", "module_path": "engine.compute.sglang.hicache",
        "class_name": "OmniFlowHiCacheStorage", "interface_v1": 1}
    assert kwargs["model_path"] == str(tmp_path.resolve()) and kwargs["hicache_storage_backend"] == "dynamic"
    assert extra_config(store="in-process")["store"] == "in-process"  # the runner's own key, not an option


def test_sizes_past_their_maximum_are_issues_on_the_role(tmp_path: Path):
    messages = " | ".join(validation_messages(tmp_path, {"hicache": {"host_capacity_bytes": 1 << 50},
                                                         "sglang": {"max_running_requests": 1 << 20}}))
    assert "params.hicache.host_capacity_bytes" in messages and "params.sglang.max_running_requests" in messages
