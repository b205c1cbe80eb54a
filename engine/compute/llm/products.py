"""Which kernel multiplies activations by a weight: per row count, chosen for this CPU.

A decode step is a few rows against weights that do not fit in cache, so a product costs
what reading its weight costs — unless the kernel reads it slowly or first repacks it. Which
of torch's CPU kernels reads fastest depends on the CPU, the dtype and the row count, and
not by a little: on one 2-core AVX512 CPU (AMD, no AMX) oneDNN's float32 product over a
packed weight read SmolLM2-135M's LM head at one row 2.8x faster than MKL's `F.linear`; on
another (Intel, AMX) a decode step of that model at one row took 1.2x longer with it. So a model's products follow a plan (`ProductPlan`; `ProductPlans` can hold one per weight
shape) naming a kernel per row class — one row, a decode batch (2 to `FEW_ROWS_MAX`), more (prefill) —
among:

* `Product.LINEAR`: `F.linear` (MKL in float32; oneDNN, packing the weight again at every
  call, in bfloat16);
* `Product.TRANSPOSED`: the weight as the left operand, `W @ x.T` (`mv` for one row), which
  streams the weight and is never repacked;
* `Product.PACKED`: oneDNN's product over a copy of the weight in its packed layout
  (`packed_weight`), made once when the weights are bound. It is a second copy of the weight
  in the process, beside the (possibly host-shared) one the modules keep, and cannot be
  shared between processes (oneDNN's packed tensors are opaque).

In float32, `plan_products` measures the one-row and decode-batch kernels on the model's own
weights, every weight in a step's order in one pass (so that each product streams from memory
as in a decode; best of a few passes; a decode batch at 4 and 16 rows together), where the
weights are large enough for it to matter (`MEASURE_MIN_BYTES`); otherwise, and in bfloat16, a
plan takes `static_plan`. A plan that takes no packed product keeps no packed copy. The kernels compute the same
products, summed in another order: numbers agree within float rounding (bfloat16's products
are rounded to bfloat16 as `F.linear` rounds them; `PACKED` gives `F.linear`'s bfloat16
numbers to the bit).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

FEW_ROWS_MAX = 64
"""Up to this many rows a product is a decode batch's (`ProductPlan.few_rows`); from about 256
rows MKL's and oneDNN's `F.linear` are as fast as any other kernel."""

FEW_ROWS_PROBE = 16
"""The row count oneDNN lays a packed float32 weight out for (a decode batch)."""

FEW_ROWS_PROBES = (4, 16)
"""The decode batches `plan_products` times a kernel at: the fastest in all of them together
takes `ProductPlan.few_rows` (the transposed form that wins at 16 rows can lose by 2x at 4)."""

MEASURE_MIN_BYTES = 64 << 20
"""Weights of fewer bytes (together) take `static_plan`: they stay in the CPU's caches from step
to step, where the kernels' reading speed is not what a step costs."""

MEASURE_PASSES = 3
"""Timed passes over the weights per kernel and row class (after one untimed): the fastest counts."""


class Product(enum.Enum):
    """A kernel for `x @ W.T` (see the module docstring)."""

    LINEAR = "linear"
    TRANSPOSED = "transposed"
    PACKED = "packed"


@dataclass(frozen=True, slots=True)
class ProductPlan:
    """The kernel per row class; `measured`: chosen by `plan_products`' timings, not `static_plan`."""

    one_row: Product
    few_rows: Product
    many_rows: Product
    measured: bool = False

    def kernel(self, rows: int) -> Product:
        if rows == 1:
            return self.one_row
        return self.few_rows if rows <= FEW_ROWS_MAX else self.many_rows

    @property
    def packed(self) -> bool:
        """Whether any row class takes the packed product (the packed copies are needed)."""
        return Product.PACKED in (self.one_row, self.few_rows, self.many_rows)

    def __str__(self) -> str:
        how = "measured" if self.measured else "static"
        return f"one_row={self.one_row.value} few_rows={self.few_rows.value} many_rows={self.many_rows.value} ({how})"


