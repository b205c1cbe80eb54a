"""The compute layer's kinds: the `llm` role kind and the `llm`, `llm.prefill`, `llm.decode` node kinds.

`register(registry)` is the `omniflow.kinds` entry point named `llm`; it adds the kinds
to a `KindRegistry` (built per process by `engine.spec.kinds.default_kinds`). The runner
is named lazily, so the catalogue costs no model import.
"""

from __future__ import annotations

from typing import Any

from engine.spec.graph import PortSpec
from engine.spec.kinds import KindRegistry, NodeKind, RoleKind

LLM_ROLE_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "capacity": {"type": "integer", "minimum": 1, "default": 64,
                     "description": "node executions one replica accepts at once (the engine batches them)"},
        "page_size": {"type": "integer", "minimum": 1, "default": 16, "description": "tokens per KV page"},
        "max_running": {"type": "integer", "minimum": 1, "default": 32, "description": "sequences batched at once"},
        "max_prefill_tokens": {"type": "integer", "minimum": 1, "default": 2048,
                               "description": "prompt tokens computed per step (chunked prefill)"},
        "device_pages": {"type": "integer", "minimum": 1, "default": 4096, "description": "device-tier KV pages"},
        "host_pages": {"type": "integer", "minimum": 1, "description": "host-tier KV pages (none: no host tier)"},
        "prefix_cache": {"type": "boolean", "default": True, "description": "reuse cached prompt prefixes"},
        "session_ttl_s": {"type": "number", "exclusiveMinimum": 0, "default": 600,
                          "description": "how long an idle session keeps its KV pinned"},
        "seed": {"type": "integer", "minimum": 0, "description": "seed of requests that carry none"},
        "handoff_lease_s": {"type": "number", "exclusiveMinimum": 0, "default": 60,
                            "description": "llm.prefill: how long the prompt's pages stay held for a decode"
                            " node that never comes for them"},
        "kv_pull_timeout_s": {"type": "number", "exclusiveMinimum": 0, "default": 10,
                              "description": "deadline of pulling KV pages from another worker"},
    },
    "additionalProperties": False,
}

LLM_NODE_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "max_new_tokens": {"type": "integer", "minimum": 1, "default": 16},
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
        "tenant": {"type": "string", "minLength": 1, "description": "cache salt: tenants never share KV"},
    },
    "additionalProperties": False,
}


LLM_PREFILL_PARAMS: dict[str, Any] = {
    **LLM_NODE_PARAMS,
    "description": "Sampling params apply to the first token; llm.decode continues with them.",
    "properties": {k: v for k, v in LLM_NODE_PARAMS["properties"].items() if k != "session"},
}

LLM_DECODE_PARAMS: dict[str, Any] = {
    **LLM_NODE_PARAMS,
    "description": "Given sampling params override those the prefill node sampled its first token with.",
    "properties": {
        k: {key: val for key, val in v.items() if key != "default"}
        for k, v in LLM_NODE_PARAMS["properties"].items()
        if k not in ("session", "tenant")
    },
}

_PROMPT_INPUTS = {
    "prompt": PortSpec(type="text", optional=True, description="text prompt (or the new message)"),
    "tokens": PortSpec(type="tokens", optional=True, description="prompt as token ids"),
}


def register(registry: KindRegistry) -> None:
    registry.add_role_kind(
        RoleKind(
            name="llm",
            description="A causal LLM (built-in tiny model or local checkpoint) with continuous batching over"
            " paged KV, prefix caching and sessions.",
            runner="engine.compute.llm.unit:LLMUnit",
            params_schema=LLM_ROLE_PARAMS,
        )
    )
    registry.add_node_kind(
        NodeKind(
            name="llm",
            description="Generate from a text prompt or token ids; streams text and tokens, ends with a"
            " reference to the KV pages.",
            role_kinds=("llm",),
            category="model",
            params_schema=LLM_NODE_PARAMS,
            inputs=dict(_PROMPT_INPUTS),
            outputs={
                "text": PortSpec(type="text", description="generated text (stream: deltas)"),
                "tokens": PortSpec(type="tokens", description="generated token ids (stream: new ones)"),
                "kv": PortSpec(type="kv", description="model id, KV layout and page keys of prompt + output"),
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
            outputs={"kv": PortSpec(type="kv", description="the prefill handoff")},
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
                "kv": PortSpec(type="kv", description="model id, KV layout and page keys of prompt + output"),
            },
        )
    )
