"""The compute layer's kinds: the `llm` role kind and the `llm`, `llm.prefill`, `llm.decode` node kinds.

`register(registry)` is the `omniflow.kinds` entry point named `llm`; it adds the kinds
to a `KindRegistry` (built per process by `engine.spec.kinds.default_kinds`). The runner
is named lazily, so the catalogue costs no model import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.spec.graph import PortSpec
from engine.spec.kinds import MAX_CAPACITY, InputChoice, KindRegistry, NodeKind, RoleKind, RoleModels

# Hard ceilings of the values that size memory or processes: the engine refuses more than
# these whoever asks (a studio's per-user quotas are lower; see studio/workflows/quotas.py).
MAX_PAGE_SIZE = 4096
MAX_RUNNING = 4096
MAX_PREFILL_TOKENS = 1 << 20
MAX_DEVICE_PAGES = 1 << 22
MAX_HOST_PAGES = 1 << 24
MAX_DISK_PAGES = 1 << 26
MAX_NEW_TOKENS = 1 << 20
MAX_DIFFUSION_STEPS = 1000

LLM_ROLE_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "capacity": {"type": "integer", "minimum": 1, "maximum": MAX_CAPACITY, "default": 64,
                     "description": "node executions one replica accepts at once (the engine batches them)"},
        "page_size": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_SIZE, "default": 16,
                      "description": "tokens per KV page"},
        "max_running": {"type": "integer", "minimum": 1, "maximum": MAX_RUNNING, "default": 32, "description": "sequences batched at once"},
        "max_prefill_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_PREFILL_TOKENS, "default": 2048,
                               "description": "prompt tokens computed per step (chunked prefill)"},
        "device_pages": {"type": "integer", "minimum": 1, "maximum": MAX_DEVICE_PAGES, "default": 4096,
                         "description": "device-tier KV pages"},
        "host_pages": {"type": "integer", "minimum": 1, "maximum": MAX_HOST_PAGES, "description": "host-tier KV pages (none: no host tier)"},
        "disk_path": {"type": "string", "minLength": 1,
                      "description": "directory of the disk (SSD) tier; each worker takes a free slot file there,"
                      " a replacement the one its predecessor left, with its pages (needs disk_pages)"},
        "disk_pages": {"type": "integer", "minimum": 1, "maximum": MAX_DISK_PAGES, "description": "disk-tier KV pages per worker"},
        "eviction": {"type": "string", "enum": ["lru", "lfu"], "default": "lru",
                     "description": "which page a full tier lets go first: least recently or least often used"},
        "write_policy": {"type": "string", "enum": ["write_back", "write_through"], "default": "write_back",
                         "description": "write_back: a page goes down a tier when evicted; write_through: to every"
                         " lower tier as it is written"},
        "prefix_cache": {"type": "boolean", "default": True, "description": "reuse cached prompt prefixes"},
        "dtype": {"type": "string", "enum": ["float32", "bfloat16"], "default": "float32",
                  "description": "dtype of the weights, activations and KV cache (bfloat16: half the memory and"
                  " weight reads; fast where the CPU has AVX512-BF16/AMX, slow where it does not)"},
        "session_ttl_s": {"type": "number", "exclusiveMinimum": 0, "default": 600,
                          "description": "how long an idle session keeps its KV pinned"},
        "seed": {"type": "integer", "minimum": 0, "description": "seed of requests that carry none"},
        "packed_weights": {"type": "boolean",
                           "description": "bfloat16 on a CPU with AVX512-BF16/AMX: keep the weights in oneDNN's packed"
                           " layout too (faster products; a second copy of the weights in each worker). Unset: only"
                           " where the worker's weights are not one copy its host shares among processes"},
        "packed_float32": {"type": "boolean",
                           "description": "float32: keep a copy in oneDNN's packed layout of the weights whose decode"
                           " products were measured faster over it (a second copy of those weights in each worker)."
                           " Unset: only where the worker's weights are not one copy its host shares among"
                           " processes"},
        "handoff_lease_s": {"type": "number", "exclusiveMinimum": 0, "default": 60,
                            "description": "llm.prefill: how long the prompt's pages stay held for a decode"
                            " node that never comes for them"},
        "kv_pull_timeout_s": {"type": "number", "exclusiveMinimum": 0, "default": 10,
                              "description": "deadline of pulling KV pages from another worker"},
        "tp_timeout_s": {"type": "number", "exclusiveMinimum": 0, "default": 10,
                         "description": "tp_size > 1: deadline of one collective between the ranks (a stuck"
                         " rank fails the replica's calls after it; a dead one at once)"},
    },
    "dependentRequired": {"disk_path": ["disk_pages"], "disk_pages": ["disk_path"]},
    "additionalProperties": False,
}

LLM_NODE_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "max_new_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_NEW_TOKENS, "default": 16},
        "temperature": {"type": "number", "minimum": 0, "default": 0, "description": "0: greedy"},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
        "top_k": {"type": "integer", "minimum": 0, "default": 0, "description": "0: off"},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1, "default": 0},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "default": 1},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0},
        "seed": {"type": "integer", "minimum": 0, "description": "same seed, same tokens"},
        "stop": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "ignore_eos": {"type": "boolean", "default": False},
        "session": {"type": "string", "minLength": 1,
                    "description": "run as a turn of this server-side session; send only the new message"},
        "session_history": {
            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer", "minimum": 0}}],
            "description": "with session: what the session holds before this turn (text or token ids); a"
                           " worker that does not hold the session (begun on a replica since lost) opens it with"
                           " this history instead of none",
        },
        "session_turns": {"type": "integer", "minimum": 0,
                          "description": "with session_history: how many turns it holds; a worker whose copy of"
                          " the session has another number replaces it with the history"},
        "tenant": {"type": "string", "minLength": 1,
                   "description": "cache salt of a run without a tenant (the command line): tenants never share KV;"
                                  " a run's own tenant (the studio's) overrides it"},
    },
    "dependentRequired": {"session_history": ["session"], "session_turns": ["session_history"]},
    "additionalProperties": False,
}


LLM_PREFILL_PARAMS: dict[str, Any] = {
    **{k: v for k, v in LLM_NODE_PARAMS.items() if k != "dependentRequired"},  # their params hold no session
    "description": "Sampling params apply to the first token; llm.decode continues with them.",
    "properties": {k: v for k, v in LLM_NODE_PARAMS["properties"].items()
                   if k not in ("session", "session_history", "session_turns")},
}

LLM_DECODE_PARAMS: dict[str, Any] = {
    **{k: v for k, v in LLM_NODE_PARAMS.items() if k != "dependentRequired"},  # their params hold no session
    "description": "Given sampling params override those the prefill node sampled its first token with.",
    "properties": {
        k: {key: val for key, val in v.items() if key != "default"}
        for k, v in LLM_NODE_PARAMS["properties"].items()
        if k not in ("session", "session_history", "session_turns", "tenant")
    },
}

_PROMPT_INPUTS = {
    "prompt": PortSpec(type="text", optional=True, description="text prompt (or the new message)"),
    "tokens": PortSpec(type="tokens", optional=True, description="prompt as token ids"),
}

PROMPT_CHOICE = InputChoice(ports=("prompt", "tokens"), what="a prompt")
"""An llm node's prompt: text or token ids (`engine.compute.prompts.call_prompt` reads exactly one;
media items only ride along with it)."""

_MEDIA_INPUTS = {
    "items": PortSpec(type="json", optional=True,
                      description="encoder items {kind, hash, length, hidden} (one, or a list: join all), spliced"
                      " at the prompt's <|image|>/<|audio|> markers in order (no markers: in front)"),
    "embeds": PortSpec(type="tensor", optional=True,
                       description="the items' (length, hidden) embeddings, aligned with items"),
}


def llm_tp_problems(model: str | None, tp_size: int) -> list[str]:
    """Why `model` (a built-in name or a checkpoint directory) cannot be split over `tp_size`
    ranks Megatron-style (`engine.compute.tp.shard`): query heads and MLP width must divide,
    and KV heads must divide or be divided by `tp_size`. A model that cannot be read here
    (no such directory yet) has no known problem; loading it will tell."""
    shape = _model_shape(model)
    if shape is None:
        return []
    heads, kv_heads, inter = shape
    problems = []
    if heads % tp_size:
        problems.append(f"model {model!r} has {heads} attention heads, not divisible by {tp_size}")
    if kv_heads % tp_size and tp_size % kv_heads:
        problems.append(f"model {model!r} has {kv_heads} KV heads: neither a multiple nor a divisor of {tp_size}")
    if inter % tp_size:
        problems.append(f"model {model!r} has MLP width {inter}, not divisible by {tp_size}")
    return problems


def _model_shape(model: str | None) -> tuple[int, int, int] | None:
    """(attention heads, KV heads, MLP width) of a built-in model or a checkpoint's config.json."""
    from engine.compute.models.catalog import BUILTIN_MODELS
    from engine.compute.models.packaged import PACKAGED_MODELS

    if model is None:
        return None
    if model in BUILTIN_MODELS or model in PACKAGED_MODELS:
        cfg = BUILTIN_MODELS.get(model) or PACKAGED_MODELS[model]
        return cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        heads = int(config["num_attention_heads"])
        return heads, int(config.get("num_key_value_heads", heads)), int(config["intermediate_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable here: the worker's loader reports it with its own error


MAX_HICACHE_HOST_BYTES = 1 << 40
MAX_HICACHE_DISK_BYTES = 1 << 44
MAX_HICACHE_RATIO = 16
"""SGLang's host pool is `hicache_ratio` times its device pool: at most this many (at least one:
SGLang refuses a host pool smaller than the device pool)."""
MAX_SGLANG_TOTAL_TOKENS = 1 << 26
MAX_SGLANG_CONTEXT = 1 << 20

SGLANG_HICACHE_PARAMS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "description": "options of Omni-Flow's HiCache backend (engine.compute.sglang.hicache); which module SGLang"
                   " loads as its storage backend is fixed by the runner, not an option",
    "properties": {
        "host_capacity_bytes": {"type": "integer", "minimum": 1, "maximum": MAX_HICACHE_HOST_BYTES,
                                "description": "bytes of the backend's host tier (default 1 GiB)"},
        "disk_path": {"type": "string", "minLength": 1,
                      "description": "directory of the backend's disk tier (none: no disk tier)"},
        "disk_capacity_bytes": {"type": "integer", "minimum": 1, "maximum": MAX_HICACHE_DISK_BYTES,
                                "description": "bytes of the disk tier (default 8 GiB)"},
        "redis_url": {"type": "string", "minLength": 1,
                      "description": "publish page residency to this Redis KV index (the operator's setting)"},
        "worker_id": {"type": "string", "minLength": 1, "description": "this worker's name in the KV index"},
        "index_namespace": {"type": "string", "minLength": 1, "description": "the KV index's key prefix"},
        "worker_ttl_s": {"type": "number", "exclusiveMinimum": 0, "description": "KV index registration TTL"},
    },
}
"""`sglang_llm`'s `hicache` param: the backend's options, whitelisted (`hicache_config.extra_config`
refuses any other name, and never lets one replace its fixed keys)."""

_ENGINE_SETTING = {"type": "string", "pattern": "^[a-z0-9_]+$"}

SGLANG_ENGINE_PARAMS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "description": "further sglang ServerArgs fields: only these engine settings (nothing naming code, a path,"
                   " a host, a tokenizer or a log/dump folder, and nothing the runner sets itself)",
    "properties": {
        "attention_backend": {**_ENGINE_SETTING, "description": "one of SGLang's attention kernels by name"},
        "chunked_prefill_size": {"type": "integer", "minimum": -1, "maximum": MAX_PREFILL_TOKENS,
                                 "description": "-1: no chunking"},
        "max_prefill_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_PREFILL_TOKENS},
        "max_running_requests": {"type": "integer", "minimum": 1, "maximum": MAX_RUNNING},
        "max_total_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_SGLANG_TOTAL_TOKENS},
        "context_length": {"type": "integer", "minimum": 1, "maximum": MAX_SGLANG_CONTEXT},
        "schedule_policy": {"type": "string", "enum": ["lpm", "random", "fcfs", "dfs-weight", "lof"]},
        "schedule_conservativeness": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
        "num_continuous_decode_steps": {"type": "integer", "minimum": 1, "maximum": 64},
        "stream_interval": {"type": "integer", "minimum": 1, "maximum": 1024},
        "disable_cuda_graph": {"type": "boolean"},
        "disable_overlap_schedule": {"type": "boolean"},
        "skip_tokenizer_init": {"type": "boolean", "description": "token ids only: text prompts are refused"},
        "dtype": {"type": "string", "enum": ["auto", "half", "float16", "bfloat16", "float", "float32"]},
        "kv_cache_dtype": {"type": "string", "enum": ["auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16"]},
        "hicache_write_policy": {"type": "string", "enum": ["write_back", "write_through", "write_through_selective"]},
        "hicache_io_backend": {"type": "string", "enum": ["direct", "kernel"]},
    },
}
"""`sglang_llm`'s `sglang` param: the ServerArgs fields a workflow may set, whitelisted. Left out on
purpose: whatever loads code or files (`trust_remote_code`, `tokenizer_path`, `quantization_param_path`,
plug-in backends by name), listens or connects (`host`, `port`, `dist_init_addr`), writes folders
(log, dump, crash and profile dirs), sizes processes (`tp_size`, `dp_size`), and what the runner sets
(`model_path`, the HiCache storage backend and its config). `tests/sglang/test_runner.py` checks each
is a ServerArgs field of the installed SGLang."""

