"""An `llm` role backed by `sglang.Engine` (GPU only), with our HiCache backend as its L3.

`SGLangLLMUnit(role)` is a compute unit with the native `llm` unit's node interface
(`engine.compute.llm.unit.LLMUnit`) for the `llm` node kind: `prompt` (text) or `tokens` in,
`text`, `tokens` and `kv` out, one frame per decoded chunk when streaming (`text` delta,
new `tokens`, `kv` on the last frame). Its `kv` value (a `KVRef` without a layout or holder:
SGLang's own cache is not pulled from) names the pages by our page keys,
which are SGLang's own (`engine.data.kv.keys`, checked by `tests/sglang/test_keys.py`), so
they are the keys under which SGLang stored the pages in our backend. Not served here:
`llm.prefill`/`llm.decode` (SGLang's own PD mode does that with the `omniflow` transfer
backend), `session`, `tenant` (SGLang's cache salt changes its page keys), calls of a run with a
tenant (`NodeCall.tenant`: its cache would be shared between tenants) and the multimodal
`items`/`embeds` inputs; such calls fail with
`SGLangRunnerError` rather than run differently.

The engine is built with hierarchical caching on, `hicache_storage_backend="dynamic"` and
the extra config of `engine.compute.sglang.hicache` (our `OmniFlowHiCacheStorage`), and with
incremental streaming. Role params (all optional; `model` is a local checkpoint dir):

* `page_size` (16), `mem_fraction_static` (0.5), `hicache_ratio` (2.0),
  `hicache_mem_layout` (`page_first`), `seed`;
* `hicache`: a dict of our backend's options (`host_capacity_bytes`, `disk_path`, `redis_url`, ...;
  `engine.compute.kinds.SGLANG_HICACHE_PARAMS`); which backend SGLang loads is not one of them;
* `sglang`: a dict of further `ServerArgs` fields, only the engine settings
  `engine.compute.kinds.SGLANG_ENGINE_PARAMS` lists (nothing naming code, a path or a host).

`from_role` checks the params against the role kind's schema, as validation does, and
`engine_kwargs` checks the `sglang` names again (defence in depth: a role that skipped
validation, or a config built by hand, still cannot make SGLang load code or touch a path).

`sglang` is imported only when a unit is built, after the GPU check: on a machine without
CUDA (or a role whose device is not `cuda`) the constructor raises `GPURequired`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from engine.compute.context import UnitContext
from engine.compute.kinds import SGLANG_ENGINE_PARAMS, SGLANG_ROLE_PARAMS
from engine.compute.prompts import call_prompt
from engine.compute.sampling import SamplingParams, SamplingParamsError
from engine.compute.sglang import hicache_config
from engine.data.kv.errors import KVConfigError
from engine.data.kv.keys import page_hashes
from engine.data.kv.ref import KVRef
from engine.spec.calls import ComputeUnit, NodeCall, NodeContext, NodeResult, map_frame, map_outputs
from engine.spec.graph import RoleSpec
from engine.spec.progress import ProgressMeter
from engine.spec.usage import Usage

SAMPLING_PARAMS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
)
_UNSUPPORTED_INPUTS = ("kv", "items", "embeds")
ENGINE_SETTINGS = tuple(SGLANG_ENGINE_PARAMS["properties"])
"""The `ServerArgs` fields a role's `sglang` param may set."""


class SGLangRunnerError(Exception):
    """A role or node call the SGLang runner cannot serve; the message says why."""


class GPURequired(SGLangRunnerError):
    """SGLang's model engine runs on CUDA GPUs only (its kernels ship for CUDA only)."""


def require_gpu(device: str) -> int:
    """The CUDA device index for `device` (`cuda` or `cuda:N`); `GPURequired` when there is none."""
    import torch

    if not device.startswith("cuda"):
        raise GPURequired(f"the sglang llm runner needs a GPU: role device is {device!r}, not 'cuda'")
    if not torch.cuda.is_available():
        raise GPURequired("the sglang llm runner needs a GPU: torch sees no CUDA device on this machine")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise GPURequired(f"the sglang llm runner was given {device!r}, but only {torch.cuda.device_count()} GPUs are visible")
    return index


