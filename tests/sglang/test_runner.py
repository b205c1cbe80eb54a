"""The SGLang role runner and its bench script on this CPU machine: the GPU check, and the
engine kwargs and sampling params checked against the installed SGLang's own types."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams
from sglang.srt.server_args import ServerArgs

from engine.bench import sglang as sglang_bench
from engine.compute.sglang import runner
from engine.data.kv.keys import page_hashes
from engine.data.kv.ref import KVRef
from engine.spec.calls import NodeCall
from engine.spec.graph import RoleSpec

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error paths")


def role(tmp_path: Path, device: str = "cuda", **params: object) -> RoleSpec:
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    return RoleSpec(name="chat", kind="llm", model=str(tmp_path), device=device, params=dict(params))


def call(inputs: dict, params: dict | None = None, ports: tuple[str, ...] = ("text", "tokens", "kv")) -> NodeCall:
    return NodeCall("r", "n", None, params or {}, inputs, ports, False, False, 0, 0)


def test_module_import_does_not_import_sglang() -> None:
    code = "import sys, engine.compute.sglang.runner; print('sglang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "False"


def test_unit_on_cpu_says_a_gpu_is_needed(tmp_path: Path) -> None:
    with pytest.raises(runner.GPURequired, match="needs a GPU: torch sees no CUDA device"):
        runner.SGLangLLMUnit(role(tmp_path))
    with pytest.raises(runner.GPURequired, match="needs a GPU: role device is 'cpu'"):
        runner.SGLangLLMUnit(role(tmp_path, device="cpu"))


def test_engine_kwargs_are_server_args_fields(tmp_path: Path) -> None:
    config = runner.SGLangRunnerConfig.from_role(
        role(tmp_path, page_size=32, hicache={"host_capacity_bytes": 1 << 20}, sglang={"attention_backend": "triton"}),
        gpu_id=1,
    )
    kwargs = config.engine_kwargs()
    server_args = ServerArgs(**kwargs)  # what sglang.Engine(**kwargs) builds first: unknown names fail here
    assert server_args.hicache_storage_backend == "dynamic" and server_args.incremental_streaming_output
    assert kwargs["page_size"] == 32 and kwargs["base_gpu_id"] == 1 and kwargs["attention_backend"] == "triton"
    assert kwargs["enable_hierarchical_cache"] and kwargs["hicache_storage_backend"] == "dynamic"
    extra = json.loads(kwargs["hicache_storage_backend_extra_config"])
    assert extra["module_path"] == "engine.compute.sglang.hicache"
    assert extra["class_name"] == "OmniFlowHiCacheStorage" and extra["host_capacity_bytes"] == 1 << 20


def test_bad_role_params_are_refused(tmp_path: Path) -> None:
    with pytest.raises(runner.SGLangRunnerError, match="'capacity' was unexpected"):
        runner.SGLangRunnerConfig.from_role(role(tmp_path, capacity=4))
    with pytest.raises(runner.SGLangRunnerError, match="params.sglang: .*'model_path' was unexpected"):
        runner.SGLangRunnerConfig.from_role(role(tmp_path, sglang={"model_path": "x"}))
    with pytest.raises(runner.SGLangRunnerError, match="not engine settings a role may set"):
        runner.SGLangRunnerConfig(model_path=str(tmp_path), sglang={"trust_remote_code": True}).engine_kwargs()
    with pytest.raises(runner.SGLangRunnerError, match="local checkpoint directory"):
        runner.SGLangRunnerConfig.from_role(RoleSpec(name="chat", kind="llm", model="tiny-llama", device="cuda"))


def test_the_whitelisted_engine_settings_are_server_args_fields(tmp_path: Path) -> None:
    """Each name a role's `sglang` param may set is a field of the installed SGLang's ServerArgs, and
    the names it leaves out on purpose (code, paths, hosts) are real fields too: the whitelist is
    what keeps them out, not a spelling."""
    fields = set(inspect.signature(ServerArgs).parameters)
    assert set(runner.ENGINE_SETTINGS) <= fields
    assert {"trust_remote_code", "tokenizer_path", "host", "dist_init_addr", "crash_dump_folder"} <= fields
    assert not {"trust_remote_code", "tokenizer_path", "host"} & set(runner.ENGINE_SETTINGS)


def test_sampling_params_are_sglangs() -> None:
    sampling = runner.sglang_sampling("n", {"max_new_tokens": 8, "temperature": 0.7, "top_k": 0, "top_p": 0.9,
                                            "seed": 5, "stop": ["\n"], "stop_token_ids": [2], "tenant": None})
    parsed = SGLangSamplingParams(**sampling)
    parsed.verify(64)
    assert parsed.max_new_tokens == 8 and parsed.top_k == 1 << 30 and parsed.sampling_seed == 5
    assert runner.sglang_sampling("n", {"top_k": 4})["top_k"] == 4
    with pytest.raises(runner.SGLangRunnerError, match="top_p"):
        runner.sglang_sampling("n", {"top_p": 0})


def test_calls_it_cannot_serve_fail_clearly() -> None:
    assert runner.prompt_of(call({"tokens": [1, 2, 3]})) == [1, 2, 3]
    assert runner.prompt_of(call({"prompt": "hi"})) == "hi"
    for bad, message in [
        (call({}), "exactly one"),
        (call({"prompt": "a", "tokens": [1]}), "exactly one"),
        (call({"kv": {"pages": []}}), "input 'kv'"),
        (call({"prompt": "a"}, ports=("kv",)), "llm.prefill"),
        (call({"prompt": "a"}, {"session": "s"}), "'session'"),
        (call({"prompt": "a"}, {"tenant": "t"}), "'tenant'"),
        (dataclasses.replace(call({"prompt": "a"}), tenant="user:1"), "without a tenant"),  # one cache for all
        (call({"tokens": ["x"]}), "list of token ids"),
    ]:
        with pytest.raises(runner.SGLangRunnerError, match=message):
            runner.prompt_of(bad)


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sglang_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_kv_value_names_the_full_pages_of_prompt_and_output_but_the_last_token() -> None:
    prompt, output = list(range(1, 21)), [30, 31, 32, 33, 34]  # 24 tokens with KV: three pages of 8
    out = {"meta_info": {"finish_reason": {"type": "length"}, "cached_tokens": 8,
                         "cached_tokens_details": {"device": 8, "host": 0, "storage": 0, "source": "x"}}}
    ref = runner.kv_ref(out, "m", 8, prompt, output)
    assert ref == KVRef(model_id="m", page_size=8, page_hashes=tuple(page_hashes([*prompt, 30, 31, 32, 33], 8)),
                        prompt_ids=tuple(prompt), output_ids=tuple(output), tokens=25, prompt_tokens=20,
                        cached_tokens=8, cached_tokens_details={"device": 8, "host": 0, "storage": 0})
    assert len(ref.page_hashes) == 3 and ref.layout is None and ref.holder is None
    with pytest.raises(runner.SGLangRunnerError, match="generation aborted: out of memory"):
        runner.kv_ref({"meta_info": {"finish_reason": {"type": "abort", "message": "out of memory"}}}, "m", 8,
                      prompt, output)


def test_bench_arguments_and_cpu_exit() -> None:
    args = bench_args("--prompts", "3", "--prompt-tokens", "64", "--shared-prefix", "32")
    assert (args.prompts, args.prompt_tokens, args.shared_prefix, args.timeout_s) == (3, 64, 32, 450.0)
    assert args.timeout_s < 8 * 60
    with pytest.raises(SystemExit, match="--shared-prefix must be between"):
        sglang_bench.check_arguments(bench_args("--shared-prefix", "600", "--prompt-tokens", "512"))
    with pytest.raises(SystemExit, match="needs a GPU"):
        sglang_bench.run(bench_args("--prompts", "2"))
    prompts = sglang_bench.make_prompts(3, 64, 32, 512, seed=1)
    assert len({tuple(p[:32]) for p in prompts}) == 1 and len({tuple(p) for p in prompts}) == 3
    assert all(len(p) == 64 and 3 <= min(p) and max(p) < 512 for p in prompts)


def test_bench_seeded_checkpoint_reads_as_sglang_model(tmp_path: Path) -> None:
    from sglang.srt.configs.model_config import ModelConfig

    directory = sglang_bench.build_seeded_checkpoint(tmp_path / "seeded", seed=0)
    config = ModelConfig(str(directory))
    assert (config.num_attention_heads, config.head_dim, config.get_num_kv_heads(1)) == (8, 64, 4)
    assert config.dtype == torch.bfloat16
