"""Fused bias + GELU, SwiGLU and GEGLU Triton kernels against plain-PyTorch references, run on CPU
through the Triton interpreter: outputs and every gradient, odd shapes, non-contiguous inputs,
bad input, and torch.compile without graph breaks."""
import math
import re

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreted import (assert_compiled_matches_eager, interpret,  # noqa: E402,F401
                               kernels_interpreted)

with kernels_interpreted():
    from fasttrain.kernels import activations
    from fasttrain.kernels.activations import (bias_gelu, bias_gelu_reference, swiglu,
                                               swiglu_reference)
    from fasttrain.kernels import geglu as geglu_module
    from fasttrain.kernels.geglu import geglu, geglu_reference


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=4e-3, atol=4e-3)}
SHAPES = [(3, 5, 49), (2, 1000), (7, 2500)]


def _run(fn, args: dict, cotangent, upcast: bool, **kw):
    """Output and the gradients of every tensor input, for ``sum(out * cotangent)``."""
    cast = (lambda t: t.float()) if upcast else (lambda t: t)
    leaves = {k: None if v is None else cast(v.detach()).clone().requires_grad_()
              for k, v in args.items()}
    out = fn(**leaves, **kw)
    out.backward(cast(cotangent))
    return out, {k: v.grad for k, v in leaves.items() if v is not None}


def _compare(fused, reference, args: dict, cotangent, **kw):
    out, grads = _run(fused, args, cotangent, upcast=False, **kw)
    ref_out, ref_grads = _run(reference, args, cotangent, upcast=True, **kw)
    first = next(iter(args.values()))
    tol = TOL[first.dtype]
    assert out.dtype == first.dtype and out.shape == first.shape
    torch.testing.assert_close(out.float(), ref_out, **tol)
    assert grads.keys() == ref_grads.keys()
    for name, got in grads.items():
        assert got.dtype == args[name].dtype, name
        torch.testing.assert_close(got.float(), ref_grads[name], **tol,
                                   msg=lambda m: f"grad of {name}: {m}")