class ProductPlans:
    """The plan of each weight shape of one model; other shapes take `default`."""

    __slots__ = ("by_shape", "default")

    def __init__(self, default: ProductPlan, by_shape: Mapping[tuple[int, int], ProductPlan] | None = None) -> None:
        self.default = default
        self.by_shape = dict(by_shape or {})

    def of(self, weight: torch.Tensor) -> ProductPlan:
        return self.by_shape.get((weight.shape[0], weight.shape[1]), self.default)

    @property
    def measured(self) -> bool:
        return self.default.measured or any(plan.measured for plan in self.by_shape.values())

    def __str__(self) -> str:
        shapes = "; ".join(f"{out}x{inp}: {plan}" for (out, inp), plan in self.by_shape.items())
        return shapes or str(self.default)


def native_bfloat16() -> bool:
    """Whether this CPU's oneDNN runs bfloat16 products natively (AVX512-BF16, AMX). Where it does
    not, bfloat16 products are emulated: several times slower than float32 ones."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed_weight(weight: torch.Tensor, *, float32: bool = False) -> torch.Tensor | None:
    """`weight` in oneDNN's packed layout, where the packed product exists and may be the fastest:
    bfloat16 on a CPU whose oneDNN runs bfloat16 natively; float32 where `float32` asks for it;
    None elsewhere."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and native_bfloat16():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    if weight.dtype == torch.float32 and float32:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), FEW_ROWS_PROBE)
    return None


def static_plan(dtype: torch.dtype, packed: bool) -> ProductPlan:
    """The plan without measuring (`packed`: whether packed copies exist). bfloat16: the packed
    product for every row count where there is one (it gives `F.linear`'s numbers without
    repacking), else the transposed form up to a decode batch. float32: packed for a decode
    where there is a packed copy, else `F.linear`."""
    if dtype == torch.float32:
        decode = Product.PACKED if packed else Product.LINEAR
        return ProductPlan(one_row=decode, few_rows=decode, many_rows=Product.LINEAR)
    if packed:
        return ProductPlan(one_row=Product.PACKED, few_rows=Product.PACKED, many_rows=Product.PACKED)
    return ProductPlan(one_row=Product.TRANSPOSED, few_rows=Product.TRANSPOSED, many_rows=Product.LINEAR)


