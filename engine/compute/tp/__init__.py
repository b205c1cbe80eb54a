"""Tensor parallelism shared by the LLM and diffusion runners.

A role with `tp_size = N` runs N rank processes. Each rank holds a Megatron-style shard of
the decoder (`shard.py`: q/k/v and MLP gate/up split by columns — whole attention heads,
GQA KV heads included — o_proj and down_proj split by rows and summed with `all_reduce`;
embeddings, norms and the LM head replicated) and runs the *unchanged* paged forward
(`engine.compute.llm.forward.PagedForward`) and diffusion transformer
(`engine.compute.diffusion.forward.ImageTokenForward`) over it: they read the head counts
from the model's config, which the shard rewrites to the rank's own.

`llm` roles broadcast below the engine, at the model runner (as vLLM and nano-vllm do): rank 0
runs the ordinary engine (scheduler, prefix cache, sampling, sessions, handoffs, KV tiers) over
its shard, and its followers hold only their shard and their heads' KV memory.

* `group.py` — the process group (gloo on the CPU, NCCL on GPUs) with a collective timeout.
* `seat.py` — where a rank sits: its seat, device, group and shard; `LeaderWatch`.
* `kv.py` — which KV heads a rank holds, re-sharding pages by head between TP sizes, and pulling
  pages whole from a holder or the worker the KV index names.
* `journal.py` — rank 0's record of what its engine did to KV memory (`KVJournal`, fed by the
  store's events and `MirroredCache`), which the followers mirror.
* `cache.py` — `MirroredCache`, rank 0's page bookkeeping, which journals its writes; pages from
  outside the role (a decode's handoff, a prefix pulled from a peer) land through `ShardSource`,
  split by head; pages promoted from the disk tier are checked on every rank (a corrupt one is a miss).
* `runner.py` — `BroadcastForward`, rank 0's model runner: one `TPPass` per paged forward (the
  journal's operations, then the forward's inputs), and gathering pages whole.
* `embeds.py` — a prefill chunk's multimodal embedding rows as they travel in its inputs.
* `follower.py` — a follower rank: `ShardKV` (its heads' pages at rank 0's slots, its own host and
  disk tiers) and the loop that mirrors each pass and runs its shard of the forward.
* `leader.py` — `lead()`: rank 0's engine with that cache and runner, its link met.
* `unit.py` — `TPLLMUnit`: the `llm` unit over `lead()`'s engine (rank 0 of a role worker).
* `handoff.py` — prefill/decode across TP sizes: pages pulled whole and split, gathered and served whole.
* `serve.py` — `GroupPageServer`: the pages the group computed, served whole to any puller (a
  gather on the engine thread), as a TP-1 worker serves its own; the worker publishes them.
* `messages.py` — the ranks' msgspec messages; `link.py` — the control link both units use: rank
  0's `FollowerLink` (meet the followers' hellos, send them the setup, broadcast, stop them) and a
  follower's `greet_leader`.
* `local.py` — `LocalRanks`: follower ranks as child processes, for tests and `omniflow bench tp`.
* `diffusion_unit.py` — a `diffusion` role: rank 0 hosts `TPDiffusionUnit` and sends each node's
  prompts to the followers (`TPDiffuse`); every rank denoises over its shard.
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