@dataclass(frozen=True, slots=True)
class SGLangRunnerConfig:
    """The engine's settings, from a role (`from_role`); `engine_kwargs()` are `sglang.Engine`'s."""

    model_path: str
    gpu_id: int = 0
    page_size: int = 16
    mem_fraction_static: float = 0.5
    hicache_ratio: float = 2.0
    hicache_mem_layout: str = "page_first"
    seed: int | None = None
    hicache: dict[str, Any] = field(default_factory=dict)
    sglang: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_role(cls, role: RoleSpec, gpu_id: int = 0) -> SGLangRunnerConfig:
        if not role.model or not Path(role.model).is_dir():
            raise SGLangRunnerError(f"sglang llm role {role.name!r} needs `model`: a local checkpoint directory")
        problems = [f"params{''.join(f'.{p}' for p in err.absolute_path)}: {err.message}"
                    for err in jsonschema.Draft202012Validator(SGLANG_ROLE_PARAMS).iter_errors(role.params)]
        if problems:
            raise SGLangRunnerError(f"sglang llm role {role.name!r}: {'; '.join(problems)}")
        return cls(model_path=str(Path(role.model).resolve()), gpu_id=gpu_id, **role.params)

    def engine_kwargs(self) -> dict[str, Any]:
        """`sglang.Engine(**kwargs)` for this config: our HiCache backend as the storage tier."""
        refused = sorted(set(self.sglang) - set(ENGINE_SETTINGS))
        if refused:
            raise SGLangRunnerError(f"`sglang` params {refused} are not engine settings a role may set"
                                    f" (allowed: {list(ENGINE_SETTINGS)})")
        try:
            extra = hicache_config.extra_config(self.hicache)
        except KVConfigError as exc:
            raise SGLangRunnerError(f"`hicache` params: {exc}") from exc
        kwargs: dict[str, Any] = {
            "model_path": self.model_path,
            "device": "cuda",
            "base_gpu_id": self.gpu_id,
            "page_size": self.page_size,
            "mem_fraction_static": self.mem_fraction_static,
            "enable_hierarchical_cache": True,
            "hicache_ratio": self.hicache_ratio,
            "hicache_mem_layout": self.hicache_mem_layout,
            "hicache_storage_backend": "dynamic",
            "hicache_storage_backend_extra_config": json.dumps(extra),
            # A prompt waits for its pages from our tiers instead of recomputing them.
            "hicache_storage_prefetch_policy": "wait_complete",
            "incremental_streaming_output": True,
            "enable_cache_report": True,
            "log_level": "error",
        }
        if self.seed is not None:
            kwargs["random_seed"] = self.seed
        return {**self.sglang, **kwargs}  # the runner's own settings win over any that slipped through


def sglang_sampling(node_id: str, params: dict[str, Any]) -> dict[str, Any]:
    """SGLang's `sampling_params` for an `llm` node's params, checked by our `SamplingParams`."""
    picked = {k: v for k, v in params.items() if k in SAMPLING_PARAMS}
    for key in ("stop", "stop_token_ids"):
        if key in picked:
            picked[key] = tuple(picked[key])
    try:
        ours = SamplingParams(**picked)
    except (TypeError, SamplingParamsError) as exc:
        raise SGLangRunnerError(f"node {node_id!r}: {exc}") from exc
    sampling: dict[str, Any] = {
        "max_new_tokens": ours.max_new_tokens,
        "temperature": ours.temperature,
        "top_p": ours.top_p,
        "top_k": ours.top_k or -1,  # ours: 0 is off; SGLang's: -1
        "min_p": ours.min_p,
        "repetition_penalty": ours.repetition_penalty,
        "frequency_penalty": ours.frequency_penalty,
        "presence_penalty": ours.presence_penalty,
        "ignore_eos": ours.ignore_eos,
    }
    if ours.stop:
        sampling["stop"] = list(ours.stop)
    if ours.stop_token_ids:
        sampling["stop_token_ids"] = list(ours.stop_token_ids)
    if ours.seed is not None:
        sampling["sampling_seed"] = ours.seed
    return sampling


def prompt_of(call: NodeCall) -> str | list[int]:
    """The call's `prompt` (text) or `tokens`; exactly one must be given."""
    for name in _UNSUPPORTED_INPUTS:
        if call.inputs.get(name) is not None:
            raise SGLangRunnerError(f"node {call.node_id!r}: the sglang runner does not take input {name!r}")
    if tuple(call.output_ports) == ("kv",):
        raise SGLangRunnerError(f"node {call.node_id!r}: llm.prefill runs on SGLang's own PD mode, not this runner")
    for name in ("session", "session_history", "session_turns", "tenant"):
        if call.params.get(name) is not None:
            raise SGLangRunnerError(f"node {call.node_id!r}: param {name!r} is not supported by the sglang runner")
    if call.tenant is not None:
        raise SGLangRunnerError(f"node {call.node_id!r}: the sglang runner keeps one prefix cache for every caller,"
                                " so it serves only runs without a tenant (not the studio's)")
    return call_prompt(call, SGLangRunnerError)


