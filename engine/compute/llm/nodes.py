"""What an `llm` node call asks of the unit: its kind, prompt, sampling params, and usage out.

Pure functions of a `NodeCall` (no engine): the unit (`unit.py`) and its prefill/decode side
(`pd.py`) read calls through them, so a bad input is named the same way whichever kind it
reaches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from enum import StrEnum
from typing import Any

from engine.compute.llm.errors import LLMUnitError
from engine.compute.llm.sequence import FinishReason, RequestOutput
from engine.compute.prompts import call_prompt
from engine.compute.sampling import SamplingParams
from engine.spec.calls import NodeCall
from engine.spec.usage import Usage

SAMPLING_PARAMS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
)


class NodeMode(StrEnum):
    """The llm node kind a call comes from."""

    GENERATE = "llm"
    PREFILL = "llm.prefill"
    DECODE = "llm.decode"


def node_mode(call: NodeCall) -> NodeMode:
    """Which llm node kind `call` belongs to: its `kind` where the caller set it; otherwise its
    ports tell (the llm kinds fix their ports and validation holds every node to them exactly:
    only `llm.decode` has an input `kv`, only `llm.prefill` has `kv` as its only output)."""
    if call.kind in NodeMode.__members__.values():
        return NodeMode(call.kind)
    if "kv" in call.inputs:
        return NodeMode.DECODE
    if tuple(call.output_ports) == ("kv",):
        return NodeMode.PREFILL
    return NodeMode.GENERATE


def node_prompt(call: NodeCall) -> str | list[int]:
    """The call's prompt: exactly one of the inputs `prompt` (text) or `tokens` (ids)."""
    return call_prompt(call, LLMUnitError)


def node_sampling(node_id: str, params: dict[str, Any]) -> SamplingParams:
    """The sampling params among a node's params (the rest are the unit's business)."""
    picked = {k: v for k, v in params.items() if k in SAMPLING_PARAMS}
    for key in ("stop", "stop_token_ids"):
        if key in picked:
            picked[key] = tuple(picked[key])
    try:
        return SamplingParams(**picked)
    except (TypeError, ValueError) as exc:
        raise LLMUnitError(f"node {node_id!r}: {exc}") from exc


async def joined(call: NodeCall) -> NodeCall:
    """Stream-mode inputs arrive as async iterators: `call` with their frames joined into one value."""
    inputs = dict(call.inputs)
    for name, value in call.inputs.items():
        if isinstance(value, AsyncIterator):
            frames = [frame async for frame in value]
            inputs[name] = "".join(frames) if all(isinstance(f, str) for f in frames) else [
                t for f in frames for t in (f if isinstance(f, list | tuple) else [f])
            ]
    return dataclasses.replace(call, inputs=inputs)


def usage(out: RequestOutput) -> dict[str, Any]:
    """The `usage` output of a finished generation (see `engine.spec.usage`)."""
    reason = out.finish_reason
    if reason not in (FinishReason.STOP, FinishReason.LENGTH):
        raise LLMUnitError(f"request {out.request_id}: a generation that ended as {reason} has no usage")
    return Usage(prompt_tokens=out.prompt_tokens, completion_tokens=len(out.output_ids),
                 cached_tokens=out.cached_tokens, finish_reason=str(reason)).to_value()
