"""Ops of `workflows/chat.py` and `workflows/vision_chat.py`: the reply's text and token usage."""

from __future__ import annotations

from typing import Any

from engine.spec.ops import op


@op("chat.join_text", inputs={"parts": {"type": "text", "join": "ordered"}}, outputs={"text": "text"})
def join_text(parts: list[str]) -> str:
    """The streamed deltas, in order, as one text."""
    return "".join(parts)


@op("chat.usage", inputs={"kv": {"type": "kv", "join": "ordered"}}, outputs={"usage": "json"})
def usage_of(kv: list[dict[str, Any]]) -> dict[str, int]:
    """Token counts of the generation (prompt includes a session's history) from its KV reference."""
    ref = kv[-1]
    prompt = int(ref["prompt_tokens"])
    completion = int(ref["tokens"]) - prompt
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "cached_tokens": int(ref.get("cached_tokens", 0))}
