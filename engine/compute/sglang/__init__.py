"""SGLang integration: page keys, a HiCache storage backend, sampler and PD transfer plug-ins,
and an `llm` role runner on `sglang.Engine`.

Only the modules of this package import `sglang`, and only when they are imported
themselves: `keys`, `sizes` (what a role's HiCache takes, for quotas) and `transfer.messages`
need no SGLang at all; `runner` imports it only when a unit
is built (after checking for a GPU); `hicache`, `sampler`, `transfer` and `plugin` (the
`sglang.srt.plugins` entry point) do. Nothing else in the engine imports this package (but
`sizes`, which `engine.client.models` re-exports), so the
main environment (torch 2.13) works without SGLang; the integration tests run in
`.venv-sglang` (`scripts/sglang_env.sh test`).
"""