def _gelu_inputs(shape, dtype, bias: bool = True, bdtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    args = {"x": (2 * torch.randn(shape, generator=g)).to(dtype),
            "bias": (0.5 * torch.randn(shape[-1], generator=g)).to(bdtype) if bias else None}
    return args, torch.randn(shape, generator=g).to(dtype)


def _swiglu_inputs(shape, dtype):
    g = torch.Generator().manual_seed(0)
    args = {"gate": (3 * torch.randn(shape, generator=g)).to(dtype),
            "up": torch.randn(shape, generator=g).to(dtype)}
    return args, torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_matches_reference_outputs_and_all_gradients(approximate, dtype, shape):
    # bf16 x with an fp32 bias: the autocast case, the bias grad in the bias's dtype
    _compare(bias_gelu, bias_gelu_reference, *_gelu_inputs(shape, dtype),
             approximate=approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_fp16_bias_gelu_and_swiglu_match_the_reference(approximate):
    # fp16 activations (fp16-mixed's autocast dtype) at an odd width
    _compare(bias_gelu, bias_gelu_reference, *_gelu_inputs((3, 5, 49), torch.float16),
             approximate=approximate)
    _compare(swiglu, swiglu_reference, *_swiglu_inputs((3, 5, 49), torch.float16))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_without_bias_and_with_low_precision_bias(approximate):
    _compare(bias_gelu, bias_gelu_reference, *_gelu_inputs((4, 3, 33), torch.float32, False),
             approximate=approximate)
    _compare(bias_gelu, bias_gelu_reference,
             *_gelu_inputs((4, 33), torch.bfloat16, bdtype=torch.bfloat16),
             approximate=approximate)


@pytest.mark.parametrize("stages,fwd_per_sm", [(1, 0), (3, 1)])
def test_bias_gelu_backward_with_many_programs_and_row_tiles(monkeypatch, stages, fwd_per_sm):
    # small tiles: several column blocks (one partial), several row programs, each looping
    # over several row tiles with a partial last one; bias partials summed across programs;
    # the forward one tile a program, or persistent (walking row tiles as the backward does);
    # both stage settings reach the kernels (the interpreter ignores num_stages: the pipelined
    # loads themselves are checked in test_activations_gpu.py)
    monkeypatch.setitem(activations.LAUNCH, "bwd_elements", 128)
    monkeypatch.setitem(activations.LAUNCH, "bwd_block_d", 32)  # tiles of 4 rows x 32 columns
    monkeypatch.setitem(activations.LAUNCH, "fwd_elements", 64)
    monkeypatch.setitem(activations.LAUNCH, "fwd_block_d", 16)  # 4 x 16: three column blocks
    monkeypatch.setitem(activations.LAUNCH, "stages", stages)
    monkeypatch.setitem(activations.LAUNCH, "fwd_stages", stages)
    monkeypatch.setitem(activations.LAUNCH, "fwd_programs_per_sm", fwd_per_sm)
    assert activations._tile(40, 128, 32) == (4, 32)
    cpu = torch.device("cpu")
    assert activations._grid_persistent(cpu, 45, 40, 4, 32, 2) == (2, 2, 24)
    assert activations._grid_persistent(cpu, 45, 40, 4, 16, 1) == (1, 3, 48)
    assert activations._grid_persistent(cpu, 45, 40, 4, 16, 0) == (12, 3, 4)
    _compare(bias_gelu, bias_gelu_reference, *_gelu_inputs((45, 40), torch.float32),
             approximate="none")


def test_exact_gelu_is_within_a_few_ulp_of_erf_on_a_dense_grid():
    """The kernels' exact GELU and its gradient against PyTorch's in float64, far tighter
    than TOL."""
    from tests.helpers import check_exact_gelu

    check_exact_gelu(bias_gelu, "cpu", 4099)


def test_bias_gelu_extreme_inputs_are_finite():
    x = torch.tensor([[-1e4, -60.0, -10.0, 0.0, 10.0, 60.0, 1e4, 3.0]]).requires_grad_()
    for approximate in ("none", "tanh"):
        x.grad = None
        y = bias_gelu(x, None, approximate)
        y.sum().backward()
        x2 = x.detach().clone().requires_grad_()
        bias_gelu_reference(x2, None, approximate).sum().backward()
        assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
        torch.testing.assert_close(y, bias_gelu_reference(x.detach(), None, approximate))
        torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("shape", [(3, 5, 49), (2, 1000), (5000,)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_swiglu_matches_reference_outputs_and_all_gradients(dtype, shape):
    _compare(swiglu, swiglu_reference, *_swiglu_inputs(shape, dtype))


def test_swiglu_non_contiguous_inputs_and_expanded_gradient():
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(6, 2 * 40, generator=g), torch.randn(40, 6, generator=g)]
    results = []
    for fn in (swiglu, swiglu_reference):
        fused, up_t = (t.clone().requires_grad_() for t in leaves)
        gate, up = fused[:, :40], up_t.t()  # a row-strided slice (one gate/up projection)
        assert not gate.is_contiguous() and not up.is_contiguous()  # and a transposed view
        out = fn(gate, up)
        out.sum().backward()  # the backward gets a stride-0 gradient
        results.append([out.detach(), fused.grad, up_t.grad])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, dtype", [
    *((s, d) for s in [(3, 5, 2 * 49), (7, 2 * 1000), (3, 2 * 1280)]
      for d in (torch.float32, torch.bfloat16)),
    ((3, 5, 2 * 49), torch.float16)], ids=str)  # fp16 at the odd width
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_geglu_matches_reference_output_and_gradient(approximate, dtype, shape, bias,
                                                     monkeypatch):
    """h · gelu(gate) from the two halves of x (+ bias)'s last dim: odd widths (one column a
    tile), widths of a few tiles, SD's 1,280; the gradient lands in both halves of dx, and the
    fp32 bias's in both of its halves. The backward's tiles are made 4 rows × 16 columns, so
    that a program walks several row tiles and sums the bias across them (15 rows: 4 tiles, 7
    rows: 2; checked below)."""
    monkeypatch.setitem(geglu_module.GEGLU, "bwd_elements", 64)
    monkeypatch.setitem(geglu_module.GEGLU, "bwd_block_d", 16)
    rows = math.prod(shape[:-1])
    progs, _, per, block_r, _ = geglu_module._geglu_bwd_grid(torch.device("cpu"), rows,
                                                             shape[-1] // 2)
    assert per > block_r or rows <= block_r  # several row tiles a program where rows allow
    g = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(shape, generator=g)).to(dtype)
    b = torch.randn(shape[-1], generator=g) if bias else None
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype)
    results = []
    for fn, cast in ((geglu, lambda t: t), (geglu_reference, lambda t: t.float())):
        leaf = cast(x).clone().requires_grad_()
        bl = None if b is None else b.clone().requires_grad_()
        out = fn(leaf, bl, approximate)
        out.backward(cast(dy))
        results.append((out, leaf.grad, None if bl is None else bl.grad))
    (out, dx, db), (ref, ref_dx, ref_db) = results
    assert out.dtype == dtype and out.shape == dy.shape and dx.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    torch.testing.assert_close(dx.float(), ref_dx, **TOL[dtype])
    if bias:
        assert db.dtype == torch.float32
        # fp32 sums of the unrounded dx against the reference's fp32 dx: at dx's tolerance
        # times the square root of the rows summed
        tol = {k: v * rows ** 0.5 for k, v in TOL[dtype].items()}
        torch.testing.assert_close(db, ref_db, **tol)