def multiply(kernel: Product, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             packed: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by `kernel`, for `x` `(..., in)`. `PACKED` without a packed copy
    of this weight (a module that is not a plain linear has none) is `F.linear`. `TRANSPOSED`'s
    result may be a transposed view."""
    if kernel is Product.PACKED and packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if kernel is Product.TRANSPOSED:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.mv(weight, flat[0])[None] if flat.shape[0] == 1 else torch.mm(weight, flat.t()).t().contiguous()
        if bias is not None:
            out = out + bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def rows_of(x: torch.Tensor) -> int:
    """Rows of `x` `(..., in)`: all its leading dimensions together."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None,
            plans: ProductPlans) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the kernel `weight`'s plan takes for `x`'s rows."""
    return multiply(plans.of(weight).kernel(rows_of(x)), x, weight, bias, packed)


def add_product(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                plans: ProductPlans) -> torch.Tensor:
    """`residual + x @ weight.T`. In float32 one operation: `addmm` (`addmv` for the transposed
    form of one row; the product is rounded to float32 before the sum either way), or oneDNN's
    packed product with its `add` post-op (the transposed form's result is a transposed view, as
    `multiply`'s). In a reduced precision HF rounds the product to that
    precision before it adds it, which `addmm` would not: there it is two operations, as HF does
    them."""
    kernel = plans.of(weight).kernel(rows_of(x))
    if residual.dtype != torch.float32:
        return residual + multiply(kernel, x, weight, None, packed)
    if kernel is Product.PACKED and packed is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")
    if kernel is Product.TRANSPOSED and x.dim() == 2:
        if x.shape[0] == 1:
            return torch.addmv(residual[0], weight, x[0])[None]
        return torch.addmm(residual.t(), weight, x.t()).t().contiguous()
    return torch.addmm(residual, x, weight.t())


def _pass_seconds(kernel: Product, rows: int, products: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> float:
    """Seconds of the fastest of `MEASURE_PASSES` passes of `kernel` over every weight at `rows` rows."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w, _ in products}
    best = float("inf")
    for attempt in range(MEASURE_PASSES + 1):
        started = time.perf_counter()
        for weight, packed in products:
            multiply(kernel, inputs[weight.shape[1]], weight, None, packed)
        if attempt:
            best = min(best, time.perf_counter() - started)
    return best


@dataclass(frozen=True, slots=True)
class PlannedProducts:
    """`plan_products`' answer: the plans, and the packed copy of each weight they take it for."""

    plans: ProductPlans
    packed: Mapping[int, torch.Tensor]
    """Packed copies by `id` of their weight (the weights are alive as long as the model is)."""

    def packed_of(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        return None if weight is None else self.packed.get(id(weight))


@torch.inference_mode()
def plan_products(weights: Sequence[torch.Tensor], pack: Callable[[torch.Tensor], torch.Tensor | None], *,
                  measure_min_bytes: int | None = MEASURE_MIN_BYTES) -> PlannedProducts:
    """The plan for the weights of one model's step (in the order a step multiplies by them), and
    their packed copies (`pack` makes one, or None where there is no packed product): in float32,
    measured where the weights hold at least `measure_min_bytes` in all (see the module docstring;
    None: never), else `static_plan`. Measuring times each candidate — `LINEAR`, `TRANSPOSED`, and
    `PACKED` where `pack` makes copies — over every weight in that order, as a step reads them (a
    shape's weights timed apart, from caches a step does not have, favoured kernels that lost in
    whole steps), at one row and at a decode batch's 4 and 16 rows together; the copies are dropped
    where neither takes them. Many rows keep `static_plan`'s kernel.

    bfloat16 keeps `static_plan` (packed where the CPU runs bfloat16 natively): measured so on
    SmolLM2-135M (AMX), whole decode steps under measured plans were no faster than under the
    packed one, within the steps' noise, and at times slower."""
    if not weights:
        raise ValueError("no weights to plan products for")
    first = weights[0]
    pairs = [(w, pack(w)) for w in weights]
    packed = all(p is not None for _, p in pairs)
    default = static_plan(first.dtype, packed)
    total = sum(w.numel() * w.element_size() for w in weights)
    if (measure_min_bytes is None or total < measure_min_bytes or first.device.type != "cpu"
            or first.dtype != torch.float32):
        return PlannedProducts(ProductPlans(default), {id(w): p for w, p in pairs if p is not None})
    started = time.perf_counter()
    candidates = [Product.LINEAR, Product.TRANSPOSED] + ([Product.PACKED] if packed else [])
    chosen = {}
    for probe in ((1,), FEW_ROWS_PROBES):
        seconds = {kernel: sum(_pass_seconds(kernel, rows, pairs) for rows in probe) for kernel in candidates}
        chosen[probe] = min(seconds, key=seconds.__getitem__)
        log.debug("%s products at %s row(s): %s", first.dtype, "+".join(map(str, probe)),
                  ", ".join(f"{k.value} {s * 1e3:.2f} ms" for k, s in seconds.items()))
    plan = ProductPlan(one_row=chosen[(1,)], few_rows=chosen[FEW_ROWS_PROBES], many_rows=default.many_rows,
                       measured=True)
    log.info("products measured on %.0f MB of %s weights in %.1f s: %s", total / 1e6, first.dtype,
             time.perf_counter() - started, plan)
    kept = {id(w): p for w, p in pairs if p is not None} if plan.packed else {}
    return PlannedProducts(ProductPlans(plan), kept)
