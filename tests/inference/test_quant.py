"""Post-training quantizers (inference/quant.py) on the CPU: the row quantizers' error bounds,
Fp8Linear / Int8Linear against nn.Linear within bounds derived from their scales, the kernel
paths the CPU also has (``_int_mm``; ``_scaled_mm``'s row-wise CPU kernel, forced) against the
reference arithmetic, ``quantize_linears`` with ``sensitive_layers`` on a timm-named model, its
report, bad input, and torch.compile (``aot_eager``, fullgraph)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.inference.quant import (
    E4M3, Fp8Linear, Int8Linear, QuantReport, quantize_fp8_rows, quantize_int8_rows,
    quantize_linears, sensitive_layers)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.float32: 2 ** -24, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}
MODULES = {"fp8": Fp8Linear, "int8": Int8Linear}


def _rows(*shape, dtype=torch.float32, seed=0):
    """Gaussian rows with a few outliers and one all-zero row (the hard cases of per-row
    scales), in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[0, :3] *= 40.0
    x[-1] = 0.0
    return x.to(dtype)


def _error_bound(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Elementwise bound of |x - dequantize(quantize(x))| for x (R, C) quantized per row."""
    _, s = (quantize_fp8_rows if mode == "fp8" else quantize_int8_rows)(x)
    if mode == "int8":
        return (s / 2).expand_as(x)
    # e4m3: 3 mantissa bits (half a step ≤ 2^-4 of the value) down to 2^-6; below, subnormals
    # spaced 2^-9 (in units of the row's scale)
    return x.float().abs() * 2 ** -4 + s * 2 ** -10


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_row_quantizer_is_within_half_a_step(dtype):
    x = _rows(9, 200, dtype=dtype)
    q, s = quantize_int8_rows(x)
    assert q.dtype == torch.int8 and s.shape == (9, 1) and s.dtype == torch.float32
    assert q.abs().max() == 127 and q[:-1].abs().amax(1).eq(127).all()  # each row's max ↦ 127
    assert not q[-1].any() and torch.isfinite(s).all()  # the zero row: zero codes
    err = (q.float() * s - x.float()).abs()
    assert (err <= s / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_row_quantizer_keeps_three_mantissa_bits(dtype):
    x = _rows(9, 200, dtype=dtype)
    q, s = quantize_fp8_rows(x)
    assert q.dtype == E4M3 and s.shape == (9, 1) and s.dtype == torch.float32
    assert q[:-1].float().abs().amax(1).eq(448).all() and not q[-1].float().any()
    err = (q.float() * s - x.float()).abs()
    assert (err <= _error_bound(x, "fp8") * (1 + 1e-6)).all()
    assert (err <= x.float().abs() * 2 ** -3 + s * 2 ** -10).all()  # the brief's 2^-3, looser


def _check_against_linear(mode, shape, dtype, bias, backend=None):
    """The quantized layer's output vs ``F.linear`` in fp32 of the same x, W, b: within
    Σ_k |x||δw| + |δx||w| + |δx||δw| (the quantizers' bounds), plus the output's rounding to
    ``dtype`` and fp32 summation."""
    K, N = shape[-1], 48
    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight[3] *= 30.0  # an outlier channel: its own scale
    x = _rows(*shape, dtype=dtype, seed=1) if len(shape) == 2 else torch.randn(shape).to(dtype)
    m = MODULES[mode].from_linear(lin)
    if backend is not None:
        m.backend = backend
    with torch.inference_mode():
        y = m(x)
    assert y.shape == (*shape[:-1], N) and y.dtype == dtype
    x2, w = x.reshape(-1, K).float(), lin.weight.float()
    ref = F.linear(x2, w, None if lin.bias is None else lin.bias.float())
    ex, ew = _error_bound(x2, mode), _error_bound(w, mode)
    bound = x2.abs() @ ew.t() + ex @ w.abs().t() + ex @ ew.t()
    bound += UNIT_ROUNDOFF[dtype] * (ref.abs() + bound) + 1e-5 * (x2.abs() @ w.abs().t())
    err = (y.reshape(-1, N).float() - ref).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    # and exactly the emulated arithmetic: dequantized operands, fp32 sums, bias, one rounding
    xq, sx = (quantize_fp8_rows if mode == "fp8" else quantize_int8_rows)(x2)
    want = F.linear(xq.float() * sx, m.qweight.float() * m.weight_scale.t(),
                    None if lin.bias is None else lin.bias.float())
    slack = UNIT_ROUNDOFF[dtype] * want.abs() + 1e-5 * (x2.abs() @ w.abs().t())
    assert ((y.reshape(-1, N).float() - want).abs() <= slack).all()
    return m, x, y


@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("shape", [(3, 7, 64), (1, 64), (5, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_quantized_linear_is_within_the_bound_of_its_scales(mode, shape, dtype, bias):
    m, _, _ = _check_against_linear(mode, shape, dtype, bias)
    assert m.backend == {"fp8": "reference", "int8": "int_mm"}[mode]  # the CPU's choices


@pytest.mark.parametrize("shape", [(1, 64), (5, 48), (40, 64)])
def test_int8_int_mm_and_reference_paths_agree(shape):
    """``_int_mm`` (with its M ≤ 16 zero padding) and the fp32 integer product: the same sums
    (exact here: K·127² < 2²⁴)."""
    _, x, y = _check_against_linear("int8", shape, torch.float32, True, backend="int_mm")
    _, _, y_ref = _check_against_linear("int8", shape, torch.float32, True,
                                        backend="reference")
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_scaled_mm_call_matches_the_reference(dtype, bias):
    """The CUDA path's ``_scaled_mm`` call (operand layouts, row-wise scales, bias, output
    dtype fallback to bf16) run by torch's CPU kernel against the reference arithmetic:
    within the bf16 rounding of the output."""
    m, x, y_ref = _check_against_linear("fp8", (3, 7, 64), dtype, bias)
    m.backend, m.native_out = "scaled_mm", (torch.bfloat16,)
    with torch.inference_mode():
        y = m(x)
    assert y.dtype == dtype
    tol = 2 ** -8 * y_ref.float().abs().max().item()
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 ** -7, atol=tol)


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_quantized_module_holds_buffers_that_keep_their_dtypes(mode):
    lin = nn.Linear(32, 16).to(torch.bfloat16)
    m = MODULES[mode].from_linear(lin)
    assert not list(m.parameters())
    assert set(m.state_dict()) == {"qweight", "weight_scale", "bias"}
    assert m.qweight.shape == (16, 32) and m.weight_scale.shape == (1, 16)
    amax = lin.weight.float().abs().amax(1)  # per output channel
    assert torch.equal(m.weight_scale[0], amax / (448.0 if mode == "fp8" else 127.0))
    assert f"mode={mode}" in repr(m)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = m(x)
    m.half().to(torch.float32)  # casts every floating buffer, except the codes and scales
    assert m.qweight.dtype == (E4M3 if mode == "fp8" else torch.int8)
    assert m.weight_scale.dtype == torch.float32 and m.bias.dtype == torch.float32
    with torch.inference_mode():
        torch.testing.assert_close(m(x.float()), before.float(), rtol=2e-2, atol=2e-2)


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):  # (B, T, C)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(F.scaled_dot_product_attention(q, k, v))


class Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):  # timm Swin's: 2x2 tokens' channels → 2C
    def __init__(self, dim):
        super().__init__()
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):  # (B, T, C) → (B, T / 4, 2C)
        B, T, C = x.shape
        return self.reduction(x.reshape(B, T // 4, 4 * C))


class Custom(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class Plain(nn.Linear):  # a subclass whose forward is nn.Linear's
    pass


class TinyVit(nn.Module):
    """timm's names: blocks.N.attn.qkv/proj, blocks.N.mlp.fc1/fc2, downsample.reduction, head;
    plus one odd-width layer, one with its own forward and an nn.MultiheadAttention pool."""

    def __init__(self, dim=32, classes=10):
        super().__init__()
        self.blocks = nn.Sequential(Block(dim), Block(dim))
        self.downsample = PatchMerging(dim)
        self.pre_logits = Plain(2 * dim, 2 * dim)
        self.odd = nn.Linear(2 * dim, 24)
        self.scaled = Custom(24, 2 * dim)
        self.pool = nn.MultiheadAttention(2 * dim, 4, batch_first=True)
        self.head = nn.Linear(2 * dim, classes)

    def forward(self, x):  # (B, T, C)
        x = self.downsample(self.blocks(x))
        x = self.scaled(self.odd(self.pre_logits(x)))
        x = self.pool(x, x, x, need_weights=False)[0]
        return self.head(x.mean(1))


def test_quantize_linears_with_sensitive_layers_keeps_fc2_merging_and_head():
    torch.manual_seed(0)
    model = TinyVit().to(torch.bfloat16).eval()
    original = copy.deepcopy(model)
    report = quantize_linears(model, "int8", keep=sensitive_layers(model))
    assert isinstance(report, QuantReport) and report
    assert sorted(report.quantized) == sorted(
        [f"blocks.{i}.{n}" for i in (0, 1) for n in ("attn.qkv", "attn.proj", "mlp.fc1")]
        + ["pre_logits"])
    assert sorted(report.kept) == ["blocks.0.mlp.fc2", "blocks.1.mlp.fc2",
                                   "downsample.reduction", "head"]
    assert "patch merging" in report.kept["downsample.reduction"]
    assert set(report.skipped) == {"odd", "scaled", "pool.out_proj"}
    assert "multiples of 16" in report.skipped["odd"]
    assert "own forward" in report.skipped["scaled"]
    assert "MultiheadAttention" in report.skipped["pool.out_proj"]
    assert isinstance(model.blocks[1].attn.qkv, Int8Linear)
    assert type(model.blocks[1].mlp.fc2) is nn.Linear and type(model.head) is nn.Linear

    summary = report.summary()
    assert (summary["mode"], summary["quantized"], summary["kept"], summary["skipped"]) == \
        ("int8", 7, 4, 3)
    assert sum(summary["kept_why"].values()) == 4 and summary["line"].startswith("int8: 7 ")
    assert summary["backends"] == {"int_mm": 7}
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        got, want = model(x).float(), original(x).float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_quantize_linears_replaces_a_shared_layer_under_every_name():
    shared = nn.Linear(16, 16)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    report = quantize_linears(model, "fp8")
    assert report.quantized == ["0", "2"] and model[0] is model[2]
    assert isinstance(model[0], Fp8Linear)
    assert report.backends == {"reference": 1} and "reference path" in report.line()  # CPU


def test_quantize_linears_rejects_an_unknown_mode_in_one_line():
    with pytest.raises(ValueError) as err:
        quantize_linears(nn.Sequential(nn.Linear(16, 16)), "int4")
    assert "\n" not in str(err.value) and "fp8, int8" in str(err.value)


def test_quantize_linears_on_a_model_without_linear_layers_reports_nothing_matched():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    with pytest.warns(UserWarning, match="matched nothing"):
        report = quantize_linears(model, "fp8")
    assert not report and report.summary()["quantized"] == 0
    assert "matched nothing" in report.summary()["line"]


@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_quantized_model_compiles_in_one_graph(mode):
    """``torch.compile(fullgraph=True)`` with aot_eager traces the whole forward (backends
    are Python attributes, branches on shapes only): same output as eager. fp8 runs the
    ``_scaled_mm`` call (CPU kernel); int8 the zero-padded ``_int_mm`` (5 rows), then not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).to(torch.bfloat16)
    quantize_linears(model, mode)
    if mode == "fp8":
        for m in model.modules():
            if isinstance(m, Fp8Linear):
                m.backend, m.native_out = "scaled_mm", (torch.bfloat16,)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for shape in [(5, 32), (3, 13, 32)]:  # 5 rows (padded for _int_mm), then 39
        x = torch.randn(shape, dtype=torch.bfloat16)
        with torch.inference_mode():
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("bias", [True, False])
def test_quantized_layer_runs_apart_from_its_bias_for_the_fused_paths(mode, bias):
    """A quantized layer is a ``BiasApart``: ``linear(layer, x, bias=False)`` is its output
    less the bias (same codes, same scales), so a fused kernel that adds the bias gets what
    the layer would give; ``bias_apart`` lets the blocks' fused norms and bias + GELU take it."""
    from fasttrain.layers.linear import bias_apart, linear

    torch.manual_seed(0)
    m = MODULES[mode].from_linear(nn.Linear(32, 48, bias=bias))
    x = torch.randn(3, 5, 32)
    with torch.inference_mode():
        whole, apart = m(x), linear(m, x, bias=False)
    assert bias_apart(m) and apart.shape == whole.shape == (3, 5, 48)
    added = apart if m.bias is None else apart + m.bias
    torch.testing.assert_close(added, whole, rtol=1e-6, atol=1e-6)
    assert bias or torch.equal(apart, whole)