SGLANG_ROLE_PARAMS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "page_size": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_SIZE, "default": 16},
        "mem_fraction_static": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 0.5},
        "hicache_ratio": {"type": "number", "minimum": 1, "maximum": MAX_HICACHE_RATIO, "default": 2.0,
                          "description": "SGLang's host pool size as a multiple of its device pool (host memory"
                                         " per process: counted in the studio's HiCache host quota, which"
                                         " asks sglang.max_total_tokens to cap the device pool)"},
        "hicache_mem_layout": {"type": "string", "enum": ["layer_first", "page_first", "page_first_direct"],
                               "default": "page_first"},
        "seed": {"type": "integer"},
        "hicache": SGLANG_HICACHE_PARAMS,
        "sglang": SGLANG_ENGINE_PARAMS,
    },
}
"""Role params of `sglang_llm` (`engine.compute.sglang.runner.SGLangRunnerConfig`)."""


LLM_MODELS = RoleModels(required=True, builtin="engine.compute.builtin_models:llm_models", checkpoints=True)
"""An `llm` (and a `diffusion`) role's model: a built-in LLM or a checkpoint folder."""


_USAGE_OUTPUT = PortSpec(
    type="json", optional=True,
    description="prompt, completion and cached token counts and the finish reason ('stop' or 'length'),"
    " with the last frame (engine.spec.usage.Usage)")


