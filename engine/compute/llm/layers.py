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
* the kernel of every product by its row count (`engine.compute.llm.products.ProductPlan`),
  measured on these weights where they are large enough to stream from memory, and the
  weights in oneDNN's packed layout where that plan (or, before measuring, the CPU: native
  bfloat16; `packed_float32`) may use them. Packed copies are the one copy made: a second copy
  of the linear weights in this process, beside the shared one the modules keep; a measured
  plan that never takes them drops them.

`RotaryTable` holds cos and signed sin per position (grown on demand), so a step looks its
positions up instead of recomputing them, and rotates in three operations.

Apart from the packed weights, nothing here copies the model: a `DecoderWeights` is views of
the module's tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from engine.compute.llm.products import (
    MEASURE_MIN_BYTES,
    PlannedProducts,
    ProductPlans,
    add_product,
    packed_weight,
    plan_products,
    project,
    static_plan,
)

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

    In float32, `F.rms_norm` computes what the module does. In another dtype the module takes
    its statistics in float32, casts back, then multiplies by the weight; so does this, in two
    operations instead of seven: `F.rms_norm` of a reduced-precision input computes in float32
    and rounds its result once, as the module's cast back does. Any other norm module is
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
        return weight * F.rms_norm(x, shape, None, epsilon)

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
    plans: ProductPlans
    """The kernel of each product by its weight's shape and its rows."""
    qkv_packed: torch.Tensor | None = None
    """The weights above in oneDNN's packed layout, where the plan takes them."""
    o_packed: torch.Tensor | None = None
    gate_up_packed: torch.Tensor | None = None
    down_packed: torch.Tensor | None = None

    def qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        """q, k and v of `input_norm(hidden)`, side by side."""
        return project(self.input_norm(hidden), self.qkv_weight, self.qkv_bias, self.qkv_packed, self.plans)

    def attention_out(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """`residual + o_proj(attn)`."""
        if self.o_weight is not None:
            return add_product(residual, attn, self.o_weight, self.o_packed, self.plans)
        return residual + self.o_proj(attn)

    def mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden + mlp(post_norm(hidden))`."""
        gate_up = project(self.post_norm(hidden), self.gate_up_weight, self.gate_up_bias, self.gate_up_packed,
                          self.plans)
        inner = self.act(gate_up[:, : self.intermediate]).mul_(gate_up[:, self.intermediate :])
        if self.down_weight is not None:
            return add_product(hidden, inner, self.down_weight, self.down_packed, self.plans)
        return hidden + self.down_proj(inner)

    def products(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, packed copy) of each product this layer's step runs with a bound weight."""
        pairs = [(self.qkv_weight, self.qkv_packed), (self.gate_up_weight, self.gate_up_packed)]
        if self.o_weight is not None:
            pairs.append((self.o_weight, self.o_packed))
        if self.down_weight is not None:
            pairs.append((self.down_weight, self.down_packed))
        return pairs

    def with_products(self, planned: PlannedProducts) -> LayerWeights:
        """This layer under `planned`'s plans, with the packed copies they take."""
        return replace(self, plans=planned.plans, qkv_packed=planned.packed_of(self.qkv_weight),
                       o_packed=planned.packed_of(self.o_weight), gate_up_packed=planned.packed_of(self.gate_up_weight),
                       down_packed=planned.packed_of(self.down_weight))

    def planned(self, plans: ProductPlans) -> LayerWeights:
        """This layer under `plans`, without the packed copies they never take."""
        def kept(weight: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor | None:
            return packed if weight is not None and plans.of(weight).packed else None

        return replace(self, plans=plans, qkv_packed=kept(self.qkv_weight, self.qkv_packed),
                       o_packed=kept(self.o_weight, self.o_packed),
                       gate_up_packed=kept(self.gate_up_weight, self.gate_up_packed),
                       down_packed=kept(self.down_weight, self.down_packed))


def _plain(linear: torch.nn.Module) -> torch.Tensor | None:
    """The weight of a bias-free plain `nn.Linear` (its product can be fused with the residual add)."""
    if isinstance(linear, torch.nn.Linear) and linear.bias is None:
        return linear.weight
    return None


def _bind_layer(layer: torch.nn.Module, act: Callable[[torch.Tensor], torch.Tensor]) -> LayerWeights:
    """The layer's weights, not yet planned (`LayerWeights.with_products`)."""
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
        plans=ProductPlans(static_plan(qkv_weight.dtype, packed=False)),
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
    plans: ProductPlans
    """The kernel of each product by its weight's shape and its rows (the layers' too)."""
    lm_packed: torch.Tensor | None = None
    """`lm_weight` in oneDNN's packed layout, where the plans take it."""

    @classmethod
    def of(cls, model: torch.nn.Module, *, packed: bool = True, packed_float32: bool = True,
           measure_min_bytes: int | None = MEASURE_MIN_BYTES) -> DecoderWeights:
        """`packed`: also bind bfloat16 weights in oneDNN's packed layout where `packed_weight` makes
        one; `packed_float32`: float32 weights (for decode). The products' kernels are
        measured on the weights where they hold `measure_min_bytes` or more (`plan_products`;
        None: never); the packed copies no plan takes are dropped."""
        def pack(weight: torch.Tensor) -> torch.Tensor | None:
            if weight.dtype == torch.float32:
                return packed_weight(weight, float32=packed_float32)
            return packed_weight(weight) if packed else None

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
        lm_weight = model.lm_head.weight
        layers = [_bind_layer(layer, act) for layer in inner.layers]
        weights = [w for layer in layers for w, _ in layer.products()] + [lm_weight]
        planned = plan_products(weights, pack, measure_min_bytes=measure_min_bytes)
        return cls(
            embed=inner.embed_tokens,
            layers=tuple(layer.with_products(planned) for layer in layers),
            final_norm=rms_norm(inner.norm),
            lm_weight=lm_weight,
            lm_bias=model.lm_head.bias,
            lm_packed=planned.packed_of(lm_weight),
            plans=planned.plans,
            rotary=RotaryTable(inner.rotary_emb, head_dim, weight.dtype, weight.device),
            num_heads=int(cfg.num_attention_heads),
            num_kv_heads=int(cfg.num_key_value_heads),
            head_dim=head_dim,
            scaling=float(inner.layers[0].self_attn.scaling),
            dtype=weight.dtype,
        )

    def planned(self, plans: ProductPlans) -> DecoderWeights:
        """These weights under `plans`, without the packed copies they never take (a plan that names
        the packed product where there is no copy gets `F.linear`)."""
        lm_packed = self.lm_packed if plans.of(self.lm_weight).packed else None
        return replace(self, plans=plans, layers=tuple(layer.planned(plans) for layer in self.layers),
                       lm_packed=lm_packed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the final hidden states `(rows, hidden)`."""
        return project(self.final_norm(hidden), self.lm_weight, self.lm_bias, self.lm_packed, self.plans).float()
