"""Ops of `workflows/chat.py` and `workflows/vision_chat.py`: the reply's text and token usage."""

from __future__ import annotations

from engine.data.kv.ref import KVRef
from engine.spec.ops import op


@op("chat.join_text", inputs={"parts": {"type": "text", "join": "ordered"}}, outputs={"text": "text"})
def join_text(parts: list[str]) -> str:
    """The streamed deltas, in order, as one text."""
    return "".join(parts)


@op("chat.usage", inputs={"kv": {"type": "kv", "join": "ordered"}}, outputs={"usage": "json"})
def usage_of(kv: list[KVRef]) -> dict[str, int]:
    """Token counts of the generation (prompt includes a session's history) from its KV reference."""
    ref = KVRef.of(kv[-1])
    completion = ref.tokens - ref.prompt_tokens
    return {"prompt_tokens": ref.prompt_tokens, "completion_tokens": completion, "total_tokens": ref.tokens,
            "cached_tokens": ref.cached_tokens}
