"""Fused residual add + RMSNorm / LayerNorm Triton kernels against plain-PyTorch references,
run on CPU through the Triton interpreter: outputs and every gradient, bad input, and
torch.compile without graph breaks (the compiled, not interpreted, path is a GPU test)."""
import re

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreted import (assert_compiled_matches_eager, interpret,  # noqa: E402,F401
                               kernels_interpreted)

with kernels_interpreted():
    from fasttrain.kernels import norms
    from fasttrain.kernels.norms import (layer_norm, layer_norm_reference, rms_norm,
                                         rms_norm_reference)


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=4e-3, atol=4e-3)}
SHAPES = [(3, 5, 49), (4, 768), (2, 1000)]
OPS = {"rms": (rms_norm, rms_norm_reference), "layer": (layer_norm, layer_norm_reference)}


def _inputs(op: str, shape, dtype, residual: bool, pdtype=torch.float32, bias: bool = True):
    g = torch.Generator().manual_seed(0)
    d = shape[-1]
    args = {"x": torch.randn(shape, generator=g).to(dtype),
            "weight": (1 + 0.1 * torch.randn(d, generator=g)).to(pdtype)}
    if op == "layer":
        args["bias"] = (0.1 * torch.randn(d, generator=g)).to(pdtype) if bias else None
    if residual:
        args["residual"] = torch.randn(shape, generator=g).to(dtype)
    cotangents = [torch.randn(shape, generator=g).to(dtype) for _ in range(1 + residual)]
    return args, cotangents


def _run(fn, args, cotangents, upcast: bool):
    """Outputs and the gradients of every tensor input, for ``sum(out * cotangent)``."""
    cast = (lambda t: t.float()) if upcast else (lambda t: t)
    leaves = {k: None if v is None else cast(v.detach()).clone().requires_grad_()
              for k, v in args.items()}
    out = fn(**leaves, eps=1e-5)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [cast(c) for c in cotangents])
    return outs, {k: v.grad for k, v in leaves.items() if v is not None}


