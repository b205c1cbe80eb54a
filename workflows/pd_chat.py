"""Disaggregated chat: a prefill role computes the prompt, a decode role generates the answer.

The `llm.prefill` node computes the prompt's KV cache and first token on a `prefill` worker
and outputs a handoff (page keys, first token, the worker's data address). The `llm.decode`
node, on a `decode` worker, pulls those pages straight from the prefill worker over the
transfer plane (shared memory on one host, TCP across hosts), then decodes. Greedy tokens are
the same as one `llm` node computing everything itself.

Both roles run `smollm2-135m` (real weights; on one host the two workers hold one copy of them,
`HostWeights`). Both roles balance `kv_aware`: with a Redis registry (`omniflow run --registry redis://...`)
a prompt whose prefix a worker already holds goes to that worker (the decode role sees the
handoff's page keys, so a follow-up turn lands where its history's pages are).
"""

from __future__ import annotations

from engine.flow.dsl import Workflow

MODEL = "smollm2-135m"
LLM_PARAMS = {"page_size": 16}

wf = Workflow("pd_chat", description="prefill on one role, decode on another; KV pages move between workers")
prefill_role = wf.role("prefill", kind="llm", model=MODEL, balance="kv_aware", params=LLM_PARAMS)
decode_role = wf.role("decode", kind="llm", model=MODEL, balance="kv_aware", params=LLM_PARAMS)
prompt = wf.input("prompt", "text", default="Omni-Flow moves references, not bytes: the decode worker pulls")
prefill = wf.node("prefill", "llm.prefill", role=prefill_role, params={"max_new_tokens": 32})
decode = wf.node("decode", "llm.decode", role=decode_role)
wf.edge(prompt, prefill.inp("prompt"))
wf.edge(prefill.out("kv"), decode.inp("kv"))
wf.output("text", decode.out("text"), "text")
wf.output("tokens", decode.out("tokens"), "tokens")

workflow = wf
