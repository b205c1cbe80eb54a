"""Chat: text in, an LLM's reply out; what the studio's `/v1/chat/completions` serves.

Deploy it and it is an OpenAI-compatible model: the studio renders the conversation into
the `prompt` input (the model's chat template, or its simple one), the `reply` node
streams its tokens (a chat client sees each delta), `join` gathers them into the `text`
output, and `count` counts the tokens from the reply's KV reference. In a chat session
the studio sets the `reply` node's `session` param, so the LLM keeps the history
server-side and each turn computes only its new tokens.

    omniflow run workflows/chat.py --input prompt='"### User:\\nHello\\n\\n### Assistant:\\n"'
"""

from __future__ import annotations

from typing import Any

from engine.flow.dsl import Workflow

MODEL = "tiny-llama"


def join_text(parts: list[str]) -> str:
    """The streamed deltas, in order, as one text."""
    return "".join(parts)


def usage_of(kv: list[dict[str, Any]]) -> dict[str, int]:
    """Token counts of the generation (prompt includes a session's history) from its KV reference."""
    ref = kv[-1]
    prompt = int(ref["prompt_tokens"])
    completion = int(ref["tokens"]) - prompt
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "cached_tokens": int(ref.get("cached_tokens", 0))}


wf = Workflow("chat", description="an LLM that answers a rendered conversation; streams its reply")
llm = wf.role("llm", kind="llm", model=MODEL, params={"page_size": 16})
py = wf.role("py", kind="python")
prompt = wf.input("prompt", "text", default="### User:\nHello!\n\n### Assistant:\n")
reply = wf.node("reply", "llm", role=llm, params={"max_new_tokens": 32}, stream=True)
wf.edge(prompt, reply.inp("prompt"))
text = wf.python(join_text, role=py, id="join", inputs={"parts": {"type": "text", "join": "ordered"}},
                 outputs={"text": "text"})
wf.edge(reply.out("text"), text.inp("parts"))
usage = wf.python(usage_of, role=py, id="count", inputs={"kv": {"type": "kv", "join": "ordered"}},
                  outputs={"usage": "json"})
wf.edge(reply.out("kv"), usage.inp("kv"))
wf.output("text", text, "text")
wf.output("usage", usage, "json")

workflow = wf
