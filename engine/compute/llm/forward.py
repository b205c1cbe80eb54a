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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine.data.kv.layout import KVLayout


def q_dtype(forward: PagedForward) -> torch.dtype:
    return forward.embed.weight.dtype


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
    """One new token per sequence, at `positions[i]`, whose K/V go into tail page `tail_slots[i]`.

    `keys` name the sequences (request ids): a batch with the same keys in the same order
    as the previous step's reuses that step's gathered K/V (see `DecodeBuffer`).
    """

    token_ids: Sequence[int]
    positions: Sequence[int]
    page_slots: Sequence[Sequence[int]]
    tail_slots: Sequence[int]
    keys: Sequence[str] = ()


HEADROOM_PAGES = 2
"""Page room a decode buffer keeps beyond its longest sequence, so it is regathered less often."""


@dataclass(slots=True)
class DecodeBuffer:
    """The K/V of a decode batch gathered from its pages, carried from step to step.

    `kv` is `(layers, K/V, batch, capacity + 1, page, heads, dim)`: sequence `b`'s full
    pages at `[0, pages[b])`, its tail page at `capacity`, zeros or stale (masked) bytes
    between. While the batch keeps its members and order, each step only appends: the new
    token's K/V go into the tail region, and a tail that was stored as a page last step
    moves to its page position. The pages in the KV store stay the source of truth: the
    buffer is rebuilt from them whenever the batch changes or outgrows it.
    """

    keys: tuple[str, ...]
    kv: torch.Tensor
    pages: list[int]

    @property
    def capacity(self) -> int:
        return self.kv.shape[3] - 1


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` is `(tokens, heads, dim)`, `cos`/`sin` `(tokens, dim)` (as `transformers` applies them)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


@dataclass(frozen=True, slots=True)
class _Layer:
    """A decoder layer's modules, bound once (the hot loop skips attribute lookups and hooks)."""

    input_norm: Callable[[torch.Tensor], torch.Tensor]
    q_proj: Callable[[torch.Tensor], torch.Tensor]
    k_proj: Callable[[torch.Tensor], torch.Tensor]
    v_proj: Callable[[torch.Tensor], torch.Tensor]
    o_proj: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    mlp: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _Layer:
        attn = layer.self_attn
        return cls(
            input_norm=layer.input_layernorm.forward,
            q_proj=attn.q_proj.forward,
            k_proj=attn.k_proj.forward,
            v_proj=attn.v_proj.forward,
            o_proj=attn.o_proj.forward,
            post_norm=layer.post_attention_layernorm.forward,
            mlp=layer.mlp.forward,
        )


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
        self.layers = [_Layer.of(layer) for layer in inner.layers]
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.scaling = float(inner.layers[0].self_attn.scaling)
        self.page_size = layout.page_size
        expected = (len(self.layers), self.num_kv_heads, self.head_dim)
        if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != expected:
            raise UnsupportedModelError(f"KV layout {layout.fingerprint()} does not fit the model {expected}")
        self.layout = layout

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(hidden[None], positions[None])
        return cos[0], sin[0]

    def _qkv(self, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        tokens = hidden.shape[0]
        q = layer.q_proj(hidden).view(tokens, self.num_heads, self.head_dim)
        k = layer.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        v = layer.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        # One rotary pass over queries and keys together (elementwise: same numbers).
        qk = _rope(torch.cat((q, k), dim=1), cos, sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v

    def _mlp_block(self, layer: _Layer, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hidden = residual + layer.o_proj(attn_out)
        return hidden + layer.mlp(layer.post_norm(hidden))

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
            q, k, v = self._qkv(layer, layer.input_norm(hidden), cos, sin)
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

    def _gather(self, batch: DecodeBatch, pool: torch.Tensor, tails: torch.Tensor, tail_slots: torch.Tensor,
                counts: list[int]) -> DecodeBuffer:
        """Build a decode buffer from the pages and tail pages of `batch`."""
        page = self.page_size
        size = len(counts)
        max_pages = max(counts)
        capacity = max_pages + HEADROOM_PAGES
        kv = torch.zeros(
            (self.layout.num_layers, 2, size, capacity + 1, page, self.num_kv_heads, self.head_dim),
            dtype=pool.dtype,
            device=pool.device,
        )
        if max_pages:
            # Padding points at a page some sequence holds: finite bytes, masked out.
            filler = next(slots[0] for slots in batch.page_slots if slots)
            flat = [
                slot
                for slots in batch.page_slots
                for slot in (*slots, *([filler] * (max_pages - len(slots))))
            ]
            # Whole pages gather fastest (contiguous rows); the permuting copy follows.
            gathered = pool.index_select(0, torch.tensor(flat, device=pool.device))
            kv[:, :, :, :max_pages] = gathered.view(size, max_pages, *pool.shape[1:]).permute(3, 2, 0, 1, 4, 5, 6)
        kv[:, :, :, capacity] = tails.index_select(0, tail_slots).permute(2, 1, 0, 3, 4, 5)
        return DecodeBuffer(keys=tuple(batch.keys), kv=kv, pages=counts)

    def _buffer(self, batch: DecodeBatch, pool: torch.Tensor, tails: torch.Tensor, tail_slots: torch.Tensor,
                previous: DecodeBuffer | None) -> DecodeBuffer:
        counts = [len(slots) for slots in batch.page_slots]
        reusable = (
            previous is not None
            and batch.keys
            and previous.keys == tuple(batch.keys)
            and max(counts) <= previous.capacity
            and all(now in (before, before + 1) for now, before in zip(counts, previous.pages, strict=True))
        )
        if not reusable:
            return self._gather(batch, pool, tails, tail_slots, counts)
        assert previous is not None
        capacity = previous.capacity
        for row, (now, before) in enumerate(zip(counts, previous.pages, strict=True)):
            if now == before + 1:  # last step filled the tail page and it was stored as page `before`
                previous.kv[:, :, row, before] = previous.kv[:, :, row, capacity]
        previous.pages = counts
        return previous

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, pool: torch.Tensor, tails: torch.Tensor,
               previous: DecodeBuffer | None = None) -> tuple[torch.Tensor, DecodeBuffer]:
        """One token per sequence; writes its K/V into `tails[tail_slots[i]]`; returns `(B, vocab)`
        logits and the decode buffer to pass to the next step (see `DecodeBuffer`).

        Each layer's keys and values are plain views of the buffer; the new token's K/V are
        written into it per layer and the tail pages copied back to `tails` at the end.
        """
        page = self.page_size
        size = len(batch.token_ids)
        device = pool.device
        ids = torch.tensor(list(batch.token_ids), dtype=torch.long, device=device)
        positions = torch.tensor(list(batch.positions), dtype=torch.long, device=device)
        tail_slots = torch.tensor(list(batch.tail_slots), dtype=torch.long, device=device)
        tail_pos = positions % page
        buffer = self._buffer(batch, pool, tails, tail_slots, previous)
        kv, capacity = buffer.kv, buffer.capacity
        counts = torch.tensor(buffer.pages, device=device)
        span = (capacity + 1) * page
        key_pos = torch.arange(span, device=device)
        valid = torch.where(
            key_pos[None, :] < capacity * page,
            key_pos[None, :] < (counts * page)[:, None],
            key_pos[None, :] - capacity * page <= tail_pos[:, None],
        )
        # An additive float mask, built once per step (a boolean one is converted per call).
        mask = torch.zeros(valid.shape, dtype=q_dtype(self), device=device).masked_fill_(~valid, float("-inf"))
        mask = mask[:, None, None, :]
        rows = torch.arange(size, device=device)
        hidden = self.embed(ids)
        cos, sin = self._rotary(hidden, positions)
        group = self.num_heads // self.num_kv_heads
        for index, layer in enumerate(self.layers):
            residual = hidden
            q, k, v = self._qkv(layer, layer.input_norm(hidden), cos, sin)
            kv[index, :, rows, capacity, tail_pos] = torch.stack((k, v))
            keys = kv[index, 0].view(size, span, self.num_kv_heads, self.head_dim).transpose(1, 2)
            values = kv[index, 1].view(size, span, self.num_kv_heads, self.head_dim).transpose(1, 2)
            # One query token: the query heads sharing a KV head attend as that head's rows
            # (grouped-query attention without expanding K/V).
            out = F.scaled_dot_product_attention(
                q.reshape(size, self.num_kv_heads, group, self.head_dim),
                keys,
                values,
                attn_mask=mask,
                scale=self.scaling,
            )
            hidden = self._mlp_block(layer, residual, out.reshape(size, -1))
        tails[tail_slots] = kv[:, :, :, capacity].permute(2, 1, 0, 3, 4, 5)
        return self._logits(hidden), buffer
