"""The prompt of an `llm` node call, read one way by every runner that serves the kind (our
engine's `llm` units and the SGLang runner): exactly one of the inputs `prompt` (text) or
`tokens` (token ids)."""

from __future__ import annotations

from engine.spec.calls import NodeCall


def call_prompt(call: NodeCall, error: type[Exception]) -> str | list[int]:
    """The call's prompt: its `prompt` text or its `tokens` as a list; `error` (the runner's own
    exception type) names the node when it has neither, both, or one of the wrong type."""
    prompt, tokens = call.inputs.get("prompt"), call.inputs.get("tokens")
    if (prompt is None) == (tokens is None):
        raise error(f"node {call.node_id!r}: give exactly one of the inputs 'prompt' (text) or 'tokens'")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise error(f"node {call.node_id!r}: input 'prompt' must be text, not {type(prompt).__name__}")
        return prompt
    if not isinstance(tokens, list | tuple) or not all(isinstance(t, int) for t in tokens):
        raise error(f"node {call.node_id!r}: input 'tokens' must be a list of token ids")
    return list(tokens)
