"""The model's forward pass with attention over the paged KV cache.

The math is the `transformers` model's own modules — embedding, each decoder layer's
norms, q/k/v/o projections and MLP, the rotary embedding, the final norm and the LM
head — run in a loop written here, so that attention reads keys and values from KV
pages instead of a `transformers` cache. Everything is float32, like the reference.

Where K/V live (see `engine.data.kv.layout`: a page is `(2, layers, page_size, kv_heads,
head_dim)`):

* full pages of a sequence are in the KV store's device pool, addressed by slot;
* the sequence's last, partial page is in a *tail* page that the engine owns (pages in
  the store are immutable and named by the hash of their tokens, which a partial page
  does not have yet).

Attention gathers a sequence's pages from the pool every step (acceptable on the CPU;
the prefix is never recomputed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine.data.kv.layout import KVLayout


class UnsupportedModelError(TypeError):
    """The model lacks the modules the paged forward drives (a Llama/Qwen2-style decoder)."""


@dataclass(slots=True)
class PrefillChunk:
    """`token_ids` fed at positions `start...`; `prefix_slots` are the device-pool slots of the
    sequence's full pages before position `start // page_size * page_size`; `tail` holds the
    K/V of the tokens from there to `start` (None when `start` is page-aligned)."""

    token_ids: Sequence[int]
    start: int
    prefix_slots: Sequence[int]
    tail: torch.Tensor | None
    embeds: Sequence[tuple[int, torch.Tensor]] = field(default=())
    """(row in this chunk, rows of input embeddings) replacing token embeddings (multimodal items)."""


@dataclass(slots=True)
class DecodeBatch:
    """One new token per sequence, at `positions[i]`, whose K/V go into tail page `tail_slots[i]`."""

    token_ids: Sequence[int]
    positions: Sequence[int]
    page_slots: Sequence[Sequence[int]]
    tail_slots: Sequence[int]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` is `(tokens, heads, dim)`, `cos`/`sin` `(tokens, dim)` (as `transformers` applies them)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class PagedForward:
    """Forward passes of one `transformers` causal LM over paged KV. Holds no KV itself."""

    def __init__(self, model: PreTrainedModel, layout: KVLayout) -> None:
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or any(not hasattr(inner, name) for name in needed) or not hasattr(model, "lm_head"):
            raise UnsupportedModelError(f"{type(model).__name__} is not a Llama/Qwen2-style decoder")
        cfg = model.config
        self.model = model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.scaling = float(self.layers[0].self_attn.scaling)
        self.page_size = layout.page_size
        expected = (len(self.layers), self.num_kv_heads, self.head_dim)
        if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != expected:
            raise UnsupportedModelError(f"KV layout {layout.fingerprint()} does not fit the model {expected}")
        self.layout = layout

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(hidden[None], positions[None])
        return cos[0], sin[0]

    def _qkv(self, layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        attn = layer.self_attn
        tokens = hidden.shape[0]
        q = attn.q_proj(hidden).view(tokens, self.num_heads, self.head_dim)
        k = attn.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _mlp_block(self, layer: torch.nn.Module, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hidden = residual + layer.self_attn.o_proj(attn_out)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()

    @torch.inference_mode()
    def prefill(self, chunk: PrefillChunk, pool: torch.Tensor, want_logits: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run `chunk`; returns the last position's logits (if wanted) and the fresh pages.

        Fresh pages, `(n, *page_shape)`, hold the K/V of positions `start // page_size *
        page_size` to `start + len(token_ids)`: the old tail's tokens, then the chunk's.
        """
        page = self.page_size
        n = len(chunk.token_ids)
        tail_start = chunk.start // page * page
        offset = chunk.start - tail_start
        if len(chunk.prefix_slots) * page != tail_start:
            raise ValueError(f"{len(chunk.prefix_slots)} prefix pages for a chunk starting at {chunk.start}")
        fresh = torch.zeros(
            ((offset + n + page - 1) // page, *self.layout.page_shape), dtype=pool.dtype, device=pool.device
        )
        if offset:
            if chunk.tail is None:
                raise ValueError(f"a chunk starting at {chunk.start} mid-page needs the tail page")
            fresh[0, :, :, :offset] = chunk.tail[:, :, :offset]
        flat = torch.arange(offset, offset + n, device=pool.device)
        page_index, token_index = flat // page, flat % page
        ids = torch.tensor(list(chunk.token_ids), dtype=torch.long, device=pool.device)
        hidden = self.embed(ids)
        for row, rows in chunk.embeds:
            hidden[row : row + rows.shape[0]] = rows.to(hidden.dtype)
        cos, sin = self._rotary(hidden, torch.arange(chunk.start, chunk.start + n, device=pool.device))
        prefix = pool[torch.tensor(list(chunk.prefix_slots), dtype=torch.long)] if tail_start else None
        total = chunk.start + n
        mask = None
        if chunk.start:
            # Query i sits at position start + i and sees keys 0..start + i.
            mask = torch.arange(total, device=pool.device)[None, :] <= (flat - offset + chunk.start)[:, None]
        for index, layer in enumerate(self.layers):
            residual = hidden
            q, k, v = self._qkv(layer, layer.input_layernorm(hidden), cos, sin)
            fresh[page_index, 0, index, token_index] = k
            fresh[page_index, 1, index, token_index] = v
            keys = fresh[:, 0, index].reshape(-1, self.num_kv_heads, self.head_dim)[: offset + n]
            values = fresh[:, 1, index].reshape(-1, self.num_kv_heads, self.head_dim)[: offset + n]
            if prefix is not None:
                keys = torch.cat((prefix[:, 0, index].reshape(-1, self.num_kv_heads, self.head_dim), keys))
                values = torch.cat((prefix[:, 1, index].reshape(-1, self.num_kv_heads, self.head_dim), values))
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None and n > 1,
                scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            hidden = self._mlp_block(layer, residual, out[0].transpose(0, 1).reshape(n, -1))
        logits = self._logits(hidden[-1:])[0] if want_logits else None
        return logits, fresh

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, pool: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
        """One token per sequence; writes its K/V into `tails[tail_slots[i]]`; returns `(B, vocab)` logits."""
        page = self.page_size
        size = len(batch.token_ids)
        device = pool.device
        ids = torch.tensor(list(batch.token_ids), dtype=torch.long, device=device)
        positions = torch.tensor(list(batch.positions), dtype=torch.long, device=device)
        tail_slots = torch.tensor(list(batch.tail_slots), dtype=torch.long, device=device)
        tail_pos = positions % page
        max_pages = max(len(slots) for slots in batch.page_slots)
        pages = None
        if max_pages:
            index = torch.zeros((size, max_pages), dtype=torch.long)
            counts = torch.tensor([len(slots) for slots in batch.page_slots])
            for row, slots in enumerate(batch.page_slots):
                index[row, : len(slots)] = torch.tensor(list(slots), dtype=torch.long)
            page_valid = torch.arange(max_pages)[None, :] < counts[:, None]
            pages = pool[index.to(device)]
            # Padding slots may hold anything (even NaN); zero them so masked weights stay 0.
            pages.masked_fill_(~page_valid.to(device)[:, :, None, None, None, None, None], 0.0)
            token_valid = page_valid.to(device).repeat_interleave(page, dim=1)
        else:
            token_valid = torch.zeros((size, 0), dtype=torch.bool, device=device)
        tail_valid = torch.arange(page, device=device)[None, :] <= tail_pos[:, None]
        mask = torch.cat((token_valid, tail_valid), dim=1)[:, None, None, :]
        hidden = self.embed(ids)
        cos, sin = self._rotary(hidden, positions)
        for index_l, layer in enumerate(self.layers):
            residual = hidden
            q, k, v = self._qkv(layer, layer.input_layernorm(hidden), cos, sin)
            tails[tail_slots, 0, index_l, tail_pos] = k
            tails[tail_slots, 1, index_l, tail_pos] = v
            keys = tails[tail_slots, 0, index_l]
            values = tails[tail_slots, 1, index_l]
            if pages is not None:
                keys = torch.cat((pages[:, :, 0, index_l].reshape(size, -1, self.num_kv_heads, self.head_dim), keys), 1)
                values = torch.cat(
                    (pages[:, :, 1, index_l].reshape(size, -1, self.num_kv_heads, self.head_dim), values), 1
                )
            out = F.scaled_dot_product_attention(
                q[:, :, None, :],
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            hidden = self._mlp_block(layer, residual, out.reshape(size, -1))
        return self._logits(hidden)
