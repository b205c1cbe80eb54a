"""What makes a GraphSpec a chat workflow, and where its parts are.

A chat workflow has exactly one generator: a node of kind `llm`, or a disaggregated pair, an
`llm.decode` node fed the `kv` of an `llm.prefill` node (`workflows/pd_chat.py`), where the
prefill node takes the turn's sampling params and the decode node gives the reply; a pair keeps
no server-side sessions (its kinds take no `session`), so it serves stateless completions only.
It has exactly one `input` node of type `text` (the rendered conversation goes there), and an
`output` node of type `text` fed by the generator's `text` output, directly or through python
nodes that pass text on (the reply text; a list of text deltas is joined). It has no `output` of type
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
    """The node whose `text`, `tokens` and `usage` are the reply: the llm node, or a pair's decode node."""
    model: str | None
    """The model reference (a built-in name or a checkpoint directory) of the role reading the prompt."""
    streams: bool
    """Whether the reply node streams (its text deltas arrive as events)."""
    reply_output: str
    usage_output: str | None
    llm_usage: bool
    """Whether the llm node has its `usage` output (graphs saved before it had one do not)."""
    max_new_tokens: int | None = None
    """The params node's own `max_new_tokens` param (None: it sets none, its kind's default holds)."""
    params_node: str = ""
    """The node a turn's sampling params go to: the llm node, or a pair's prefill node (its decode
    node continues with them). Empty: `llm_node`."""
    sessions: bool = True
    """Whether the generator keeps server-side sessions (an llm node; a prefill/decode pair does not)."""

    @property
    def sampled_node(self) -> str:
        """The node a turn's sampling params go to."""
        return self.params_node or self.llm_node


PAIR_KINDS = ("llm.prefill", "llm.decode")


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


def _generators(nodes: list[dict[str, Any]], edges: list[dict[str, Any]]) -> tuple[list[tuple[dict, dict]], list[str]]:
    """The spec's generators as (params node, reply node): each llm node, and each llm.decode node
    with the llm.prefill node feeding its `kv`; and what is wrong with its prefill/decode nodes."""
    by_id = {n["id"]: n for n in nodes}
    found = [(n, n) for n in nodes if n.get("kind") == "llm"]
    problems = []
    fed: set[str] = set()
    for decode in (n for n in nodes if n.get("kind") == "llm.decode"):
        sources = [by_id.get(e.get("source", "")) for e in edges if e.get("target") == decode["id"] and e.get("target_port") == "kv"]
        prefills = [s for s in sources if s is not None and s.get("kind") == "llm.prefill"]
        if len(prefills) != 1:
            problems.append(f"its llm.decode node '{decode['id']}' needs the kv of one llm.prefill node")
            continue
        fed.add(prefills[0]["id"])
        found.append((prefills[0], decode))
    for prefill in (n for n in nodes if n.get("kind") == "llm.prefill" and n["id"] not in fed):
        problems.append(f"its llm.prefill node '{prefill['id']}' feeds no llm.decode node")
    return found, problems


def chat_shape(spec: dict[str, Any]) -> ChatShape:
    """The chat parts of `spec` (a GraphSpec document); NotAChatWorkflow lists what is missing."""
    nodes = spec.get("nodes", [])
    generators, problems = _generators(nodes, spec.get("edges", []))
    texts = [n["id"] for n in nodes if n.get("kind") == "input" and _port_type(n, "outputs", "value") == "text"]
    images = tuple(n["id"] for n in nodes if n.get("kind") == "input" and _port_type(n, "outputs", "value") == "image")
    media = [n["id"] for n in nodes if n.get("kind") == "output" and _port_type(n, "inputs", "value") in MEDIA_TYPES]
    if len(generators) != 1:
        problems.append("it needs exactly one node of kind 'llm' or one llm.prefill -> llm.decode pair"
                        f" (it has {len(generators)})")
    if len(texts) != 1:
        problems.append(f"it needs exactly one input of type text for the prompt (it has {len(texts)})")
    replies = _reply_outputs(nodes, spec.get("edges", []), generators[0][1]["id"]) if len(generators) == 1 else []
    if len(generators) == 1 and not replies:
        problems.append(f"it needs an output of type text fed by the text of its {generators[0][1]['kind']} node"
                        f" '{generators[0][1]['id']}'")
    if media:
        problems.append(f"its reply would drop its image or audio outputs ({', '.join(media)}): a chat reply is text")
    if problems:
        raise NotAChatWorkflow(problems)
    sampled, reply = generators[0]
    roles = {r["name"]: r for r in spec.get("roles", [])}
    usage = next((n["id"] for n in nodes if n.get("kind") == "output" and n["id"] == "usage"), None)
    max_new_tokens = (sampled.get("params") or {}).get("max_new_tokens")
    return ChatShape(
        prompt_input=texts[0],
        image_inputs=images,
        llm_node=reply["id"],
        model=roles.get(sampled.get("role", ""), {}).get("model"),
        streams=bool(reply.get("stream")),
        reply_output=replies[0],
        usage_output=usage,
        llm_usage="usage" in (reply.get("outputs") or {}),
        max_new_tokens=int(max_new_tokens) if max_new_tokens is not None else None,
        params_node=sampled["id"] if sampled is not reply else "",
        sessions=sampled is reply,
    )


def is_chat(spec: dict[str, Any]) -> bool:
    """Whether `/v1/chat/completions` would serve a deployment of `spec` (`chat_shape` finds its parts)."""
    try:
        chat_shape(spec)
    except NotAChatWorkflow:
        return False
    return True