def _compare(op: str, args, cotangents):
    fused, reference = OPS[op]
    outs, grads = _run(fused, args, cotangents, upcast=False)
    ref_outs, ref_grads = _run(reference, args, cotangents, upcast=True)
    tol = TOL[args["x"].dtype]
    for got, want in zip(outs, ref_outs, strict=True):
        assert got.dtype == args["x"].dtype and got.shape == args["x"].shape
        torch.testing.assert_close(got.float(), want, **tol)
    assert grads.keys() == ref_grads.keys()
    for name, got in grads.items():
        assert got.dtype == args[name].dtype, name
        torch.testing.assert_close(got.float(), ref_grads[name], **tol,
                                   msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("op", list(OPS))
def test_matches_reference_outputs_and_all_gradients(op, residual, dtype, shape):
    # bf16 activations with fp32 weight/bias: the autocast case, grads in the params' dtype
    _compare(op, *_inputs(op, shape, dtype, residual))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("op", list(OPS))
def test_fp16_matches_reference_outputs_and_all_gradients(op, residual):
    # fp16 activations (fp16-mixed's autocast dtype) at an odd width, fp32 weight/bias
    _compare(op, *_inputs(op, (3, 5, 49), torch.float16, residual))


@pytest.mark.parametrize("op", list(OPS))
def test_low_precision_params_and_no_bias(op):
    # bf16 weight (and bias) get bf16 gradients; LayerNorm also without bias
    _compare(op, *_inputs(op, (2, 3, 33), torch.bfloat16, True, pdtype=torch.bfloat16))
    if op == "layer":
        _compare(op, *_inputs(op, (2, 33), torch.float32, True, bias=False))


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("op", list(OPS))
def test_many_tiles_walked_by_few_programs(op, stages, monkeypatch):
    # tiles of 2 rows: 37 rows are 19 tiles (the last one half masked) that the CPU's 4
    # backward programs walk with a stride, each summing its weight-gradient partials; both
    # stage settings (the interpreter ignores num_stages: test_kernels_gpu.py runs them compiled)
    monkeypatch.setitem(norms.LAUNCH, "bwd_stages", stages)
    monkeypatch.setitem(norms.LAUNCH, "fwd_elements", 64)
    monkeypatch.setitem(norms.LAUNCH, "bwd_elements", 64)
    assert norms._tile(24, 64) == (2, 32)
    _compare(op, *_inputs(op, (37, 24), torch.float32, True))
    _compare(op, *_inputs(op, (37, 24), torch.bfloat16, False))


@pytest.mark.parametrize("op", list(OPS))
def test_autocast_dtypes_bf16_branch_onto_an_fp32_stream(op):
    # Swin under autocast: a bf16 branch output joins the fp32 residual stream, h stays fp32,
    # y comes out in bf16 for the next matmul; each input's gradient in its own dtype
    fused, reference = OPS[op]
    args, (dy, dh) = _inputs(op, (5, 40), torch.bfloat16, True)
    args["residual"] = args["residual"].float()
    got = _run(lambda **a: fused(**a, out_dtype=torch.bfloat16), args, [dy, dh.float()], False)
    want = _run(lambda **a: reference(**a, out_dtype=torch.bfloat16), args, [dy, dh.float()],
                False)
    (y, h), grads = got
    assert (y.dtype, h.dtype) == (torch.bfloat16, torch.float32)
    assert (grads["x"].dtype, grads["residual"].dtype) == (torch.bfloat16, torch.float32)
    for a, b in zip((y, h, *grads.values()), (*want[0], *want[1].values()), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_x_gradient_comes_out_of_the_backward_in_x_dtype(op, x_dtype, monkeypatch):
    # onto an fp32 stream: a bf16 x's gradient is the backward's second store of dx, rounded
    # from the same fp32 values as the residual's (no cast pass); an fp32 x's is dx itself and
    # the ops return an empty placeholder (small tiles: 19 of 2 rows, masked columns)
    monkeypatch.setitem(norms.LAUNCH, "bwd_elements", 64)
    fused, reference = OPS[op]
    args, (dy, dh) = _inputs(op, (37, 24), x_dtype, True)
    args["residual"] = args["residual"].float()
    _, grads = _run(fused, args, [dy, dh.float()], upcast=False)
    _, want = _run(reference, args, [dy, dh.float()], upcast=True)
    assert (grads["x"].dtype, grads["residual"].dtype) == (x_dtype, torch.float32)
    torch.testing.assert_close(grads["x"].float(), want["x"], **TOL[x_dtype])
    assert torch.equal(grads["x"], grads["residual"].to(x_dtype))
    x, r, w = args["x"], args["residual"], args["weight"]
    if op == "rms":
        _, h, rstd = torch.ops.fasttrain.rms_norm_fwd(x, r, w, 1e-5, None)
        dx, dx2, _ = torch.ops.fasttrain.rms_norm_bwd(dy, dh.float(), h, w, rstd, x_dtype)
    else:
        _, h, mean, rstd = torch.ops.fasttrain.layer_norm_fwd(x, None, r, w, None, 1e-5, None)
        dx, dx2, _ = torch.ops.fasttrain.layer_norm_bwd(dy, dh.float(), h, w, mean, rstd, False,
                                                        x_dtype)
    assert dx.dtype == torch.float32 and dx2.dtype == x_dtype
    assert dx2.shape == ((37, 24) if x_dtype == torch.bfloat16 else (0,))


@pytest.mark.parametrize("dtype, xb_dtype, res_dtype", [
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.float32, torch.float32),  # autocast: bf16 branch, fp32 bias, stream
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
], ids=["fp32", "autocast", "bf16"])
@pytest.mark.parametrize("shape", [(37, 24), (3, 5, 49)], ids=str)
def test_the_bias_of_x_is_added_with_the_residual_and_gets_its_gradient(shape, dtype, xb_dtype,
                                                                        res_dtype, monkeypatch):
    # h = x + x_bias + residual; x_bias's gradient is the row sum of h's, from the backward's
    # partials (small tiles: 19 tiles of 2 rows over the CPU's few programs)
    monkeypatch.setitem(norms.LAUNCH, "bwd_elements", 64)
    args, (dy, dh) = _inputs("layer", shape, dtype, True)
    args["residual"] = args["residual"].to(res_dtype)
    args["x_bias"] = torch.randn(shape[-1], generator=torch.Generator().manual_seed(1)).to(xb_dtype)
    cot = [dy, dh.to(res_dtype)]
    (y, h), grads = _run(layer_norm, args, cot, upcast=False)
    (ry, rh), want = _run(layer_norm_reference, args, cot, upcast=True)
    assert h.dtype == res_dtype and grads["x_bias"].dtype == xb_dtype
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), ry, **tol)
    torch.testing.assert_close(h.float(), rh, **tol)
    assert grads.keys() == want.keys()
    for name, got in grads.items():
        assert got.dtype == args[name].dtype, name
        scale = shape[0] if name in ("x_bias", "weight", "bias") and dtype != torch.float32 else 1
        torch.testing.assert_close(got.float(), want[name], rtol=tol["rtol"],
                                   atol=tol["atol"] * scale, msg=lambda m: f"grad of {name}: {m}")
    # the bias's gradient is exactly the sum of the residual's, over the rows
    torch.testing.assert_close(grads["x_bias"].float(),
                               grads["residual"].float().reshape(-1, shape[-1]).sum(0),
                               **TOL[xb_dtype] if xb_dtype == torch.float32 else dict(rtol=2e-2, atol=0.5))


