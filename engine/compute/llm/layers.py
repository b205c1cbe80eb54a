"""A decoder's weights as the paged forward runs them: bound once from the `transformers` modules.

`DecoderWeights.of(model)` takes a Llama/Qwen2-style causal LM and binds, per decoder layer:

* one q/k/v projection and one gate/up projection: the modules' weight rows side by side
  (`fuse_rows`), so a step runs two matrix products where the modules run five. Where the
  rows already lie side by side in memory (a model attached from a host's shared segment,
  which lays a layer's tensors out in order) the fused weight is a view; otherwise it is one
  new tensor and the modules are re-pointed at views of it, so the weights are held once and
  the modules compute what they did;
* o_proj and down_proj: their weight, added onto the residual stream in one `addmm`; or the
  module itself when it is not a plain `nn.Linear` (a tensor-parallel shard's row-parallel
  layer sums over the ranks in its forward);
* the norms: `F.rms_norm`'s fused kernel in float32; in a reduced precision HF's order of
  operations (statistics in float32, the weight applied in the model's dtype);
* the MLP's activation (`transformers`' own, by the config's `hidden_act`);
* in bfloat16 on a CPU whose oneDNN runs bfloat16 natively (AVX512-BF16, AMX), every product's
  weight also in oneDNN's packed layout (`packed_weight`), made once here: `F.linear` packs its
  weight again at every call, which at decode costs more than the product. The packed product
  gives `F.linear`'s numbers to the bit. It is the one copy made: a second copy of the linear
  weights in this process, beside the shared one the modules keep;
* in float32, unless turned off (`packed_float32`), the same packed copy for decode: MKL's
  float32 product over a few rows (1 to `PACKED_FLOAT32_MAX_ROWS`) runs far below the
  weight-read limit, oneDNN's over a packed weight in about 0.35-0.85x its time (SmolLM2-135M's
  LM head at one row: 2.6 ms against `F.linear`'s 7.2 ms on this code's 2-core AVX512 CPU).
  Prefills keep `F.linear`. The numbers are the same products summed in another order (within
  about 1e-4 of `F.linear`'s).

`RotaryTable` holds cos and signed sin per position (grown on demand), so a step looks its
positions up instead of recomputing them, and rotates in three operations.

Apart from the packed weights, nothing here copies the model: a `DecoderWeights` is views of
the module's tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

Norm = Callable[[torch.Tensor], torch.Tensor]


class UnsupportedModelError(TypeError):
    """The model lacks the modules the paged forward drives (a Llama/Qwen2-style decoder)."""


def _adjacent(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `tensors` are contiguous and lie one after another in one storage."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for tensor in tensors:
        if (not tensor.is_contiguous() or tensor.dtype != first.dtype or tensor.device != first.device
                or tensor.untyped_storage().data_ptr() != storage or tensor.storage_offset() != offset):
            return False
        offset += tensor.numel()
    return True


def _side_by_side(tensors: Sequence[torch.Tensor], shape: tuple[int, ...]) -> tuple[torch.Tensor, bool]:
    """`tensors` concatenated along dim 0 as one tensor of `shape`; a view when they already lie
    so (second value False), else a new tensor (True)."""
    if _adjacent(tensors):
        first = tensors[0].detach()
        strides = torch.empty(shape, device="meta").stride()
        return first.as_strided(shape, strides), False
    return torch.cat([t.detach() for t in tensors]), True


@torch.no_grad()
def fuse_rows(linears: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) with the output rows of `linears` in order (see the module docstring).

    When the weights had to be copied, each module's weight (bias) becomes a view of the copy:
    the modules keep computing what they computed, and the old tensors can be freed.
    """
    weights = [linear.weight for linear in linears]
    columns = weights[0].shape[1]
    if any(w.shape[1] != columns or w.dtype != weights[0].dtype for w in weights):
        raise UnsupportedModelError("projections of one input must agree in width and dtype")
    rows = [w.shape[0] for w in weights]
    weight, copied = _side_by_side(weights, (sum(rows), columns))
    if copied:
        _repoint(linears, "weight", weight, rows)
    biases = [linear.bias for linear in linears]
    if all(b is None for b in biases):
        return weight, None
    if any(b is None for b in biases):  # a mixed set: zeros stand in for the missing ones (never re-pointed)
        parts = [b.detach() if b is not None else weight.new_zeros(n) for b, n in zip(biases, rows, strict=True)]
        return weight, torch.cat(parts)
    bias, copied = _side_by_side([b for b in biases if b is not None], (sum(rows),))
    if copied:
        _repoint(linears, "bias", bias, rows)
    return weight, bias


