"""The LLM's transformer run over image tokens that attend to a prompt's K/V.

`ImageTokenForward` drives the *same* weights as the LLM runner (`PagedForward`), bound the
same way (`engine.compute.llm.layers.DecoderWeights`: each decoder layer's norms, fused q/k/v
and gate/up projections, o/down added onto the residual, the final norm) from one
`transformers` Llama/Qwen2 model; nothing is copied. Image tokens sit at
positions right after their prompt; their queries attend to the prompt's K/V (computed
once, causally, by the LLM path) and to every image token's K/V (bidirectional).

Classifier-free guidance runs its branches (conditional and unconditional prompt) as
one batch: `KVBatch` pads the branches' prompts to one length and masks the padding.
Its buffer holds the prompt K/V once per denoising run; each step only writes the image
tokens' K/V behind them.

`joint_forward` is the reference path that recomputes the prompt: one masked forward
over `[prompt ; image tokens]` per branch (causal within the prompt, prompt rows blind
to the image, image rows see everything), written independently of the paged prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine.compute.llm.layers import DecoderWeights, LayerWeights, UnsupportedModelError
from engine.compute.llm.products import project
from engine.compute.prefix.keys import MultimodalItem
from engine.data.kv.layout import KVLayout


class DiffusionModelError(TypeError):
    """The model is not a Llama/Qwen2-style decoder, or a KV does not fit it."""


@dataclass(frozen=True, slots=True)
class PromptKV:
    """A prompt's K/V for every layer: `keys`/`values` are `(layers, tokens, kv_heads, head_dim)`."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])

    @classmethod
    def from_pages(cls, pages: torch.Tensor | Sequence[torch.Tensor], length: int) -> PromptKV:
        """The first `length` tokens of KV pages laid out as `KVLayout.page_shape`
        (`(2, layers, page, kv_heads, head_dim)` each), in sequence order."""
        stacked = pages if isinstance(pages, torch.Tensor) else torch.stack(list(pages))
        n, two, layers, page, heads, dim = stacked.shape
        if length > n * page or length <= 0:
            raise DiffusionModelError(f"{n} pages of {page} tokens cannot hold a {length}-token prompt")
        flat = stacked.permute(1, 2, 0, 3, 4, 5).reshape(two, layers, n * page, heads, dim)[:, :, :length]
        return cls(keys=flat[0], values=flat[1])

    def page(self, index: int, layout: KVLayout) -> torch.Tensor:
        """Full page `index` in the layout's page shape (a new tensor)."""
        page = layout.page_size
        if (index + 1) * page > self.length:
            raise DiffusionModelError(f"page {index} of a {self.length}-token prompt is not full")
        rows = slice(index * page, (index + 1) * page)
        return torch.stack((self.keys[:, rows], self.values[:, rows])).contiguous()

    def to_pages(self, layout: KVLayout) -> torch.Tensor:
        """`(n, *layout.page_shape)` pages (the last zero-padded): how a KV store holds them."""
        page = layout.page_size
        n = -(-self.length // page)
        kv = torch.stack((self.keys, self.values))  # (2, L, T, H, D)
        padded = F.pad(kv, (0, 0, 0, 0, 0, n * page - self.length))
        return padded.reshape(2, kv.shape[1], n, page, *kv.shape[3:]).permute(2, 0, 1, 3, 4, 5).contiguous()


@dataclass(slots=True)
class KVBatch:
    """Branches' prompt K/V padded into one buffer, with room for `num_image` image tokens.

    `kv` is `(layers, 2, branches, kv_heads, prompt_len + num_image, head_dim)`: each branch's
    prompt keys from 0, padding up to `prompt_len` (masked), image tokens after it.
    `mask` is additive, `(branches, 1, 1, prompt_len + num_image)`; `starts` are the image
    tokens' first positions (each branch's own prompt length).
    """

    kv: torch.Tensor
    mask: torch.Tensor | None
    prompt_len: int
    starts: torch.Tensor

    @classmethod
    def of(cls, prompts: Sequence[PromptKV], num_image: int) -> KVBatch:
        if not prompts:
            raise DiffusionModelError("a batch needs at least one prompt")
        lengths = [p.length for p in prompts]
        width = max(lengths)
        first = prompts[0].keys
        layers, _, heads, dim = first.shape
        kv = torch.zeros((layers, 2, len(prompts), heads, width + num_image, dim), dtype=first.dtype,
                         device=first.device)
        for b, prompt in enumerate(prompts):
            kv[:, 0, b, :, : prompt.length] = prompt.keys.transpose(1, 2)
            kv[:, 1, b, :, : prompt.length] = prompt.values.transpose(1, 2)
        mask = None
        if min(lengths) != width:
            key_pos = torch.arange(width + num_image, device=first.device)
            valid = (key_pos[None, :] < torch.tensor(lengths, device=first.device)[:, None]) | (key_pos >= width)
            mask = torch.zeros(valid.shape, dtype=first.dtype, device=first.device)
            mask = mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]
        return cls(kv=kv, mask=mask, prompt_len=width, starts=torch.tensor(lengths, device=first.device))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` is `(B, tokens, heads, dim)`, `cos`/`sin` `(B, tokens, dim)`."""
    return x * cos[:, :, None, :] + _rotate_half(x) * sin[:, :, None, :]


@dataclass(frozen=True, slots=True)
class ImageRotary:
    """The image tokens' rotary factors, prepared once per denoising run: `cos` and `signed_sin`
    are `(B, tokens, 1, dim)`, `signed_sin` with its first half negated, so that rotating is
    `x * cos + roll(x, dim / 2) * signed_sin` (= `x * cos + rotate_half(x) * sin`, in 3 ops, not 7)."""

    cos: torch.Tensor
    signed_sin: torch.Tensor

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor) -> ImageRotary:
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cls(cos[:, :, None, :].contiguous(), signed[:, :, None, :].contiguous())

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x * self.cos, x.roll(x.shape[-1] // 2, dims=-1), self.signed_sin)


class ImageTokenForward:
    """The LLM's decoder layers over image tokens (see the module docstring). Holds no state
    between calls besides the bound modules."""

    def __init__(self, model: PreTrainedModel) -> None:
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or any(not hasattr(inner, name) for name in needed):
            raise DiffusionModelError(f"{type(model).__name__} is not a Llama/Qwen2-style decoder")
        try:
            # Denoising multiplies a step's image tokens (64 and more rows), where MKL's float32
            # product is as fast: no packed float32 copy of the weights for it.
            self.weights = DecoderWeights.of(model, packed_float32=False, measure_min_bytes=None)
        except UnsupportedModelError as exc:
            raise DiffusionModelError(str(exc)) from exc
        cfg = model.config
        self.model = model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.hidden_size = int(cfg.hidden_size)
        self.num_heads = self.weights.num_heads
        self.num_kv_heads = self.weights.num_kv_heads
        self.head_dim = self.weights.head_dim
        self.scaling = self.weights.scaling
        self._qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim

    def _project(self, layer: LayerWeights, normed: torch.Tensor):
        """Normed hidden states `(B, n, hidden)` -> q+k `(B, n, Hq + Hkv, D)` (not yet rotated), v
        `(B, n, Hkv, D)`."""
        b, n, _ = normed.shape
        qkv = project(normed, layer.qkv_weight, layer.qkv_bias, layer.qkv_packed, layer.plans)
        qk = qkv[..., : self._qk_width].view(b, n, -1, self.head_dim)
        return qk, qkv[..., self._qk_width :].view(b, n, self.num_kv_heads, self.head_dim)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """`q` `(B, n, Hq, D)`; keys/values `(B, Hkv, T, D)` -> `(B, n, Hq * D)`."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scaling,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)

    @staticmethod
    def _rest(layer: LayerWeights, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The layer after attention: o_proj onto the residual, then the MLP block, over `(B, n, .)` rows."""
        b, n, width = hidden.shape
        flat = layer.attention_out(hidden.reshape(b * n, width), attn_out.reshape(b * n, -1))
        return layer.mlp(flat).view(b, n, width)

    def image_rotary(self, hidden: torch.Tensor, batch: KVBatch) -> ImageRotary:
        """The rotary factors of the image tokens' positions (right after each branch's prompt);
        the same at every step, so a denoising run prepares them once."""
        n = hidden.shape[1]
        positions = batch.starts[:, None] + torch.arange(n, device=hidden.device)[None, :]
        return ImageRotary.of(*self.rotary(hidden, positions))

    @torch.inference_mode()
    def image_step(self, hidden: torch.Tensor, batch: KVBatch, rotary: ImageRotary | None = None) -> torch.Tensor:
        """Image-token inputs `(B, N, hidden)` -> final-normed hidden states `(B, N, hidden)`.

        Writes the image tokens' K/V into `batch.kv` behind the prompt (overwritten next step).
        `rotary` is `image_rotary(hidden, batch)`, computed here when not given. When `hidden`
        is one row broadcast to the B branches (`expand`, as classifier-free guidance gives
        it), the first layer's norm and projections run once for all of them.
        """
        rope = rotary if rotary is not None else self.image_rotary(hidden, batch)
        b, n, _ = hidden.shape
        start = batch.prompt_len
        heads = self.num_heads
        shared = b > 1 and hidden.stride(0) == 0
        for index, layer in enumerate(self.weights.layers):
            if shared:
                qk, v = (t.expand(b, -1, -1, -1) for t in self._project(layer, layer.input_norm(hidden[:1])))
                shared = False
            else:
                qk, v = self._project(layer, layer.input_norm(hidden))
            # One rotary pass over queries and keys together (elementwise: the same numbers).
            qk = rope.apply(qk)
            layer_kv = batch.kv[index]
            layer_kv[0, :, :, start:] = qk[:, :, heads:].transpose(1, 2)
            layer_kv[1, :, :, start:] = v.transpose(1, 2)
            hidden = self._rest(layer, hidden, self._attend(qk[:, :, :heads], layer_kv[0], layer_kv[1], batch.mask))
        return self.weights.final_norm(hidden)

    @torch.inference_mode()
    def joint_forward(self, prompts: Sequence[Sequence[int]], image_hidden: torch.Tensor,
                      items: Sequence[Sequence[MultimodalItem]] = ()) -> torch.Tensor:
        """Recompute each branch's prompt together with the image tokens; returns the image
        tokens' final-normed hidden states `(B, N, hidden)`. `prompts[b]` are token ids,
        `items[b]` multimodal items whose embeddings replace placeholder rows."""
        b, n, _ = image_hidden.shape
        if len(prompts) != b:
            raise DiffusionModelError(f"{len(prompts)} prompts for {b} image branches")
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        device = image_hidden.device
        ids = torch.zeros((b, width), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
        prompt_hidden = self.embed(ids)
        for row, row_items in enumerate(items):
            for item in row_items:
                if item.embeds is not None:
                    prompt_hidden[row, item.start : item.end] = item.embeds.to(prompt_hidden.dtype)
        hidden = torch.cat((prompt_hidden, image_hidden.to(prompt_hidden.dtype)), dim=1)
        total = width + n
        lens = torch.tensor(lengths, device=device)
        pos = torch.arange(total, device=device)
        positions = torch.where(pos[None, :] < width, pos[None, :], lens[:, None] + pos[None, :] - width)
        key_valid = (pos[None, :] < lens[:, None]) | (pos[None, :] >= width)  # (B, T)
        causal = (pos[None, :] <= pos[:, None]) & (pos[None, :] < width)  # prompt rows: (T, T)
        is_image_row = (pos >= width)[:, None]
        allowed = key_valid[:, None, :] & (is_image_row[None] | causal[None])  # (B, T, T)
        mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=device).masked_fill_(~allowed, float("-inf"))
        mask = mask[:, None]
        cos, sin = self.rotary(hidden, positions)
        heads = self.num_heads
        for layer in self.weights.layers:
            qk, v = self._project(layer, layer.input_norm(hidden))
            qk = _rope(qk, cos, sin)
            out = self._attend(qk[:, :, :heads], qk[:, :, heads:].transpose(1, 2), v.transpose(1, 2), mask)
            hidden = self._rest(layer, hidden, out)
        return self.weights.final_norm(hidden[:, width:])