def test_geglu_of_a_strided_input_and_no_rows():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 3 * 16, generator=g, requires_grad=True)
    x = wide[:, :32]  # not contiguous: copied first
    geglu(x).sum().backward()
    want = wide.detach().clone().requires_grad_()
    geglu_reference(want[:, :32]).sum().backward()
    torch.testing.assert_close(wide.grad, want.grad, rtol=1e-5, atol=1e-5)
    empty = torch.randn(0, 8, requires_grad=True)
    y = geglu(empty)
    y.sum().backward()
    assert y.shape == (0, 4) and empty.grad.shape == (0, 8)


@pytest.mark.parametrize("call, message", [
    (lambda x: bias_gelu(x, torch.ones(7)), "bias shape (7,) does not match"),
    (lambda x: bias_gelu(x, None, "erf"), "approximate must be 'none' or 'tanh'"),
    (lambda x: bias_gelu(x.long(), None), "x must be float32"),
    (lambda x: bias_gelu(x, torch.ones(8, dtype=torch.long)), "bias must be a float tensor"),
    (lambda x: swiglu(x, torch.ones(4, 7)), "up must match gate"),
    (lambda x: swiglu(x, x.double()), "up must match gate"),
    (lambda x: swiglu(x.int(), x.int()), "gate must be float32"),
    (lambda x: geglu(x[:, :7]), "x needs an even, non-empty last dim"),
    (lambda x: geglu(x[:, :0]), "x needs an even, non-empty last dim"),
    (lambda x: geglu(x, None, "erf"), "approximate must be 'none' or 'tanh'"),
    (lambda x: geglu(x, torch.ones(4)), "bias shape (4,) does not match x's last dim (8)"),
    (lambda x: geglu(x, torch.ones(8, dtype=torch.long)), "bias must be a float tensor"),
], ids=["bias", "approximate", "dtype", "bias-dtype", "shape", "up-dtype", "gate-dtype",
        "geglu-odd", "geglu-empty", "geglu-approximate", "geglu-bias", "geglu-bias-dtype"])
def test_bad_input_is_a_one_line_value_error(call, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        call(torch.randn(4, 8))
    assert "\n" not in str(err.value)


def _mlp(x, b, g, u):
    h = bias_gelu(x, b, "tanh")
    return (bias_gelu(h * 2, b).sum() + (swiglu(h, u) * g).sum()
            + swiglu(g, bias_gelu(u, None)).sum()
            + geglu(torch.cat([h, u], -1), torch.cat([b, b])).sum())


def test_torch_compile_fullgraph_matches_eager():
    # interpreted: opaque custom ops (see fasttrain.kernels._triton); no graph break
    assert_compiled_matches_eager(
        _mlp, [torch.randn(3, 40), torch.randn(40), torch.randn(3, 40), torch.randn(3, 40)])


def test_bias_gelu_with_no_rows_and_bad_launch_tiles(monkeypatch):
    x = torch.randn(0, 40, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    y = bias_gelu(x, b)
    y.sum().backward()
    assert y.shape == (0, 40) and x.grad.shape == (0, 40)
    assert torch.equal(b.grad, torch.zeros(40))
    monkeypatch.setitem(activations.LAUNCH, "fwd_block_d", 48)
    with pytest.raises(ValueError, match="block_d must be a power of two, got 48"):
        bias_gelu(torch.randn(3, 40), b.detach())