def register(registry: KindRegistry) -> None:
    registry.add_role_kind(
        RoleKind(
            name="llm",
            description="A causal LLM (built-in tiny model or local checkpoint) with continuous batching over"
            " paged KV, prefix caching and sessions.",
            runner="engine.compute.llm.unit:LLMUnit",
            params_schema=LLM_ROLE_PARAMS,
            tensor_parallel="engine.compute.kinds:llm_tp_problems",
            tp_runner="engine.compute.tp.unit:TPLLMUnit",
            models=LLM_MODELS,
        )
    )
    registry.add_role_kind(
        RoleKind(
            name="sglang_llm",
            description="A causal LLM on sglang.Engine (CUDA GPUs only; `model` a local checkpoint dir) with"
            " Omni-Flow's host/disk tiers as its HiCache storage; serves `llm` nodes (no sessions, PD or media).",
            runner="engine.compute.sglang.runner:SGLangLLMUnit",
            params_schema=SGLANG_ROLE_PARAMS,
            models=RoleModels(required=True, checkpoints=True),
        )
    )
    registry.add_node_kind(
        NodeKind(
            name="llm",
            description="Generate from a text prompt or token ids; streams text and tokens, ends with a"
            " reference to the KV pages.",
            role_kinds=("llm", "sglang_llm"),
            category="model",
            params_schema=LLM_NODE_PARAMS,
            inputs={**_PROMPT_INPUTS, **_MEDIA_INPUTS},
            needs=(PROMPT_CHOICE,),
            outputs={
                "text": PortSpec(type="text", description="generated text (stream: deltas)"),
                "tokens": PortSpec(type="tokens", description="generated token ids (stream: new ones)"),
                "kv": PortSpec(type="kv", description="a KVRef: model id, KV layout, page keys of prompt + output, holder"),
                "usage": _USAGE_OUTPUT,
            },
        )
    )
    # Disaggregated serving: a prefill role computes the prompt, a decode role pulls its KV
    # pages from the prefill worker over the transfer plane and generates the rest. The unit
    # tells the three llm kinds apart by these fixed ports (`engine.compute.llm.unit.node_mode`).
    registry.add_node_kind(
        NodeKind(
            name="llm.prefill",
            description="Compute a prompt's KV and first token and hold them for an llm.decode node; outputs"
            " the handoff (page keys, first token, the holder's address).",
            role_kinds=("llm",),
            category="model",
            params_schema=LLM_PREFILL_PARAMS,
            inputs=dict(_PROMPT_INPUTS),
            needs=(PROMPT_CHOICE,),
            outputs={"kv": PortSpec(type="kv", description="a KVRef holding the prompt's pages for one llm.decode node")},
        )
    )
    registry.add_node_kind(
        NodeKind(
            name="llm.decode",
            description="Continue a prefilled prompt: pull its KV pages from the prefill worker and generate;"
            " streams text and tokens like llm.",
            role_kinds=("llm",),
            category="model",
            params_schema=LLM_DECODE_PARAMS,
            inputs={"kv": PortSpec(type="kv", description="the handoff of an llm.prefill node")},
            outputs={
                "text": PortSpec(type="text", description="generated text, first token included (stream: deltas)"),
                "tokens": PortSpec(type="tokens", description="generated token ids (stream: new ones)"),
                "kv": PortSpec(type="kv", description="a KVRef: model id, KV layout, page keys of prompt + output, holder"),
                "usage": _USAGE_OUTPUT,
            },
        )
    )
    register_multimodal(registry)


