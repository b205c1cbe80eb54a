"""Vision chat: a picture and a conversation in, an LLM's reply out; what the studio's
`/v1/chat/completions` serves for messages with images.

Deploy it and it is an OpenAI-compatible vision model: a user message's `image_url` content
part (a `data:` URL of a PNG or JPEG) goes to the `image` input, the vision encoder (`see`)
turns it into embeddings for the LLM's hidden size and a content hash, and the `reply` node
splices them in front of the rendered conversation (the prompt has no `<|image|>` marker) and
streams its tokens. The LLM is `smollm2-135m` (real weights; the conversation is rendered with its
own chat template); no vision encoder with real weights is to be had offline, so `tiny-vit` is
seeded (random weights, for testing): the reply is fluent, but it does not see the picture. `join` and `count` are `workflows/chat.py`'s: the reply text and the token
usage (the picture's placeholder tokens count as prompt tokens). The same picture sent again
hits the LLM's prefix cache: the placeholders are keyed by the picture's content hash.

The picture is required (a chat message without one is refused: there is no default picture
to describe). From the command line it is an `(H, W, 3)` array of floats in [0, 1]:

    omniflow run workflows/vision_chat.py --input image='[[[1.0, 0.5, 0.0], [0.0, 0.5, 1.0]]]'
"""

from __future__ import annotations

from engine.flow.dsl import Workflow
from workflows.ops.chat import join_text, usage_of

MODEL = "smollm2-135m"

wf = Workflow("vision_chat", description="a vision encoder and an LLM that answers a conversation about a picture")
llm = wf.role("llm", kind="llm", model=MODEL, params={"page_size": 16})
vision = wf.role("vision", kind="vision_encoder", model="tiny-vit", params={"llm": MODEL})
py = wf.role("py", kind="python")
prompt = wf.input("prompt", "text", default=("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by"
                                            " Hugging Face<|im_end|>\n<|im_start|>user\nWhat is in the picture?"
                                            "<|im_end|>\n<|im_start|>assistant\n"))
image = wf.input("image", "image", description="the picture the conversation is about (PNG or JPEG bytes)")
see = wf.node("see", "vision_encode", role=vision)
reply = wf.node("reply", "llm", role=llm, params={"max_new_tokens": 32}, stream=True)
wf.edge(image, see.inp("image"))
wf.edge(prompt, reply.inp("prompt"))
wf.edge(see.out("item"), reply.inp("items"))
wf.edge(see.out("embeds"), reply.inp("embeds"))
text = wf.python(join_text, role=py, id="join")
wf.edge(reply.out("text"), text.inp("parts"))
usage = wf.python(usage_of, role=py, id="count")
wf.edge(reply.out("kv"), usage.inp("kv"))
wf.output("text", text, "text")
wf.output("usage", usage, "json")

workflow = wf
