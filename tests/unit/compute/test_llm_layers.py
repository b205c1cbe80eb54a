"""The model runner's bound weights and its paged forward, against the `transformers` modules
they are bound from (independent references: the modules' own forward, a full recomputation)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine.compute.llm import EngineConfig, LLMEngine
from engine.compute.llm.forward import DecodeBatch, PagedForward, PrefillChunk
from engine.compute.llm.layers import (
    DecoderWeights,
    RotaryTable,
    UnsupportedModelError,
    fuse_rows,
    rms_norm,
    rotate,
)
from engine.compute.llm.products import (
    FEW_ROWS_MAX,
    Product,
    ProductPlan,
    ProductPlans,
    add_product,
    multiply,
    project,
)
from engine.compute.models import LoadedModel, ModelLoadError, build_model, load_builtin, model_dtype
from engine.compute.models.catalog import BUILTIN_MODELS
from engine.compute.sampling import SamplingParams
from engine.data.kv.layout import KVLayout


def linears(*rows: int, bias: bool = False) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(8, n, bias=bias) for n in rows]


@pytest.mark.parametrize("bias", [False, True])
def test_fused_rows_copy_once_and_the_modules_become_views_of_the_copy(bias):
    mods = linears(4, 2, 2, bias=bias)
    x = torch.randn(3, 8)
    before = [m(x) for m in mods]
    weight, fused_bias = fuse_rows(mods)
    assert weight.shape == (8, 8)
    # One GEMM over the fused rows against three: the BLAS may block them differently, so rounding
    # (never more) may differ.
    torch.testing.assert_close(torch.nn.functional.linear(x, weight, fused_bias), torch.cat(before, dim=1),
                               rtol=1e-6, atol=1e-6)
    # Each module now reads its rows of the fused weight: held once, computing what it did.
    assert [m.weight.data_ptr() for m in mods] == [weight.data_ptr() + i * 8 * 4 for i in (0, 4, 6)]
    assert all(torch.equal(m(x), b) for m, b in zip(mods, before, strict=True))
    if bias:
        assert fused_bias is not None and mods[1].bias.data_ptr() == fused_bias.data_ptr() + 4 * 4
    else:
        assert fused_bias is None


def test_rows_already_side_by_side_are_fused_without_a_copy():
    mods = linears(4, 2)
    base = torch.randn(6, 8)
    with torch.no_grad():
        mods[0].weight = torch.nn.Parameter(base[:4], requires_grad=False)
        mods[1].weight = torch.nn.Parameter(base[4:], requires_grad=False)
    mods[0].bias = mods[1].bias = None
    weight, _ = fuse_rows(mods)
    assert weight.data_ptr() == base.data_ptr() and torch.equal(weight, base)


def test_a_mixed_set_of_biases_is_padded_with_zeros_and_left_alone():
    mods = linears(4, 2, bias=True)
    mods[1].bias = None
    weight, bias = fuse_rows(mods)
    assert bias is not None and torch.equal(bias[4:], torch.zeros(2)) and torch.equal(bias[:4], mods[0].bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_computes_what_the_module_does(dtype):
    norm = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    fused = rms_norm(norm)
    assert fused is not norm
    tolerance = 1e-6 if dtype == torch.float32 else 0.0
    torch.manual_seed(0)
    for scale in (1e-3, 3.0, 1e3):  # bfloat16: to the bit, small and large rows alike
        x = (torch.randn(5, 64) * scale).to(dtype)
        torch.testing.assert_close(fused(x), norm(x), atol=tolerance * scale, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_table_rotates_as_transformers_does(dtype):
    model = build_model(BUILTIN_MODELS["tiny-llama"]).to(dtype)
    rotary = model.model.rotary_emb
    table = RotaryTable(rotary, 16, dtype, torch.device("cpu"), capacity=8)
    positions = torch.tensor([0, 3, 7, 40, 9000])  # past the table: it grows
    cos, sin = rotary(torch.empty(1, 1, 16, dtype=dtype), positions[None])
    x = torch.randn(5, 4, 16).to(dtype)
    ours = rotate(x, *table.at(positions))
    theirs, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    tolerance = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(ours, theirs[0].transpose(0, 1), atol=tolerance, rtol=tolerance)
    span_cos, span_sin = table.span(3, 8)
    at_cos, at_sin = table.at(torch.arange(3, 8))
    assert torch.equal(span_cos, at_cos) and torch.equal(span_sin, at_sin)


def test_only_llama_style_decoders_and_matching_layouts_are_taken(tiny_llama: LoadedModel):
    with pytest.raises(UnsupportedModelError, match="not a Llama/Qwen2-style decoder"):
        DecoderWeights.of(torch.nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError, match="dtype bfloat16 is not the model's"):
        PagedForward(tiny_llama.model, KVLayout(4, tiny_llama.num_layers, tiny_llama.num_kv_heads,
                                                tiny_llama.head_dim, "bfloat16"))
    with pytest.raises(ModelLoadError, match=r"dtype 'float16' is not supported \(supported: float32, bfloat16\)"):
        model_dtype("float16")


def test_decode_steps_equal_a_full_recomputation_and_reuse_their_buffer(tiny_llama: LoadedModel):
    """Logits of decode steps over pages and a tail page equal those of prefilling the whole
    sequence at once; the buffer is kept while the batch keeps its members and regathered
    when it changes."""
    forward = PagedForward(tiny_llama.model, KVLayout(4, tiny_llama.num_layers, tiny_llama.num_kv_heads,
                                                      tiny_llama.head_dim, "float32"))
    rng = random.Random(0)
    seqs = [[rng.randrange(32, 127) for _ in range(n)] for n in (9, 6)]
    pool = torch.zeros((16, *forward.layout.page_shape))
    tails = torch.zeros((2, *forward.layout.page_shape))
    slots: list[list[int]] = []
    free = iter(range(16))
    for row, seq in enumerate(seqs):  # prefill all but the last token; full pages to the pool
        _, fresh = forward.prefill(PrefillChunk(seq[:-1], 0, [], None), pool, want_logits=False)
        full = (len(seq) - 1) // 4
        slots.append([next(free) for _ in range(full)])
        for slot, page in zip(slots[row], fresh[:full], strict=False):
            pool[slot] = page
        tails[row] = fresh[full] if full < len(fresh) else 0
    batch = DecodeBatch([s[-1] for s in seqs], [len(s) - 1 for s in seqs], slots, [0, 1], keys=["a", "b"])
    logits, buffer = forward.decode(batch, pool, tails)
    for row, seq in enumerate(seqs):
        whole, _ = forward.prefill(PrefillChunk(seq, 0, [], None), torch.zeros_like(pool), want_logits=True)
        torch.testing.assert_close(logits[row], whole, atol=1e-5, rtol=1e-5)
    nxt = DecodeBatch([1, 2], [len(s) for s in seqs], slots, [0, 1], keys=["a", "b"])
    assert forward.decode(nxt, pool, tails, buffer)[1] is buffer
    other = DecodeBatch([1], [len(seqs[0]) + 1], slots[:1], [0], keys=["a"])
    assert forward.decode(other, pool, tails, buffer)[1] is not buffer


@pytest.mark.parametrize("packed_float32", [False, True, "transposed"])
def test_decode_steps_over_a_kept_buffer_match_the_model_and_fill_each_tail_page(tiny_llama: LoadedModel,
                                                                                 packed_float32: bool | str):
    """Several decode steps of sequences at different positions (the buffer carried from step to
    step): each step's logits equal the `transformers` model's own forward over the whole
    sequence, with oneDNN's products over packed float32 weights, with MKL's, and with the
    transposed forms (`mv`, `W @ x.T`, which a measured plan may take); each new token's K/V
    land in its tail page at its position, equal to a prefill of the sequence."""
    model = tiny_llama.model
    forward = PagedForward(model, KVLayout(4, tiny_llama.num_layers, tiny_llama.num_kv_heads, tiny_llama.head_dim,
                                           "float32"), packed_float32=packed_float32 is True)
    assert (forward.weights.lm_packed is not None) is (packed_float32 is True and torch.backends.mkldnn.is_available())
    if packed_float32 == "transposed":
        uniform = ProductPlan(Product.TRANSPOSED, Product.TRANSPOSED, Product.LINEAR)
        forward.weights = forward.weights.planned(ProductPlans(uniform))
    rng = random.Random(3)
    seqs = [[rng.randrange(32, 127) for _ in range(n)] for n in (5, 9, 2)]
    pool = torch.zeros((16, *forward.layout.page_shape))
    free = iter(range(16))
    slots, tail_pages = zip(*(_paged(forward, seq, pool, free) for seq in seqs), strict=True)
    slots, tails = [list(s) for s in slots], torch.stack(tail_pages)
    buffer = None
    for _ in range(3):
        new = [rng.randrange(32, 127) for _ in seqs]
        positions = [len(seq) for seq in seqs]
        batch = DecodeBatch(new, positions, slots, [0, 1, 2], keys=["a", "b", "c"])
        logits, kept = forward.decode(batch, pool, tails, buffer)
        assert buffer is None or kept is buffer
        buffer = kept
        for row, (seq, token) in enumerate(zip(seqs, new, strict=True)):
            seq.append(token)
            with torch.no_grad():
                theirs = model(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(logits[row], theirs, atol=1e-4, rtol=1e-4)
            _, fresh = forward.prefill(PrefillChunk(seq, 0, [], None), torch.zeros_like(pool), want_logits=False)
            page, offset = divmod(len(seq) - 1, 4)
            torch.testing.assert_close(tails[row, :, :, offset], fresh[page, :, :, offset], atol=1e-5, rtol=1e-5)
        for row, seq in enumerate(seqs):  # a page filled up: it goes to the pool, a fresh tail starts
            if len(seq) % 4 == 0:
                slot = next(free)
                pool[slot] = tails[row]
                slots[row].append(slot)
                tails[row] = 0


def _paged(forward: PagedForward, seq: list[int], pool: torch.Tensor, free) -> tuple[list[int], torch.Tensor]:
    """Prefill `seq` alone; its full pages into `pool` (slots from `free`), and its tail page."""
    _, fresh = forward.prefill(PrefillChunk(seq, 0, [], None), pool, want_logits=False)
    full = len(seq) // forward.page_size
    slots = [next(free) for _ in range(full)]
    for slot, page in zip(slots, fresh[:full], strict=False):
        pool[slot] = page
    return slots, fresh[full] if full < len(fresh) else torch.zeros_like(fresh[0])


def test_a_batch_of_prefill_chunks_computes_what_each_chunk_alone_does(tiny_llama: LoadedModel):
    """Chunks of several sequences in one forward pass (one after a cached prefix and a
    mid-page tail, one from the start): the same logits and fresh pages as run one by one."""
    forward = PagedForward(tiny_llama.model, KVLayout(4, tiny_llama.num_layers, tiny_llama.num_kv_heads,
                                                      tiny_llama.head_dim, "float32"))
    rng = random.Random(1)
    pool = torch.zeros((16, *forward.layout.page_shape))
    history = [rng.randrange(32, 127) for _ in range(10)]
    slots, tail = _paged(forward, history, pool, iter(range(16)))
    chunks = [PrefillChunk([rng.randrange(32, 127) for _ in range(7)], 10, slots, tail),
              PrefillChunk([rng.randrange(32, 127) for _ in range(5)], 0, [], None),
              PrefillChunk([rng.randrange(32, 127)], 10, slots, tail)]
    batched = forward.prefill_batch(chunks, pool, [True, False, True]).results
    assert batched[1][0] is None
    # Products over more rows are blocked differently: equal within float32 rounding.
    for chunk, want, (logits, fresh) in zip(chunks, [True, False, True], batched, strict=True):
        alone, pages = forward.prefill(chunk, pool, want)
        torch.testing.assert_close(fresh, pages, atol=1e-4, rtol=1e-4)
        if want:
            torch.testing.assert_close(logits, alone, atol=1e-4, rtol=1e-4)


def test_a_lone_prefill_hands_its_buffer_to_the_next_decode_step(tiny_llama: LoadedModel):
    """With a decode key, a prefill that completes a prompt keeps its attention buffer; the next
    decode step of that sequence reuses it (no regathering) and computes what a step that
    gathers its K/V from the pages does."""
    forward = PagedForward(tiny_llama.model, KVLayout(4, tiny_llama.num_layers, tiny_llama.num_kv_heads,
                                                      tiny_llama.head_dim, "float32"))
    rng = random.Random(2)
    pool = torch.zeros((16, *forward.layout.page_shape))
    history = [rng.randrange(32, 127) for _ in range(6)]
    slots, tail = _paged(forward, history, pool, iter(range(16)))
    chunk = PrefillChunk([rng.randrange(32, 127) for _ in range(5)], 6, slots, tail)
    output = forward.prefill_batch([chunk], pool, [True], decode_key="a")
    assert forward.prefill_batch([chunk], pool, [False], decode_key="a").buffer is None
    assert output.buffer is not None and output.buffer.positions == [10]
    _, fresh = output.results[0]  # positions 4-7 (a full page) and 8-10 (the new tail)
    pool[15] = fresh[0]
    pages = [*slots, 15]
    tails = fresh[1:2].clone()
    batch = DecodeBatch([7], [11], [pages], [0], keys=["a"])
    handed_logits, handed = forward.decode(batch, pool, tails.clone(), output.buffer)
    gathered_logits, gathered = forward.decode(batch, pool, tails.clone())
    assert handed is output.buffer and gathered is not output.buffer
    torch.testing.assert_close(handed_logits, gathered_logits, atol=1e-6, rtol=1e-6)


def test_bfloat16_runs_end_to_end_with_a_bfloat16_kv_layout():
    model = load_builtin("tiny-llama", dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.model_id.endswith(":bfloat16")
    engine = LLMEngine(model, EngineConfig(page_size=4))
    try:
        out = engine.generate([[65, 66, 67, 68, 69, 70]], SamplingParams(max_new_tokens=5))[0]
        assert engine.layout.dtype == "bfloat16" and engine.store.device_pool.dtype == torch.bfloat16
    finally:
        engine.close()
    assert len(out.output_ids) == 5


NATIVE_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.skipif(not NATIVE_BF16, reason="this CPU's oneDNN has no native bfloat16: nothing is packed")
def test_packed_bfloat16_products_give_f_linear_to_the_bit_and_packing_can_be_turned_off():
    model = load_builtin("tiny-llama", dtype="bfloat16")
    packed = DecoderWeights.of(model.model)
    plain = DecoderWeights.of(model.model, packed=False)
    layer, bare = packed.layers[0], plain.layers[0]
    assert layer.qkv_packed is not None and layer.gate_up_packed is not None and packed.lm_packed is not None
    assert bare.qkv_packed is bare.gate_up_packed is bare.o_packed is bare.down_packed is plain.lm_packed is None
    torch.manual_seed(0)
    for rows in (1, 4, 40):
        hidden = torch.randn(rows, layer.qkv_weight.shape[1], dtype=torch.bfloat16)
        reference = torch.nn.functional.linear(layer.input_norm(hidden), layer.qkv_weight, layer.qkv_bias)
        assert torch.equal(layer.qkv(hidden), reference)
    # The engine turns it off with its config; the generated tokens do not change.
    outs = []
    for on in (True, False):
        engine = LLMEngine(model, EngineConfig(page_size=4, packed_weights=on))
        try:
            assert (engine.forward.weights.lm_packed is not None) is on
            outs.append(engine.generate([[65, 66, 67, 68, 69, 70]], SamplingParams(max_new_tokens=8))[0].output_ids)
        finally:
            engine.close()
    assert outs[0] == outs[1]


def test_float32_weights_are_packed_unless_turned_off(tiny_llama: LoadedModel):
    off = DecoderWeights.of(tiny_llama.model, packed_float32=False)
    assert off.lm_packed is None and all(layer.qkv_packed is None for layer in off.layers)
    if torch.backends.mkldnn.is_available():
        on = DecoderWeights.of(tiny_llama.model)
        assert on.lm_packed is not None and all(layer.qkv_packed is not None for layer in on.layers)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN: nothing is packed")
def test_packed_float32_products_are_f_linear_within_rounding_and_only_for_decode_batches(tiny_llama: LoadedModel):
    """`packed_float32`: 1 to `FEW_ROWS_MAX` rows go through oneDNN's packed product (the
    same products summed in another order); longer inputs keep MKL's, to the bit."""
    weights = DecoderWeights.of(tiny_llama.model, packed_float32=True)
    layer = weights.layers[0]
    assert layer.qkv_packed is not None and layer.gate_up_packed is not None and weights.lm_packed is not None
    assert layer.o_packed is not None and layer.down_packed is not None
    torch.manual_seed(0)
    width = layer.qkv_weight.shape[1]
    for rows in (1, 2, 16, FEW_ROWS_MAX, FEW_ROWS_MAX + 1, 200):
        hidden = torch.randn(rows, width)
        normed = layer.input_norm(hidden)
        expected = torch.nn.functional.linear(normed, layer.qkv_weight, layer.qkv_bias)
        residual = torch.randn(rows, width)
        inner = torch.randn(rows, layer.intermediate)
        added = residual + torch.nn.functional.linear(inner, layer.down_weight)
        logits = torch.nn.functional.linear(weights.final_norm(hidden), weights.lm_weight, weights.lm_bias)
        summed = add_product(residual, inner, layer.down_weight, layer.down_packed, layer.plans)
        if rows <= FEW_ROWS_MAX:
            torch.testing.assert_close(layer.qkv(hidden), expected, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(summed, added, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(weights.logits(hidden), logits, atol=1e-5, rtol=1e-4)
        else:
            assert torch.equal(layer.qkv(hidden), expected), rows
            assert torch.equal(summed, torch.addmm(residual, inner, layer.down_weight.t())), rows


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN: nothing is packed")
def test_packed_float32_rows_are_counted_over_every_leading_dimension(tiny_llama: LoadedModel):
    """`(branches, tokens, in)` inputs (diffusion's) take the packed product by their rows in all: 2 x 40
    rows are past `FEW_ROWS_MAX` and keep MKL's to the bit; 2 x 8 are packed (within
    rounding)."""
    layer = DecoderWeights.of(tiny_llama.model, packed_float32=True).layers[0]
    torch.manual_seed(0)
    width = layer.qkv_weight.shape[1]
    for tokens in (8, FEW_ROWS_MAX // 2 + 8):
        x = torch.randn(2, tokens, width)
        expected = torch.nn.functional.linear(x, layer.qkv_weight, layer.qkv_bias)
        got = project(x, layer.qkv_weight, layer.qkv_bias, layer.qkv_packed, layer.plans)
        if 2 * tokens <= FEW_ROWS_MAX:
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
        else:
            assert torch.equal(got, expected), tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_computes_f_linear_and_the_residual_sum_within_rounding(dtype: torch.dtype):
    """`multiply` and `add_product` by each kernel, at one row, a decode batch and a prefill's
    rows, against `F.linear` (bfloat16: HF's order, the product rounded before the sum)."""
    torch.manual_seed(0)
    weight = torch.randn(96, 40, dtype=dtype)
    bias = torch.randn(96, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16) if torch.backends.mkldnn.is_available() else None
    tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    for kernel in Product:
        plans = ProductPlans(ProductPlan(kernel, kernel, kernel))
        for rows in (1, 5, FEW_ROWS_MAX + 3):
            x = torch.randn(rows, 40, dtype=dtype)
            residual = torch.randn(rows, 96, dtype=dtype)
            expected = torch.nn.functional.linear(x, weight, bias)
            torch.testing.assert_close(multiply(kernel, x, weight, bias, packed), expected, **tolerance)
            torch.testing.assert_close(multiply(kernel, x[None], weight, bias, packed), expected[None], **tolerance)
            summed = add_product(residual, x, weight, packed, plans)
            torch.testing.assert_close(summed, residual + torch.nn.functional.linear(x, weight), **tolerance)
            assert summed.is_contiguous(), (kernel, rows)


def test_measured_float32_plans_name_a_kernel_per_row_class_and_keep_packed_copies_only_if_they_take_them(
        tiny_llama: LoadedModel):
    """With the size floor lifted, the float32 kernels are measured over the model's weights; the
    packed copies are kept exactly when the measured plan takes the packed product; the bound layer
    still computes the `transformers` modules' projections."""
    weights = DecoderWeights.of(tiny_llama.model, measure_min_bytes=0)
    layer = weights.layers[0]
    plan = weights.plans.default
    assert weights.plans.measured and plan.measured and plan.many_rows is Product.LINEAR
    for w, packed in [*layer.products(), (weights.lm_weight, weights.lm_packed)]:
        assert weights.plans.of(w) is plan
        assert (packed is not None) is (plan.packed and torch.backends.mkldnn.is_available())
    torch.manual_seed(0)
    attn = tiny_llama.model.model.layers[0].self_attn
    for rows in (1, 16):
        hidden = torch.randn(rows, layer.qkv_weight.shape[1])
        normed = layer.input_norm(hidden)
        q = layer.qkv(hidden)[:, : attn.q_proj.weight.shape[0]]
        torch.testing.assert_close(q, attn.q_proj(normed), atol=1e-5, rtol=1e-4)
    # A plan that takes no packed product drops every copy.
    plain = weights.planned(ProductPlans(ProductPlan(Product.LINEAR, Product.LINEAR, Product.LINEAR)))
    assert plain.lm_packed is None and all(p is None for lyr in plain.layers for _, p in lyr.products())


def test_bfloat16_keeps_the_static_plan_even_when_it_could_measure():
    model = load_builtin("tiny-llama", dtype="bfloat16")
    weights = DecoderWeights.of(model.model, measure_min_bytes=0)
    assert not weights.plans.measured and not weights.plans.by_shape
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert weights.plans.default.one_row is (Product.PACKED if native else Product.TRANSPOSED)