def _repoint(linears: Sequence[torch.nn.Linear], name: str, fused: torch.Tensor, rows: Sequence[int]) -> None:
    start = 0
    for linear, count in zip(linears, rows, strict=True):
        setattr(linear, name, torch.nn.Parameter(fused[start : start + count], requires_grad=False))
        start += count


def rms_norm(norm: torch.nn.Module) -> Norm:
    """A Llama/Qwen2 RMSNorm module as one function of the same weight and epsilon.

    In float32, `F.rms_norm` (one fused kernel) computes what the module does. In another
    dtype the module takes its statistics in float32, casts back, then multiplies by the
    weight; so does this (in three operations instead of seven). Any other norm module is
    returned as it is.
    """
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if type(norm).__name__ not in ("LlamaRMSNorm", "Qwen2RMSNorm") or weight is None or eps is None:
        return norm
    shape, epsilon = (int(weight.shape[0]),), float(eps)
    if weight.dtype == torch.float32:
        def fused(x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float32:
                return norm(x)
            return F.rms_norm(x, shape, weight, epsilon)

        return fused

    def reduced(x: torch.Tensor) -> torch.Tensor:
        return weight * F.rms_norm(x.float(), shape, None, epsilon).to(x.dtype)

    return reduced


class RotaryTable:
    """Rotary factors by position, from the model's own rotary module, in the model's dtype.

    `at(positions)` gives `(cos, signed_sin)`, each `(len(positions), 1, head_dim)`, with the
    first half of sin negated, so that `rotate(x, cos, signed_sin)` equals HF's
    `x * cos + rotate_half(x) * sin`. The table covers positions below `capacity` and doubles
    when a position beyond it is asked for. Rotary types whose factors depend on the sequence
    (`dynamic` scaling) are computed per call instead.
    """

    def __init__(self, rotary: torch.nn.Module, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 4096) -> None:
        self.rotary = rotary
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.static = "dynamic" not in str(getattr(rotary, "rope_type", "default"))
        self._cos = torch.empty((0, 1, head_dim), dtype=dtype, device=device)
        self._sin = self._cos
        if self.static:
            self._grow(capacity)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty((1, 1, self.head_dim), dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, positions[None])
        half = self.head_dim // 2
        signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return cos[0, :, None, :].contiguous(), signed[:, None, :].contiguous()

    def _grow(self, capacity: int) -> None:
        self._cos, self._sin = self._compute(torch.arange(capacity, device=self.device))

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.static:
            return self._compute(positions)
        top = int(positions.max()) if positions.numel() else 0
        if top >= self._cos.shape[0]:
            self._grow(max(2 * self._cos.shape[0], top + 1))
        return self._cos[positions], self._sin[positions]

    def span(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Factors of the positions `start..stop-1` (views of the table where it is static)."""
        if not self.static:
            return self._compute(torch.arange(start, stop, device=self.device))
        if stop > self._cos.shape[0]:
            self._grow(max(2 * self._cos.shape[0], stop))
        return self._cos[start:stop], self._sin[start:stop]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` `(tokens, heads, dim)` with factors `(tokens, 1, dim)` (see
    `RotaryTable`). In float32 the product and sum are one `addcmul`; in a reduced precision
    each product is rounded before the sum, as HF rounds them."""
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    if x.dtype == torch.float32:
        return torch.addcmul(x * cos, rolled, signed_sin)
    return x * cos + rolled * signed_sin


def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`rotate`, written into `x` (which may be a strided view): the same numbers, without a
    new tensor for the result."""
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    if x.dtype == torch.float32:
        return torch.addcmul(x * cos, rolled, signed_sin, out=x)
    return torch.add(x * cos, rolled * signed_sin, out=x)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer, bound for the paged forward (see the module docstring)."""

    input_norm: Norm
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor | None
    """o_proj's weight, or None: then `o_proj` (the module) runs and its output is added."""
    o_proj: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Norm
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor | None
    down_proj: Callable[[torch.Tensor], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]
    intermediate: int
    qkv_packed: torch.Tensor | None = None
    """The weights above in oneDNN's packed layout, where `packed_weight` makes one."""
    o_packed: torch.Tensor | None = None
    gate_up_packed: torch.Tensor | None = None
    down_packed: torch.Tensor | None = None

    def qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        """q, k and v of `input_norm(hidden)`, side by side."""
        return project(self.input_norm(hidden), self.qkv_weight, self.qkv_bias, self.qkv_packed)

    def attention_out(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """`residual + o_proj(attn)`."""
        if self.o_weight is not None:
            return _add_product(residual, attn, self.o_weight, self.o_packed)
        return residual + self.o_proj(attn)

    def mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden + mlp(post_norm(hidden))`."""
        gate_up = project(self.post_norm(hidden), self.gate_up_weight, self.gate_up_bias, self.gate_up_packed)
        inner = self.act(gate_up[:, : self.intermediate]).mul_(gate_up[:, self.intermediate :])
        if self.down_weight is not None:
            return _add_product(hidden, inner, self.down_weight, self.down_packed)
        return hidden + self.down_proj(inner)


SMALL_BATCH = 32
"""Up to this many rows, `project` multiplies a bfloat16 weight as `weight @ x.T`."""

PACKED_FLOAT32_MAX_ROWS = 64
"""Up to this many rows, `project` multiplies a packed float32 weight by oneDNN;
from about 256 rows MKL's `F.linear` is as fast or faster."""

PACKED_FLOAT32_HINT_ROWS = 16
"""The row count oneDNN lays a packed float32 weight out for (a decode batch)."""


def native_bfloat16() -> bool:
    """Whether this CPU's oneDNN runs bfloat16 products natively (AVX512-BF16, AMX). Where it does
    not, bfloat16 products are emulated: several times slower than float32 ones."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed_weight(weight: torch.Tensor, *, float32: bool = False) -> torch.Tensor | None:
    """`weight` in oneDNN's packed layout for `project`, where that is faster than `F.linear`:
    bfloat16 on a CPU whose oneDNN runs bfloat16 natively; float32 where `float32` asks for it
    (a second copy of the weight, for decode); None elsewhere."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and native_bfloat16():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    if weight.dtype == torch.float32 and float32:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FLOAT32_HINT_ROWS)
    return None


def _takes_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether `project` multiplies `x` `(..., in)` by `packed`: always in bfloat16; in float32 for up
    to `PACKED_FLOAT32_MAX_ROWS` rows (all of `x`'s leading dimensions together)."""
    if packed is None:
        return False
    return x.dtype != torch.float32 or x.numel() <= PACKED_FLOAT32_MAX_ROWS * x.shape[-1]


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for `x` `(rows, in)`, by the product that reads `weight` fastest.

    With `packed` (`packed_weight(weight)`), oneDNN's product over it: in bfloat16
    `F.linear`'s numbers without its packing `weight` again at each call; in float32 for the
    rows `_takes_packed` gives it (the same products, summed in another order). Otherwise, as
    follows.

    A decode step is a few rows against weights that do not fit in cache, so a product costs
    what reading its weight costs, unless the kernel first repacks the weight (reads it and
    writes it again), as oneDNN's bfloat16 matrix product does for its right-hand operand. In
    bfloat16 (the CPU's AVX512-BF16/AMX kernels), one row goes through `mv`, which streams the
    weight, and up to `SMALL_BATCH` rows as `weight @ x.T`, the weight the left operand, which
    is not repacked: a decode step of SmolLM2-135M took 1.1-1.6x less time so at batch 1, 4
    and 16 than through `F.linear`. The products are the same, summed in another order (HF's
    `F.linear` rounds each to bfloat16 as these do). Float32 (MKL) and longer inputs (a
    prefill, where repacking pays for itself) take `F.linear`. The result may be a transposed
    view.
    """
    if _takes_packed(x, packed):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if x.dtype == torch.bfloat16 and x.shape[0] <= SMALL_BATCH:
        out = torch.mv(weight, x[0])[None] if x.shape[0] == 1 else torch.mm(weight, x.t()).t()
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def _add_product(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 packed: torch.Tensor | None) -> torch.Tensor:
    """`residual + x @ weight.T`. In float32 one `addmm` (the product is rounded to float32 before
    the sum either way). In a reduced precision HF rounds the product to that precision before it
    adds it, which `addmm` would not: there it is two operations, as HF does them. A packed
    float32 weight adds in oneDNN's product (its `add` post-op)."""
    if residual.dtype == torch.float32:
        if _takes_packed(x, packed):
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")
        return torch.addmm(residual, x, weight.t())
    return residual + project(x, weight, packed=packed)


def _plain(linear: torch.nn.Module) -> torch.Tensor | None:
    """The weight of a bias-free plain `nn.Linear` (its product can be fused with the residual add)."""
    if isinstance(linear, torch.nn.Linear) and linear.bias is None:
        return linear.weight
    return None


def _unpacked(weight: torch.Tensor) -> None:
    return None


def _bind_layer(layer: torch.nn.Module, act: Callable[[torch.Tensor], torch.Tensor],
                pack: Callable[[torch.Tensor], torch.Tensor | None]) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    for name, module in (("q_proj", attn.q_proj), ("k_proj", attn.k_proj), ("v_proj", attn.v_proj),
                         ("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj)):
        if not isinstance(module, torch.nn.Linear):
            raise UnsupportedModelError(f"{name} is a {type(module).__name__}, not a linear layer")
    qkv_weight, qkv_bias = fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up_weight, gate_up_bias = fuse_rows([mlp.gate_proj, mlp.up_proj])
    o_weight, down_weight = _plain(attn.o_proj), _plain(mlp.down_proj)
    return LayerWeights(
        input_norm=rms_norm(layer.input_layernorm),
        qkv_weight=qkv_weight,
        qkv_bias=qkv_bias,
        o_weight=o_weight,
        o_proj=attn.o_proj,
        post_norm=rms_norm(layer.post_attention_layernorm),
        gate_up_weight=gate_up_weight,
        gate_up_bias=gate_up_bias,
        down_weight=down_weight,
        down_proj=mlp.down_proj,
        act=act,
        intermediate=int(mlp.gate_proj.weight.shape[0]),
        qkv_packed=pack(qkv_weight),
        o_packed=None if o_weight is None else pack(o_weight),
        gate_up_packed=pack(gate_up_weight),
        down_packed=None if down_weight is None else pack(down_weight),
    )


@dataclass(frozen=True, slots=True)
class DecoderWeights:
    """A Llama/Qwen2-style causal LM bound for the paged forward."""

    embed: torch.nn.Module
    layers: tuple[LayerWeights, ...]
    final_norm: Norm
    lm_weight: torch.Tensor
    lm_bias: torch.Tensor | None
    rotary: RotaryTable
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    dtype: torch.dtype
    lm_packed: torch.Tensor | None = None
    """`lm_weight` in oneDNN's packed layout, where `packed_weight` makes one."""

    @classmethod
    def of(cls, model: torch.nn.Module, *, packed: bool = True, packed_float32: bool = True) -> DecoderWeights:
        """`packed`: also bind the weights in oneDNN's packed layout where `packed_weight` makes
        one; `packed_float32`: float32 weights too (for decode)."""
        pack = partial(packed_weight, float32=packed_float32) if packed else _unpacked
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or any(not hasattr(inner, name) for name in needed) or not hasattr(model, "lm_head"):
            raise UnsupportedModelError(f"{type(model).__name__} is not a Llama/Qwen2-style decoder")
        cfg = model.config
        act_name = getattr(cfg, "hidden_act", "silu")
        if act_name not in ACT2FN:
            raise UnsupportedModelError(f"activation {act_name!r} is not one transformers knows")
        act = ACT2FN[act_name]
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        weight = inner.embed_tokens.weight
        if not isinstance(model.lm_head, torch.nn.Linear):
            raise UnsupportedModelError(f"lm_head is a {type(model.lm_head).__name__}, not a linear layer")
        return cls(
            embed=inner.embed_tokens,
            layers=tuple(_bind_layer(layer, act, pack) for layer in inner.layers),
            final_norm=rms_norm(inner.norm),
            lm_weight=model.lm_head.weight,
            lm_bias=model.lm_head.bias,
            lm_packed=pack(model.lm_head.weight),
            rotary=RotaryTable(inner.rotary_emb, head_dim, weight.dtype, weight.device),
            num_heads=int(cfg.num_attention_heads),
            num_kv_heads=int(cfg.num_key_value_heads),
            head_dim=head_dim,
            scaling=float(inner.layers[0].self_attn.scaling),
            dtype=weight.dtype,
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the final hidden states `(rows, hidden)`.

        A few rows (2 to 15) with no packed weight for them go through the LM head as `W @ h^T`: on this code's CPU (MKL,
        AVX2) `F.linear`'s form of that product over a vocabulary-sized weight took about three
        times as long at 4 rows as at 1 (it repacks the weight), the transposed form did not; the
        two give the same numbers. Other counts as `project` takes them (`mv` for one bfloat16 row).
        """
        normed = self.final_norm(hidden)
        if not _takes_packed(normed, self.lm_packed) and 1 < normed.shape[0] < 16:
            out = torch.mm(self.lm_weight, normed.t()).t()
            if self.lm_bias is not None:
                out = out + self.lm_bias
            return out.float()
        return project(normed, self.lm_weight, self.lm_bias, self.lm_packed).float()
