"""Tensor parallelism shared by the LLM and diffusion runners.

A role with `tp_size = N` runs N rank processes. Each rank holds a Megatron-style shard of
the decoder (`shard.py`: q/k/v and MLP gate/up split by columns — whole attention heads,
GQA KV heads included — o_proj and down_proj split by rows and summed with `all_reduce`;
embeddings, norms and the LM head replicated) and runs the *unchanged* paged forward
(`engine.compute.llm.forward.PagedForward`) and diffusion transformer
(`engine.compute.diffusion.forward.ImageTokenForward`) over it: they read the head counts
from the model's config, which the shard rewrites to the rank's own.

* `group.py` — the process group (gloo on the CPU, NCCL on GPUs) with a collective timeout.
* `kv.py` — which KV heads a rank holds, and re-sharding pages by head between TP sizes.
* `engine.py` — `TPEngine`, the `LLMEngine` of one rank: its KV pages hold only its heads,
  under the same page keys, and a prefix hit is agreed by all ranks (the smallest wins).
* `role.py` — `TPRole`: the ranks as subprocesses of the caller's process, sent every
  command over their stdin as msgspec frames (nothing pickled); rank 0's result is the
  answer; a dead rank fails the call with `TPRankError`.
* `unit.py` — the same as role workers: a GraphSpec role with `tp_size = N` runs N worker
  processes per replica (`engine.worker.launcher`); rank 0 hosts `TPLLMUnit` (the `llm`
  unit over its shard, sending each engine operation to the followers first, as
  `messages.py` types over ZeroMQ), ranks 1.. run `follow()`. For prefill/decode across TP
  sizes its ranks pull a handoff's whole pages and keep their own heads, and gather their
  heads of their own prefill's pages on rank 0, which serves them whole.
* `diffusion_unit.py` — the same for a `diffusion` role: rank 0 hosts `TPDiffusionUnit`
  and sends each node's prompts to the followers (`TPDiffuse`); every rank denoises over
  its shard.
* `link.py` — the control link both units use: rank 0's `FollowerLink` (meet the followers'
  hellos, send them the setup, broadcast, stop them) and a follower's `greet_leader`.
"""

from engine.compute.tp.group import TPError, TPGroup, TPRankError
from engine.compute.tp.kv import (
    kv_head_owner,
    kv_heads_of,
    merge_pages,
    reshard_pages,
    shard_layout,
    split_page,
)
from engine.compute.tp.shard import ColumnParallelLinear, RowParallelLinear, shard_model

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPError",
    "TPGroup",
    "TPRankError",
    "kv_head_owner",
    "kv_heads_of",
    "merge_pages",
    "reshard_pages",
    "shard_layout",
    "shard_model",
    "split_page",
]
