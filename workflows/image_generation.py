"""Image generation: the LLM rewrites the prompt and emits image-size tokens -> a diffusion role
reusing the LLM's prompt KV, pulled across roles -> VAE decode -> PNG.

The `llm` and `diffusion` roles run the same model (`smollm2-135m`, real weights, page size 16): the
diffusion role denoises with the LLM's own transformer and attends to the LLM's context (its prompt
and rewrite, as the token ids the `kv` value carries: nothing is tokenized twice), so the rewrite is
real text. On one host the two workers hold one copy
of the weights (`HostWeights`). The diffusion's own layers (patch embedding, timestep embedding,
output head) and the VAE are seeded: no diffusion model with real weights is to be had offline, so
the picture is random (for testing). It does not recompute that context: the `kv` edge names the llm worker
holding the pages, and the diffusion worker pulls them from it over the transfer plane (with a
Redis registry, the KV index finds them too), reusing them at every denoising step. The size
token (`<|size:WxH|>`, default 256x256) sizes the saved PNG; `save` writes it under
`./omniflow-out/<run_id>/` and outputs the path; the `image` output is the decoded PNG itself
(what the studio's run page shows).
"""

from __future__ import annotations

from engine.flow.dsl import Workflow
from workflows.ops.common import image_size, rewrite_prompt, rewritten_prompt, save_outputs

MODEL = "smollm2-135m"
PAGE_SIZE = 16

wf = Workflow("image_generation", description="LLM prompt rewrite -> diffusion on the LLM's KV -> VAE -> PNG")
py = wf.role("py", kind="python")
llm = wf.role("llm", kind="llm", model=MODEL, params={"page_size": PAGE_SIZE})
diffusion = wf.role("diffusion", kind="diffusion", model=MODEL, params={"page_size": PAGE_SIZE, "steps": 12})
vae = wf.role("vae", kind="vae_decoder", model="tiny-vae")

request = wf.input("request", "text", default="a lighthouse on a cliff at dusk, oil painting")
instruct = wf.python(rewrite_prompt, role=py, outputs={"out": "text"})
rewrite = wf.node("rewrite", "llm", role=llm, params={"max_new_tokens": 24, "seed": 7})
denoise = wf.node("denoise", "diffusion", role=diffusion, params={"seed": 0})
decode = wf.node("decode", "vae_decode", role=vae)
size = wf.python(image_size, role=py)
rewritten = wf.python(rewritten_prompt, role=py, outputs={"out": "text"})
save = wf.python(save_outputs, role=py, inputs={"text": "text", "image": "image", "size": "json"})

wf.edge(request, instruct)
wf.edge(instruct, rewrite.inp("prompt"))
wf.edge(rewrite.out("kv"), denoise.inp("kv"))
wf.edge(denoise.out("latents"), decode.inp("latents"))
wf.edge(rewrite.out("text"), size.inp("text"))
wf.edge(rewrite.out("text"), save.inp("text"))
wf.edge(decode.out("image"), save.inp("image"))
wf.edge(size, save.inp("size"))
wf.output("saved", save, "json")
wf.output("image", decode.out("image"), "image")
wf.edge(rewrite.out("text"), rewritten)
wf.output("prompt_rewrite", rewritten, "text")

workflow = wf