def test_a_layer_whose_parent_reads_its_weight_is_skipped_with_the_reason():
    """fasttrain's Llama hands its (tied) head weight to the loss kernel as a tensor and says
    so (``reads_linear_weights``): its head stays; the blocks' projections are quantized."""
    from fasttrain.workloads.llama import CONFIGS, Llama

    model = Llama(CONFIGS["tiny"])
    report = quantize_linears(model, "int8")
    assert report.skipped == {"lm_head": "its parent Llama reads its weight directly"}
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.embed_tokens.weight
    assert report.quantized and all(n.startswith("layers.") for n in report.quantized)


def test_a_quantized_layer_subclass_that_overrides_forward_is_not_run_apart():
    """``bias_apart`` takes fasttrain's BiasApart kinds and their plain subclasses; a subclass
    that overrides forward (a wrapper doing more than the matmul) must run whole."""
    from fasttrain.layers.linear import bias_apart

    class Scaled(Int8Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Renamed(Int8Linear):
        pass

    lin = nn.Linear(16, 16)
    assert not bias_apart(Scaled.from_linear(lin))
    assert bias_apart(Renamed.from_linear(lin)) and bias_apart(Int8Linear.from_linear(lin))


def test_converting_after_quantizing_names_the_order_in_one_line():
    """The rungs convert, then quantize. The other order leaves a plain MLP's quantized linear
    unconverted, with the reason, instead of failing on its missing weight."""
    from fasttrain.converters.apply import convert

    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    quantize_linears(model, "int8")
    report = convert(model, kernels="none")
    lines = "\n".join(report.skipped_lines())
    assert "holds no weight (quantized): convert the model before quantizing it" in lines