class SGLangLLMUnit(ComputeUnit):
    """The `llm` node kind on `sglang.Engine` (one engine per unit, owned and shut down by it)."""

    def __init__(self, role: RoleSpec, ctx: UnitContext | None = None) -> None:
        """`ctx`: unused (SGLang keeps its own weights and KV pages, in its own processes)."""
        gpu_id = require_gpu(role.device)
        self.role = role
        self.config = SGLangRunnerConfig.from_role(role, gpu_id)
        import sglang

        self.engine = sglang.Engine(**self.config.engine_kwargs())
        self.model_id = Path(self.config.model_path).name
        self._stats = {"requests": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0, "storage_cached_tokens": 0.0,
                       "output_tokens": 0.0}

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        tokenizer = self.engine.tokenizer_manager.tokenizer
        if tokenizer is None:
            raise SGLangRunnerError("text prompts need the model's tokenizer (skip_tokenizer_init is set)")
        return list(tokenizer.encode(prompt))

    async def _generate(self, call: NodeCall, stream: bool) -> AsyncIterator[tuple[dict[str, Any], list[int]]]:
        ids = self._encode(prompt_of(call))
        kwargs: dict[str, Any] = {"input_ids": ids, "sampling_params": sglang_sampling(call.node_id, call.params),
                                  "stream": stream}
        if stream:
            async for out in await self.engine.async_generate(**kwargs):
                yield out, ids
        else:
            yield await self.engine.async_generate(**kwargs), ids

    def _kv_ref(self, out: dict[str, Any], prompt_ids: list[int], output_ids: list[int]) -> KVRef:
        ref = kv_ref(out, self.model_id, self.config.page_size, prompt_ids, output_ids)
        self._stats["requests"] += 1
        self._stats["prompt_tokens"] += ref.prompt_tokens
        self._stats["cached_tokens"] += ref.cached_tokens
        self._stats["storage_cached_tokens"] += ref.cached_tokens_details.get("storage", 0)
        self._stats["output_tokens"] += len(output_ids)
        return ref

    @staticmethod
    def _meter(call: NodeCall, ctx: NodeContext) -> ProgressMeter:
        """Tokens generated out of the node's `max_new_tokens`, as the llm unit reports them."""
        total = sglang_sampling(call.node_id, call.params)["max_new_tokens"]
        return ProgressMeter(ctx.progress, total, "tokens").start()

    async def execute(self, call: NodeCall, ctx: NodeContext) -> NodeResult:
        values: dict[str, Any] = {}
        meter = self._meter(call, ctx)
        async for out, ids in self._generate(call, stream=False):
            output_ids = list(out["output_ids"])
            meter.advance(len(output_ids) - meter.done)  # a whole output: its ids so far
            values = {"text": out.get("text") or "", "tokens": output_ids, "kv": self._kv_ref(out, ids, output_ids),
                      "usage": _usage(out, ids, output_ids)}
        ports = call.output_ports
        value = values[ports[0]] if len(ports) == 1 else {p: values[p] for p in ports if p in values}
        return NodeResult(outputs=map_outputs(value, ports, call.node_id))

    async def execute_stream(self, call: NodeCall, ctx: NodeContext) -> AsyncIterator[dict[str, Any]]:
        generated: list[int] = []
        meter = self._meter(call, ctx)
        async for out, ids in self._generate(call, stream=True):
            new = list(out["output_ids"])
            generated += new
            meter.advance(len(new))
            frame: dict[str, Any] = {"text": out.get("text") or "", "tokens": new}
            if out.get("meta_info", {}).get("finish_reason") is not None:
                frame["kv"] = self._kv_ref(out, ids, generated)
                frame["usage"] = _usage(out, ids, generated)
            yield map_frame({p: v for p, v in frame.items() if p in call.output_ports}, call.output_ports,
                            call.node_id)

    async def flush_device_cache(self) -> bool:
        """Drop the device (and host) radix cache; pages stay in our storage tier. False while busy."""
        result = await self.engine.tokenizer_manager.flush_cache()
        return bool(result.success)

    def metrics(self) -> dict[str, float]:
        return dict(self._stats)

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)


def kv_ref(out: dict[str, Any], model_id: str, page_size: int, prompt_ids: list[int], output_ids: list[int]) -> KVRef:
    """The `kv` value of SGLang's last output `out` of a request: no layout and no holder (SGLang's
    own cache is not pulled from), pages by our keys. Raises `SGLangRunnerError` when it aborted."""
    meta = out.get("meta_info", {})
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise SGLangRunnerError(f"generation aborted: {finish.get('message', finish)}")
    details = meta.get("cached_tokens_details") or {}
    return KVRef(
        model_id=model_id,
        page_size=page_size,
        # Full pages of the prompt and the output but its last token (which has no KV yet).
        page_hashes=tuple(page_hashes(prompt_ids + output_ids[:-1], page_size)),
        prompt_ids=tuple(prompt_ids),
        output_ids=tuple(output_ids),
        tokens=len(prompt_ids) + len(output_ids),
        prompt_tokens=len(prompt_ids),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        cached_tokens_details={k: v for k, v in details.items() if isinstance(v, int)},
    )


def _usage(out: dict[str, Any], prompt_ids: list[int], output_ids: list[int]) -> dict[str, Any]:
    """The `usage` output (`engine.spec.usage`) of SGLang's last output of a request."""
    meta = out.get("meta_info", {})
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    if reason not in ("stop", "length"):
        raise SGLangRunnerError(f"a generation that ended as {finish!r} has no usage")
    return Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(output_ids),
                 cached_tokens=int(meta.get("cached_tokens", 0)), finish_reason=reason).to_value()
