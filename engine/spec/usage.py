"""What a generation took and why it ended: the `usage` output of the `llm` and `llm.decode` nodes.

The units that generate text (`engine.compute.llm.unit`, `engine.compute.sglang.runner`) send it
as a node value (`Usage.to_value()`, plain JSON-able data, so it crosses the wire and the event
log like any value); whoever reads it (the studio's chat turns, a python op) takes it back with
`Usage.from_value`, which refuses a value of another shape with a `ValueError` naming the field.
The counts are OpenAI's: `prompt_tokens` includes what a session already held, `cached_tokens`
is the part of the prompt served from the KV cache.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

FinishReason = Literal["stop", "length"]
"""`stop`: an end-of-sequence token, a stop token or a stop string; `length`: `max_new_tokens` reached."""


class Usage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_value(self) -> dict[str, Any]:
        return {**msgspec.to_builtins(self), "total_tokens": self.total_tokens}

    @classmethod
    def from_value(cls, value: Any) -> Usage:
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if k != "total_tokens"}
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"not a usage value: {exc}") from exc
