"""The model runner: a causal LM's forward pass with attention over the paged KV cache.

The math is the `transformers` model's own weights — embedding, each decoder layer's norms,
projections and MLP, the rotary embedding, the final norm and the LM head — bound once
(`engine.compute.llm.layers.DecoderWeights`: q/k/v and gate/up fused into one product each,
o_proj and down_proj added onto the residual in one `addmm`, a rotary table), and run in a
loop written here, so that attention reads keys and values laid out for it instead of a
`transformers` cache. The activations are in the model's dtype (float32, or bfloat16 with
float32 statistics where HF takes them so); logits are float32.

Where K/V live (see `engine.data.kv.layout`: a page is `(2, layers, page_size, kv_heads,
head_dim)`, in the model's dtype):

* full pages of a sequence are in the KV store's device pool, addressed by slot;
* the sequence's last, partial page is in a *tail* page that the engine owns (pages in
  the store are immutable and named by the hash of their tokens, which a partial page
  does not have yet).

Attention needs each layer's keys as one `(heads, tokens, dim)` block per sequence. A
prefill chunk lays its prefix pages out so once per chunk (a step's chunks share one
forward pass: their tokens are one block of rows outside attention); a decode batch keeps a
`DecodeBuffer` from step to step, in which each step writes one token per sequence, so
its K/V are gathered from the pages only when the batch changes (see `DecodeBuffer`).
Attention itself is `scaled_dot_product_attention` on views of those buffers; a decode
step attends with the query heads that share a KV head as that head's rows (grouped-query
attention without expanding K/V).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine.compute.llm.layers import DecoderWeights, UnsupportedModelError, rotate, rotate_
from engine.compute.llm.products import MEASURE_MIN_BYTES
from engine.data.kv.layout import KVLayout

__all__ = ["DecodeBatch", "DecodeBuffer", "PagedForward", "PrefillChunk", "PrefillOutput", "UnsupportedModelError"]


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
    tail_slot: int | None = None
    """The engine's tail page slot `tail` is (None without `tail`): a tensor-parallel rank 0
    names it to its followers."""


@dataclass(slots=True)
class DecodeBatch:
    """One new token per sequence, at `positions[i]`, whose K/V go into tail page `tail_slots[i]`.

    `keys` name the sequences (request ids): a batch with the same keys in the same order
    as the previous step's, each one position further, reuses that step's buffer (see
    `DecodeBuffer`).
    """

    token_ids: Sequence[int]
    positions: Sequence[int]
    page_slots: Sequence[Sequence[int]]
    tail_slots: Sequence[int]
    keys: Sequence[str] = ()


HEADROOM_PAGES = 4
"""Pages a decode buffer holds beyond its longest sequence, so it is regathered less often."""


@dataclass(slots=True)
class DecodeBuffer:
    """The K/V of a decode batch, laid out for attention, carried from step to step.

    `kv` is `(layers, K/V, batch, kv_heads, capacity, head_dim)`: sequence `b`'s token at
    position `p` is at `[..., b, :, p, :]`, so each layer's keys are one contiguous
    `(batch, heads, tokens, dim)` block. Rows shorter than the longest hold masked bytes
    beyond their length. While the batch keeps its members and order and each advances
    one position a step, a step only writes its new token (its tail page, stored as a page
    when it fills, is already in place). The pages in the KV store (and the engine's tail
    pages, which each step also updates) stay the source of truth: the buffer is rebuilt
    from them whenever the batch changes or outgrows it.
    """

    keys: tuple[str, ...]
    kv: torch.Tensor
    positions: list[int]
    rows: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]


@dataclass(slots=True)
class PrefillOutput:
    """Per chunk of a `prefill_batch`, in order: its last position's logits (None unless wanted)
    and its fresh pages; and the decode buffer handed over, if any (see `prefill_batch`)."""

    results: list[tuple[torch.Tensor | None, torch.Tensor]]
    buffer: DecodeBuffer | None = None


class PagedForward:
    """Forward passes of one `transformers` causal LM over paged KV. Holds no KV itself."""

    def __init__(self, model: PreTrainedModel, layout: KVLayout, *, packed: bool = True,
                 packed_float32: bool = True, measure_products: bool = True) -> None:
        """`packed`, `packed_float32`: bind packed weights where they may be faster; `measure_products`:
        measure the products' kernels on a large model's weights (`DecoderWeights.of`; off for a
        runner that only prefills)."""
        self.model = model
        self.weights = w = DecoderWeights.of(model, packed=packed, packed_float32=packed_float32,
                                             measure_min_bytes=MEASURE_MIN_BYTES if measure_products else None)
        self.num_heads, self.num_kv_heads, self.head_dim = w.num_heads, w.num_kv_heads, w.head_dim
        self.group = w.num_heads // w.num_kv_heads
        self.q_width = w.num_heads * w.head_dim
        self.qk_width = (w.num_heads + w.num_kv_heads) * w.head_dim
        self.page_size = layout.page_size
        expected = (len(w.layers), w.num_kv_heads, w.head_dim)
        if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != expected:
            raise UnsupportedModelError(f"KV layout {layout.fingerprint()} does not fit the model {expected}")
        if layout.torch_dtype != w.dtype:
            raise UnsupportedModelError(f"KV layout dtype {layout.dtype} is not the model's {w.dtype}")
        self.layout = layout

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    def _embed(self, ids: torch.Tensor, embeds: Sequence[tuple[int, torch.Tensor]] = ()) -> torch.Tensor:
        hidden = self.weights.embed(ids)
        for row, rows in embeds:
            hidden[row : row + rows.shape[0]] = rows.to(hidden.dtype)
        return hidden

    def _qkv(self, layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed projections of `hidden` `(tokens, hidden)`: rotated q+k `(tokens, Hq + Hkv, D)`
        and v `(tokens, Hkv, D)`."""
        tokens = hidden.shape[0]
        qkv = layer.qkv(hidden)
        qk = rotate(qkv[:, : self.qk_width].view(tokens, -1, self.head_dim), cos, sin)
        return qk, qkv[:, self.qk_width :].view(tokens, self.num_kv_heads, self.head_dim)

    # -- prefill -----------------------------------------------------------------------------------

    def _prefill_buffer(self, chunk: PrefillChunk, pool: torch.Tensor, total: int,
                        capacity: int | None = None) -> torch.Tensor:
        """`(layers, K/V, 1, kv_heads, capacity, head_dim)` (capacity: the page-padded end by
        default) holding the prefix pages and the old tail; positions from `total` on are zeros.
        Laid out as a one-sequence `DecodeBuffer`'s `kv`."""
        page = self.page_size
        padded = -(-total // page) * page
        tail_start = chunk.start // page * page
        offset = chunk.start - tail_start
        layout = self.layout
        whole = torch.empty((layout.num_layers, 2, 1, self.num_kv_heads, capacity or padded, self.head_dim),
                            dtype=pool.dtype, device=pool.device)
        kv = whole[:, :, 0]
        kv[:, :, :, total:].zero_()
        if tail_start:
            slots = torch.tensor(list(chunk.prefix_slots), dtype=torch.long, device=pool.device)
            pages = pool.index_select(0, slots)  # (P, 2, L, page, H, D)
            kv[:, :, :, :tail_start].unflatten(3, (len(chunk.prefix_slots), page)).copy_(
                pages.permute(2, 1, 4, 0, 3, 5))
        if offset:
            if chunk.tail is None:
                raise ValueError(f"a chunk starting at {chunk.start} mid-page needs the tail page")
            kv[:, :, :, tail_start : chunk.start] = chunk.tail[:, :, :offset].permute(1, 0, 3, 2, 4)
        return whole

    def _chunk_mask(self, start: int, total: int, device: torch.device) -> torch.Tensor:
        """Additive mask of a chunk after a prefix: query i sits at position start + i and sees
        keys 0..start + i."""
        rows = torch.arange(start, total, device=device)[:, None]
        hidden_keys = torch.arange(total, device=device)[None, :] > rows
        return torch.zeros(hidden_keys.shape, dtype=self.dtype, device=device).masked_fill_(hidden_keys, float("-inf"))

    def prefill(self, chunk: PrefillChunk, pool: torch.Tensor, want_logits: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run `chunk`; returns the last position's logits (if wanted) and the fresh pages.

        Fresh pages, `(n, *page_shape)`, hold the K/V of positions `start // page_size *
        page_size` to `start + len(token_ids)`: the old tail's tokens, then the chunk's
        (zeros after them in the last page).
        """
        return self.prefill_batch([chunk], pool, [want_logits]).results[0]

    @torch.inference_mode()
    def prefill_batch(self, chunks: Sequence[PrefillChunk], pool: torch.Tensor,
                      want_logits: Sequence[bool], decode_key: str | None = None) -> PrefillOutput:
        """Run the chunks of several sequences in one forward pass; per chunk what `prefill` returns.

        The chunks' tokens go through the norms, projections and MLPs as one block of rows (each
        weight is read once per step, not once per sequence); attention runs per chunk, over
        that chunk's own prefix and tokens.

        With `decode_key` (the sequence's key in a `DecodeBatch`), one chunk that completes its
        prompt (logits wanted) keeps its attention buffer, sized as `decode` sizes one, and hands
        it over as `PrefillOutput.buffer`: a decode step of that sequence alone, next, reuses it
        instead of gathering its whole history from the pages again.
        """
        page = self.page_size
        device = pool.device
        spans: list[tuple[int, int]] = []  # each chunk's rows in the block
        buffers, masks, cos_parts, sin_parts, embeds = [], [], [], [], []
        ids: list[int] = []
        for chunk in chunks:
            n, start = len(chunk.token_ids), chunk.start
            if len(chunk.prefix_slots) * page != start // page * page:
                raise ValueError(f"{len(chunk.prefix_slots)} prefix pages for a chunk starting at {start}")
            total = start + n
            capacity = None
            if decode_key is not None and len(chunks) == 1 and want_logits[0]:
                capacity = (total // page + 1 + HEADROOM_PAGES) * page
            buffers.append(self._prefill_buffer(chunk, pool, total, capacity)[:, :, 0])
            masks.append(self._chunk_mask(start, total, device) if start and n > 1 else None)
            cos, sin = self.weights.rotary.span(start, total)
            cos_parts.append(cos)
            sin_parts.append(sin)
            embeds.extend((len(ids) + row, rows) for row, rows in chunk.embeds)
            spans.append((len(ids), len(ids) + n))
            ids.extend(chunk.token_ids)
        hidden = self._embed(torch.tensor(ids, dtype=torch.long, device=device), embeds)
        single = len(chunks) == 1
        cos = cos_parts[0] if single else torch.cat(cos_parts)
        sin = sin_parts[0] if single else torch.cat(sin_parts)
        heads, rows = self.num_heads, len(ids)
        attn = torch.empty((rows, self.q_width), dtype=hidden.dtype, device=device)
        for index, layer in enumerate(self.weights.layers):
            qk, v = self._qkv(layer, hidden, cos, sin)
            for chunk, kv, mask, (first, last) in zip(chunks, buffers, masks, spans, strict=True):
                start, n = chunk.start, last - first
                total = start + n
                kv[index, 0, :, start:total] = qk[first:last, heads:].transpose(0, 1)
                kv[index, 1, :, start:total] = v[first:last].transpose(0, 1)
                out = F.scaled_dot_product_attention(
                    qk[first:last, :heads].transpose(0, 1)[None],
                    kv[index, 0, :, :total][None],
                    kv[index, 1, :, :total][None],
                    attn_mask=mask,
                    is_causal=mask is None and n > 1,
                    scale=self.weights.scaling,
                    enable_gqa=self.group > 1,
                )
                attn[first:last] = out[0].transpose(0, 1).reshape(n, self.q_width)
            hidden = layer.mlp(layer.attention_out(hidden, attn))
        wanted = [last - 1 for (_, last), want in zip(spans, want_logits, strict=True) if want]
        logits = iter(self.weights.logits(hidden[wanted]) if wanted else ())
        results: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        for chunk, kv, want in zip(chunks, buffers, want_logits, strict=True):
            tail_start = chunk.start // page * page
            padded = -(-(chunk.start + len(chunk.token_ids)) // page) * page
            # (L, 2, H, F * page, D) -> (F, 2, L, page, H, D): the pages' own layout.
            fresh = kv[:, :, :, tail_start:padded].unflatten(3, (-1, page)).permute(3, 1, 0, 4, 2, 5).contiguous()
            results.append((next(logits) if want else None, fresh))
        buffer = None
        if decode_key is not None and len(chunks) == 1 and want_logits[0]:
            last = chunks[0].start + len(chunks[0].token_ids) - 1
            buffer = DecodeBuffer(keys=(decode_key,), kv=buffers[0][:, :, None], positions=[last],
                                  rows=torch.arange(1, device=device))
        return PrefillOutput(results, buffer)

    # -- decode ----------------------------------------------------------------------------------

    def _gather(self, batch: DecodeBatch, pool: torch.Tensor, tails: torch.Tensor) -> DecodeBuffer:
        """Build a decode buffer from the pages and tail pages of `batch`."""
        page = self.page_size
        size = len(batch.token_ids)
        counts = [len(slots) for slots in batch.page_slots]
        max_pages = max(counts)
        capacity = (max(max_pages, max(batch.positions) // page) + 1 + HEADROOM_PAGES) * page
        layout = self.layout
        kv = torch.zeros((layout.num_layers, 2, size, self.num_kv_heads, capacity, self.head_dim),
                         dtype=pool.dtype, device=pool.device)
        if max_pages:
            # Padding points at a page some sequence holds: finite bytes, masked out.
            filler = next(slots[0] for slots in batch.page_slots if slots)
            flat = [slot for slots in batch.page_slots for slot in (*slots, *([filler] * (max_pages - len(slots))))]
            # Whole pages gather fastest (contiguous rows); one permuting copy lays them out.
            gathered = pool.index_select(0, torch.tensor(flat, dtype=torch.long, device=pool.device))
            kv[:, :, :, :, : max_pages * page].unflatten(4, (max_pages, page)).copy_(
                gathered.view(size, max_pages, *pool.shape[1:]).permute(3, 2, 0, 5, 1, 4, 6))
        for row, (count, slot) in enumerate(zip(counts, batch.tail_slots, strict=True)):
            # (2, L, page, H, D) -> (L, 2, H, page, D), after the sequence's full pages.
            kv[:, :, row, :, count * page : (count + 1) * page] = tails[slot].permute(1, 0, 3, 2, 4)
        rows = torch.arange(size, device=pool.device)
        return DecodeBuffer(keys=tuple(batch.keys), kv=kv, positions=list(batch.positions), rows=rows)

    def _buffer(self, batch: DecodeBatch, pool: torch.Tensor, tails: torch.Tensor,
                previous: DecodeBuffer | None) -> DecodeBuffer:
        positions = list(batch.positions)
        reusable = (
            previous is not None
            and batch.keys
            and previous.keys == tuple(batch.keys)
            and max(positions) < previous.capacity
            and all(now == before + 1 for now, before in zip(positions, previous.positions, strict=True))
        )
        if not reusable:
            return self._gather(batch, pool, tails)
        assert previous is not None
        previous.positions = positions
        return previous

    @staticmethod
    def _kv_targets(shape: torch.Size, positions: torch.Tensor) -> torch.Tensor:
        """Rows of one layer's `(K/V, batch, kv_heads, capacity, head_dim)` block, flattened to
        `(-1, head_dim)`, that a decode step's new K/V go to: sequence `b`'s K/V head `h` at
        its position, in the order of a step's q/k/v row's K/V part (`[b, K/V, h]`)."""
        _, _, size, kv_heads, capacity, _ = shape
        batch = torch.arange(size, device=positions.device)[:, None, None]
        kind = torch.arange(2, device=positions.device)[None, :, None]
        head = torch.arange(kv_heads, device=positions.device)[None, None, :]
        return (((kind * size + batch) * kv_heads + head) * capacity + positions[:, None, None]).flatten()

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, pool: torch.Tensor, tails: torch.Tensor,
               previous: DecodeBuffer | None = None) -> tuple[torch.Tensor, DecodeBuffer]:
        """One token per sequence; writes its K/V into `tails[tail_slots[i]]`; returns `(B, vocab)`
        logits and the decode buffer to pass to the next step (see `DecodeBuffer`)."""
        size = len(batch.token_ids)
        device = pool.device
        buffer = self._buffer(batch, pool, tails, previous)
        kv, rows = buffer.kv, buffer.rows
        first, last = min(buffer.positions), max(buffer.positions)
        span = last + 1
        positions = torch.tensor(buffer.positions, dtype=torch.long, device=device)
        mask = None
        if first != last:
            hidden_keys = torch.arange(span, device=device)[None, :] > positions[:, None]
            mask = torch.zeros(hidden_keys.shape, dtype=self.dtype, device=device).masked_fill_(
                hidden_keys, float("-inf"))[:, None, None, :]
        hidden = self._embed(torch.tensor(list(batch.token_ids), dtype=torch.long, device=device))
        cos, sin = self.weights.rotary.at(positions)
        kv_heads, dim, q_width, qk_width = self.num_kv_heads, self.head_dim, self.q_width, self.qk_width
        targets = self._kv_targets(kv.shape, positions)
        for index, layer in enumerate(self.weights.layers):
            qkv = layer.qkv(hidden).contiguous()
            rotate_(qkv[:, :qk_width].view(size, -1, dim), cos, sin)
            layer_kv = kv[index]
            # This step's K and V of every sequence and head, one row each, in one copy.
            layer_kv.view(-1, dim).index_copy_(0, targets, qkv[:, q_width:].reshape(-1, dim))
            out = F.scaled_dot_product_attention(
                qkv[:, :q_width].view(size, kv_heads, self.group, dim),
                layer_kv[0, :, :, :span],
                layer_kv[1, :, :, :span],
                attn_mask=mask,
                scale=self.weights.scaling,
            )
            hidden = layer.mlp(layer.attention_out(hidden, out.reshape(size, q_width)))
        # The new tokens' K/V, (B, L, 2, H, D), into their tail pages (2, L, page, H, D).
        tail_slots = torch.tensor(list(batch.tail_slots), dtype=torch.long, device=device)
        tails[tail_slots, :, :, positions % self.page_size] = kv[:, :, rows, :, positions].permute(0, 2, 1, 3, 4)
        return self.weights.logits(hidden), buffer