# -- encoders, diffusion, decoders -------------------------------------------------------------------

_DEVICE_NOTE = "built-in weights are seeded; roles of one model in one worker share them"

ENCODER_ROLE_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "llm": {"type": "string", "default": "tiny-llama",
                "description": "built-in LLM the embeddings feed (its hidden size is the projection's)"},
        "hidden_size": {"type": "integer", "minimum": 1, "description": "projection size (instead of llm)"},
    },
    "additionalProperties": False,
}

DIFFUSION_ROLE_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "latent_channels": {"type": "integer", "minimum": 1, "maximum": 256, "default": 4},
        "latent_size": {"type": "integer", "minimum": 1, "maximum": 1024, "default": 16, "description": "latent height = width"},
        "patch_size": {"type": "integer", "minimum": 1, "default": 2, "description": "latent cells per token a side"},
        "steps": {"type": "integer", "minimum": 1, "maximum": MAX_DIFFUSION_STEPS, "default": 20},
        "guidance_scale": {"type": "number", "minimum": 0, "default": 4.0},
        "shift": {"type": "number", "exclusiveMinimum": 0, "default": 1.0, "description": "flow-matching time shift"},
        "page_size": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_SIZE, "default": 16,
                      "description": "KV page size: that of the llm role whose prompt KV is reused"},
        "head_seed": {"type": "integer", "minimum": 0, "default": 17},
        "device_pages": {"type": "integer", "minimum": 1, "maximum": MAX_DEVICE_PAGES, "default": 256,
                         "description": "prompt KV pages of the role's own store (when the worker gives none)"},
        "tp_timeout_s": {"type": "number", "exclusiveMinimum": 0, "default": 10,
                         "description": "tp_size > 1: deadline of one collective between the ranks (a stuck"
                         " rank fails the replica's calls after it; a dead one at once)"},
    },
    "additionalProperties": False,
}

