"""What makes a GraphSpec a chat workflow, and where its parts are.

A chat workflow has exactly one node of kind `llm` (the reply), exactly one `input` node
of type `text` (the rendered conversation goes there), and an `output` node of type
`text` (the reply text; a list of text deltas is joined). Optional: `input` nodes of
type `image` (OpenAI image parts go there, in order) and an `output` named `usage`
(token counts; see `workflows/chat.py`). `workflows/chat.py` is the example.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class NotAChatWorkflow(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("not a chat workflow: " + "; ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class ChatShape:
    prompt_input: str
    image_inputs: tuple[str, ...]
    llm_node: str
    model: str | None
    """The llm role's model reference (a built-in name or a checkpoint directory)."""
    streams: bool
    """Whether the llm node streams (its text deltas arrive as events)."""
    reply_output: str
    usage_output: str | None
    llm_usage: bool
    """Whether the llm node has its `usage` output (graphs saved before it had one do not)."""
    max_new_tokens: int | None = None
    """The llm node's own `max_new_tokens` param (None: it sets none, its kind's default holds)."""


def _port_type(node: dict[str, Any], side: str, port: str) -> str | None:
    spec = node.get(side, {}).get(port)
    return spec.get("type") if isinstance(spec, dict) else None


def chat_shape(spec: dict[str, Any]) -> ChatShape:
    """The chat parts of `spec` (a GraphSpec document); NotAChatWorkflow lists what is missing."""
    nodes = spec.get("nodes", [])
    llms = [n for n in nodes if n.get("kind") == "llm"]
    texts = [n["id"] for n in nodes if n.get("kind") == "input" and _port_type(n, "outputs", "value") == "text"]
    images = tuple(n["id"] for n in nodes if n.get("kind") == "input" and _port_type(n, "outputs", "value") == "image")
    replies = [n["id"] for n in nodes if n.get("kind") == "output" and _port_type(n, "inputs", "value") == "text"]
    problems = []
    if len(llms) != 1:
        problems.append(f"it needs exactly one node of kind 'llm' (it has {len(llms)})")
    if len(texts) != 1:
        problems.append(f"it needs exactly one input of type text for the prompt (it has {len(texts)})")
    if not replies:
        problems.append("it needs an output of type text for the reply")
    if problems:
        raise NotAChatWorkflow(problems)
    llm = llms[0]
    roles = {r["name"]: r for r in spec.get("roles", [])}
    usage = next((n["id"] for n in nodes if n.get("kind") == "output" and n["id"] == "usage"), None)
    max_new_tokens = (llm.get("params") or {}).get("max_new_tokens")
    return ChatShape(
        prompt_input=texts[0],
        image_inputs=images,
        llm_node=llm["id"],
        model=roles.get(llm.get("role", ""), {}).get("model"),
        streams=bool(llm.get("stream")),
        reply_output=replies[0],
        usage_output=usage,
        llm_usage="usage" in (llm.get("outputs") or {}),
        max_new_tokens=int(max_new_tokens) if max_new_tokens is not None else None,
    )
