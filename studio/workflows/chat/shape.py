"""What makes a GraphSpec a chat workflow, and where its parts are.

A chat workflow has exactly one node of kind `llm` (the reply), exactly one `input` node
of type `text` (the rendered conversation goes there), and an `output` node of type
`text` fed by the llm node's `text` output, directly or through python nodes that pass
text on (the reply text; a list of text deltas is joined). It has no `output` of type
`image` or `audio`: a chat reply carries text only, so a workflow whose result is a
picture or a sound (`workflows/image_generation.py`, whose llm only rewrites the prompt)
is not a chat model. Optional: `input` nodes of type `image` (OpenAI image parts go
there, in order) and an `output` named `usage` (token counts; see `workflows/chat.py`).
`workflows/chat.py` is the example.
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


MEDIA_TYPES = ("image", "audio")


def _reply_outputs(nodes: list[dict[str, Any]], edges: list[dict[str, Any]], llm: str) -> list[str]:
    """The ids of the text `output` nodes that the llm node's `text` output reaches along text
    edges, through python nodes only, in the spec's node order."""
    by_id = {n["id"]: n for n in nodes}
    reached: set[str] = set()
    frontier = [(llm, "text")]
    seen = set(frontier)
    while frontier:
        source, port = frontier.pop()
        for edge in edges:
            if edge.get("source") != source or edge.get("source_port") != port:
                continue
            target = by_id.get(edge.get("target", ""))
            if target is None or _port_type(target, "inputs", edge.get("target_port", "")) != "text":
                continue
            if target.get("kind") == "output":
                reached.add(target["id"])
            elif target.get("kind") == "python":
                for out in (target.get("outputs") or {}):
                    if _port_type(target, "outputs", out) == "text" and (target["id"], out) not in seen:
                        seen.add((target["id"], out))
                        frontier.append((target["id"], out))
    return [n["id"] for n in nodes if n["id"] in reached]


def chat_shape(spec: dict[str, Any]) -> ChatShape:
    """The chat parts of `spec` (a GraphSpec document); NotAChatWorkflow lists what is missing."""
    nodes = spec.get("nodes", [])
    llms = [n for n in nodes if n.get("kind") == "llm"]
    texts = [n["id"] for n in nodes if n.get("kind") == "input" and _port_type(n, "outputs", "value") == "text"]
    images = tuple(n["id"] for n in nodes if n.get("kind") == "input" and _port_type(n, "outputs", "value") == "image")
    media = [n["id"] for n in nodes if n.get("kind") == "output" and _port_type(n, "inputs", "value") in MEDIA_TYPES]
    problems = []
    if len(llms) != 1:
        problems.append(f"it needs exactly one node of kind 'llm' (it has {len(llms)})")
    if len(texts) != 1:
        problems.append(f"it needs exactly one input of type text for the prompt (it has {len(texts)})")
    replies = _reply_outputs(nodes, spec.get("edges", []), llms[0]["id"]) if len(llms) == 1 else []
    if len(llms) == 1 and not replies:
        problems.append(f"it needs an output of type text fed by the text of its llm node '{llms[0]['id']}'")
    if media:
        problems.append(f"its reply would drop its image or audio outputs ({', '.join(media)}): a chat reply is text")
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


def is_chat(spec: dict[str, Any]) -> bool:
    """Whether `/v1/chat/completions` would serve a deployment of `spec` (`chat_shape` finds its parts)."""
    try:
        chat_shape(spec)
    except NotAChatWorkflow:
        return False
    return True