def test_x_bias_without_a_residual_is_a_one_line_value_error():
    with pytest.raises(ValueError, match="x_bias .* needs a residual") as err:
        layer_norm(torch.randn(4, 8), torch.ones(8), None, 1e-5, x_bias=torch.ones(8))
    assert "\n" not in str(err.value)


def test_empty_input_gives_empty_outputs_and_zero_parameter_gradients():
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    b = torch.zeros(16, requires_grad=True)
    y = layer_norm(x, w, b, 1e-5)
    y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 16)
    assert torch.equal(w.grad, torch.zeros(16)) and torch.equal(b.grad, torch.zeros(16))


def test_non_contiguous_input_and_expanded_gradient():
    x = torch.randn(40, 6).t().requires_grad_()  # (6, 40), not contiguous
    w = torch.randn(40, requires_grad=True)
    rms_norm(x, w, 1e-6).sum().backward()  # backward gets a stride-0 gradient
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm_reference(x2, w2, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, message", [
    (lambda x: rms_norm(x, torch.ones(7), 1e-6), "weight shape (7,) does not match"),
    (lambda x: layer_norm(x, torch.ones(8), torch.ones(3), 1e-5), "bias shape (3,)"),
    (lambda x: rms_norm(x, torch.ones(8), 1e-6, torch.ones(4, 7)), "residual must be a float tensor shaped like x"),
    (lambda x: rms_norm(x.long(), torch.ones(8), 1e-6), "x must be float32"),
], ids=["weight", "bias", "residual", "dtype"])
def test_bad_input_is_a_one_line_value_error(call, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        call(torch.randn(4, 8))
    assert "\n" not in str(err.value)


def _block(x, r, w, b):
    y, h = rms_norm(x, w, 1e-6, r)
    y2, h2 = layer_norm(y * 2, w, b, 1e-5, residual=h)
    return rms_norm(y2, w, 1e-6).sum() + (h2 * h2).sum()


def test_torch_compile_fullgraph_matches_eager():
    # Under TRITON_INTERPRET=1 the ops are registered as opaque custom ops (see norms.py);
    # the triton_op registration that compiled Triton uses is traced in the next test.
    assert_compiled_matches_eager(
        _block, [torch.randn(3, 40), torch.randn(3, 40), torch.randn(40), torch.randn(40)])


def test_backward_pipeline_stages_shrink_to_fit_shared_memory(monkeypatch):
    monkeypatch.setitem(norms.LAUNCH, "bwd_stages", 3)
    assert norms._stages(4 * 1024 * 10) == 3  # ViT-B: 4 rows x 1,024, fp32 h and dh, bf16 dy
    assert norms._stages(8192 * 10) == 2  # one row of 8,192: 80 KiB a stage
    assert norms._stages(16384 * 10) == 1  # no pipelining rather than a launch failure


@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("stream, x_dtype", [(torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.float32)], ids=str)
def test_a_16_bit_stream_launches_with_the_16_bit_settings(stream, x_dtype, d, monkeypatch):
    """h's dtype (x's without a residual) picks the tile and warps, and with masked lanes (D
    not a power of two) the backward's programs an SM."""
    seen = {}
    monkeypatch.setattr(norms, "launch", lambda kernel, grid, *a, **meta: seen.setdefault(
        kernel.fn.__name__, (grid, meta)))
    monkeypatch.setattr(norms, "programs_cap", lambda device, per_sm: per_sm * 100)
    monkeypatch.setitem(norms.LAUNCH, "max_rows", 1000)
    for key, value in (("fwd_elements", 4096), ("fwd_warps", 8), ("programs_per_sm", 1),
                       ("fwd_elements_16", 2048), ("fwd_warps_16", 2), ("programs_per_sm_16", 3)):
        monkeypatch.setitem(norms.LAUNCH, key, value)
    x, r = torch.zeros(16384, d, dtype=x_dtype), torch.zeros(16384, d, dtype=stream)
    w = torch.ones(d)
    _, h, mean, rstd = norms._fwd(x, None, r, w, None, 1e-5, False, None)
    norms._bwd(torch.zeros_like(x), torch.zeros_like(h), h, w, mean, rstd, False)
    half = h.dtype.itemsize == 2
    (fgrid, fmeta), (bgrid, _) = seen["_fwd_kernel"], seen["_bwd_kernel"]
    assert fmeta["BLOCK_M"] == (2048 if half else 4096) // 256
    assert fmeta["num_warps"] == (2 if half else 8)
    assert bgrid == ((300 if half and d == 192 else 100),)
