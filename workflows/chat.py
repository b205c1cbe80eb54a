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

from engine.flow.dsl import Workflow
from workflows.ops.chat import join_text, usage_of

MODEL = "tiny-llama"

wf = Workflow("chat", description="an LLM that answers a rendered conversation; streams its reply")
llm = wf.role("llm", kind="llm", model=MODEL, params={"page_size": 16})
py = wf.role("py", kind="python")
prompt = wf.input("prompt", "text", default="### User:\nHello!\n\n### Assistant:\n")
reply = wf.node("reply", "llm", role=llm, params={"max_new_tokens": 32}, stream=True)
wf.edge(prompt, reply.inp("prompt"))
text = wf.python(join_text, role=py, id="join")
wf.edge(reply.out("text"), text.inp("parts"))
usage = wf.python(usage_of, role=py, id="count")
wf.edge(reply.out("kv"), usage.inp("kv"))
wf.output("text", text, "text")
wf.output("usage", usage, "json")

workflow = wf