DIFFUSION_NODE_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "steps": {"type": "integer", "minimum": 1, "maximum": MAX_DIFFUSION_STEPS},
        "guidance_scale": {"type": "number", "minimum": 0, "description": "1: no classifier-free guidance"},
        "seed": {"type": "integer", "minimum": 0, "default": 0, "description": "same seed, same latents"},
        "negative_prompt": {"type": "string", "default": ""},
        "tenant": {"type": "string", "minLength": 1, "description": "cache salt (as the llm role's)"},
    },
    "additionalProperties": False,
}

_NO_PARAMS: dict[str, Any] = {"type": "object", "additionalProperties": False}


def register_multimodal(registry: KindRegistry) -> None:
    """Role and node kinds of the encoders, the diffusion runner and the decoders."""
    def seeded(table: str) -> RoleModels:  # a built-in name, defaulted when none is given
        return RoleModels(required=False, builtin=f"engine.compute.builtin_models:{table}")

    roles = (
        ("vision_encoder", "A ViT (`tiny-vit`) projected to an LLM's hidden size.",
         "engine.compute.encoders.unit:VisionEncoderUnit", ENCODER_ROLE_PARAMS, seeded("vision_encoders")),
        ("audio_encoder", "Log-mel features into a small transformer encoder (`tiny-audio-encoder`).",
         "engine.compute.encoders.unit:AudioEncoderUnit", ENCODER_ROLE_PARAMS, seeded("audio_encoders")),
        ("diffusion", "Denoises image latents with an LLM's own transformer (model: the LLM), attending to"
         " the prompt's cached KV; flow-matching Euler steps, classifier-free guidance.",
         "engine.compute.diffusion.unit:DiffusionUnit", DIFFUSION_ROLE_PARAMS, LLM_MODELS),
        ("vae_decoder", "A diffusers AutoencoderKL (`tiny-vae`) decoding latents to PNG.",
         "engine.compute.decoders.unit:VAEDecoderUnit", _NO_PARAMS, seeded("image_decoders")),
        ("audio_decoder", "A convolutional decoder (`tiny-audio-decoder`) from audio codes to 16-bit WAV.",
         "engine.compute.decoders.unit:AudioDecoderUnit", _NO_PARAMS, seeded("audio_decoders")),
    )
    # The diffusion runner shards the LLM's transformer as an `llm` role does (same divisibility).
    tensor_parallel = {"diffusion": ("engine.compute.kinds:llm_tp_problems",
                                     "engine.compute.tp.diffusion_unit:TPDiffusionUnit")}
    for name, description, runner, params, models in roles:
        check, tp_runner = tensor_parallel.get(name, (None, None))
        registry.add_role_kind(RoleKind(name=name, description=f"{description} ({_DEVICE_NOTE}).",
                                        runner=runner, params_schema=params, tensor_parallel=check,
                                        tp_runner=tp_runner, models=models))
    encoded = {
        "embeds": PortSpec(type="tensor", description="(length, hidden) embeddings for the LLM's placeholders"),
        "item": PortSpec(type="json", description="{kind, hash, length, hidden}: where and how to splice"),
    }
    registry.add_node_kind(NodeKind(
        name="vision_encode", description="Encode an image into LLM input embeddings and a content hash.",
        role_kinds=("vision_encoder",), category="model", params_schema=_NO_PARAMS,
        inputs={"image": PortSpec(type="image", description="PNG/JPEG bytes or an (H, W, 3) array")},
        outputs=dict(encoded),
    ))
    registry.add_node_kind(NodeKind(
        name="audio_encode", description="Encode audio into LLM input embeddings and a content hash.",
        role_kinds=("audio_encoder",), category="model", params_schema=_NO_PARAMS,
        inputs={"audio": PortSpec(type="audio", description="WAV bytes or mono float samples at 16 kHz")},
        outputs=dict(encoded),
    ))
    registry.add_node_kind(NodeKind(
        name="diffusion", description="Generate image latents for a prompt with the LLM's transformer, reusing"
        " the prompt's KV at every step.",
        role_kinds=("diffusion",), category="model", params_schema=DIFFUSION_NODE_PARAMS,
        inputs={
            "prompt": PortSpec(type="text", optional=True, description="text prompt"),
            "tokens": PortSpec(type="tokens", optional=True, description="prompt as the llm role's token ids"),
            "negative_prompt": PortSpec(type="text", optional=True, description="unconditional branch of CFG"),
            "kv": PortSpec(type="kv", optional=True, description="an llm node's kv output: its pages are reused,"
                           " and its context (prompt and output ids) is the prompt when neither is given"),
        },
        needs=(InputChoice(ports=("prompt", "tokens", "kv"), what="a prompt"),),
        outputs={"latents": PortSpec(type="tensor", description="(C, h, w) latents for vae_decode")},
    ))
    registry.add_node_kind(NodeKind(
        name="vae_decode", description="Decode latents to a PNG image.",
        role_kinds=("vae_decoder",), category="model", params_schema=_NO_PARAMS,
        inputs={"latents": PortSpec(type="tensor", description="(C, h, w) latents")},
        outputs={"image": PortSpec(type="image", description="PNG bytes")},
    ))
    registry.add_node_kind(NodeKind(
        name="audio_decode", description="Decode audio codes to a 16-bit PCM WAV.",
        role_kinds=("audio_decoder",), category="model",
        params_schema={"type": "object", "properties": {
            "code_offset": {"type": "integer", "minimum": 0, "default": 0,
                            "description": "subtracted from each id (audio codes above an LLM's text vocabulary)"},
        }, "additionalProperties": False},
        inputs={"codes": PortSpec(type="tokens", description="code ids (T,), or a (codebooks, T) tensor")},
        outputs={"audio": PortSpec(type="audio", description="WAV bytes")},
    ))
