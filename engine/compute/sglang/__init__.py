"""SGLang integration: page keys, a HiCache storage backend and a sampler plug-in.

Only the modules of this package import `sglang`, and only when they are imported
themselves: `keys` needs no SGLang at all, `hicache` and `sampler` do. Nothing else in
the engine imports this package, so the main environment (torch 2.13) works without
SGLang; the integration tests run in `.venv-sglang` (`scripts/sglang_env.sh test`).
"""
