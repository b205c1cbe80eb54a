"""Megatron-style shards of a Llama/Qwen2 decoder, built from the Hugging Face layer weights.

Per decoder layer, on rank `r` of `N`:

* q_proj, k_proj, v_proj: `ColumnParallelLinear` — the output rows of rank r's query heads
  and of the KV heads they read (`engine.compute.tp.kv.kv_heads_of`), biases included;
* o_proj: `RowParallelLinear` — the input columns of rank r's query heads; partial sums
  are added over the ranks with `all_reduce`, then the bias (if any);
* MLP gate_proj/up_proj column-split, down_proj row-split + `all_reduce`.

Embeddings, norms, rotary embedding and the LM head stay whole (replicated). The shard's
config says the rank's head counts (`num_attention_heads`, `num_key_value_heads`) and
keeps `head_dim`, so the existing forward loops run on it unchanged.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from engine.compute.models.loader import LoadedModel
from engine.compute.tp.group import TPError, TPGroup
from engine.compute.tp.kv import kv_heads_of


class ColumnParallelLinear(torch.nn.Linear):
    """The output features `rows` of a whole `nn.Linear` (input replicated, output sharded)."""

    @classmethod
    def of(cls, linear: torch.nn.Linear, rows: torch.Tensor) -> ColumnParallelLinear:
        out = cls(linear.in_features, len(rows), bias=linear.bias is not None,
                  device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            out.weight.copy_(linear.weight[rows])
            if linear.bias is not None:
                out.bias.copy_(linear.bias[rows])
        return out.requires_grad_(False)


class RowParallelLinear(torch.nn.Module):
    """The input features `cols` of a whole `nn.Linear` (input sharded); the ranks' partial
    outputs are summed with `all_reduce`, then the (replicated) bias is added once."""

    def __init__(self, linear: torch.nn.Linear, cols: torch.Tensor, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.in_features = len(cols)
        self.out_features = linear.out_features
        self.weight = torch.nn.Parameter(linear.weight[:, cols].detach().clone(), requires_grad=False)
        self.bias = (torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
                     if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce_(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


def _head_rows(heads: range, head_dim: int) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def shard_model(loaded: LoadedModel, group: TPGroup) -> LoadedModel:
    """Rank `group.rank`'s shard of `loaded` (a new model; `loaded` is left as it is).

    The shard keeps `loaded`'s `model_id`, so its KV pages are named as the whole model's.
    """
    if group.size == 1:
        return loaded
    cfg = loaded.model.config
    n, rank = group.size, group.rank
    num_heads, num_kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    head_dim = loaded.head_dim
    inter = int(cfg.intermediate_size)
    if num_heads % n or inter % n:
        raise TPError(f"{num_heads} heads / intermediate size {inter} cannot be split over {n} ranks")
    q_heads = range(rank * num_heads // n, (rank + 1) * num_heads // n)
    kv_heads = kv_heads_of(num_kv, n, rank)
    group_size = num_heads // num_kv
    if q_heads.start // group_size < kv_heads.start or (q_heads.stop - 1) // group_size >= kv_heads.stop:
        raise TPError(f"rank {rank}'s query heads {q_heads} read KV heads outside its own {kv_heads}")
    q_rows, kv_rows = _head_rows(q_heads, head_dim), _head_rows(kv_heads, head_dim)
    mlp_rows = torch.arange(rank * inter // n, (rank + 1) * inter // n)
    model = copy.deepcopy(loaded.model)
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj = ColumnParallelLinear.of(attn.q_proj, q_rows)
            attn.k_proj = ColumnParallelLinear.of(attn.k_proj, kv_rows)
            attn.v_proj = ColumnParallelLinear.of(attn.v_proj, kv_rows)
            attn.o_proj = RowParallelLinear(attn.o_proj, q_rows, group)
            mlp.gate_proj = ColumnParallelLinear.of(mlp.gate_proj, mlp_rows)
            mlp.up_proj = ColumnParallelLinear.of(mlp.up_proj, mlp_rows)
            mlp.down_proj = RowParallelLinear(mlp.down_proj, mlp_rows, group)
            for name in ("num_heads", "num_key_value_heads"):
                if hasattr(attn, name):
                    setattr(attn, name, len(q_heads) if name == "num_heads" else len(kv_heads))
    model.config = copy.deepcopy(cfg)
    model.config.head_dim = head_dim
    model.config.num_attention_heads = len(q_heads)
    model.config.num_key_value_heads = len(kv_heads)
    model.config.intermediate_size = inter // n
    model.eval()
    return LoadedModel(name=loaded.name, model_id=loaded.model_id, model=model, tokenizer=loaded.tokenizer,
                       eos_token_ids=loaded.eos_token_ids)
