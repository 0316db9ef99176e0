"""The GroupNorm (+ SiLU) Triton kernels against plain PyTorch, run on CPU through the Triton
interpreter: output and every gradient in fp32/bf16/fp16, channels-last and contiguous and
other layouts, 2-D to 5-D inputs, groups of odd widths, several programs per sample, a large
mean, bad input, torch.compile without graph breaks, and the SD layers that use them."""
import pytest
import torch

pytest.importorskip("triton")

from tests.interpreted import (assert_compiled_matches_eager, interpret,  # noqa: E402,F401
                               kernels_interpreted)

with kernels_interpreted():
    from fasttrain.kernels import group_norm as gn
    from fasttrain.kernels.group_norm import group_norm, group_norm_reference

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=3e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _inputs(shape, groups, dtype, layout="contiguous", mean=0.0, affine=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (mean + 2 * torch.randn(shape, generator=g)).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format={4: torch.channels_last, 5: torch.channels_last_3d}
                         [len(shape)])
    elif layout == "strided":  # every other position of a wider tensor: no collapsible layout
        x = torch.cat([x, x], dim=-1)[..., ::2]
    C = shape[1]
    w = (1 + 0.5 * torch.randn(C, generator=g)) if affine else None
    b = 0.3 * torch.randn(C, generator=g) if affine else None
    return x, w, b, torch.randn(shape, generator=g).to(dtype)


def _run(fn, x, w, b, dy, groups, silu, upcast):
    cast = (lambda t: t.double()) if upcast else (lambda t: t)
    leaves = [None if t is None else cast(t.detach()).clone().requires_grad_() for t in (x, w, b)]
    out = fn(*leaves, groups, 1e-5, silu)
    out.backward(cast(dy))
    return out, [None if t is None else t.grad for t in leaves]


def _compare(shape, groups, dtype, silu, tol=None, **kw):
    x, w, b, dy = _inputs(shape, groups, dtype, **kw)
    out, grads = _run(group_norm, x, w, b, dy, groups, silu, upcast=False)
    ref, ref_grads = _run(group_norm_reference, x, w, b, dy, groups, silu, upcast=True)
    assert out.dtype == dtype and out.shape == x.shape
    if kw.get("layout") in ("contiguous", "channels_last", None):
        assert out.stride() == x.stride()  # the input's own layout
    tol = tol or TOL[dtype]
    torch.testing.assert_close(out.double(), ref, **tol)
    for name, got, want, leaf in zip("x w b".split(), grads, ref_grads, (x, w, b)):
        if leaf is None:
            continue
        assert got.dtype == leaf.dtype, name
        scale = max(1.0, want.abs().max().item())  # dw/db sum over every position
        torch.testing.assert_close(got.double() / scale, want / scale, **tol,
                                   msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "plain"])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_group_norm_matches_reference_output_and_all_gradients(layout, silu, dtype):
    # 40 channels in 8 groups: groups 5 wide, channel blocks of 16, the last one partly masked
    _compare((3, 40, 6, 5), 8, dtype, silu, layout=layout)


@pytest.mark.parametrize("shape, groups", [((2, 320, 3, 3), 32), ((2, 96, 5, 7), 32),
                                           ((2, 6, 11), 3), ((4, 6), 2), ((2, 8, 3, 4, 5), 4),
                                           ((1, 24, 1, 1), 6)], ids=str)
def test_group_norm_odd_shapes_and_ranks(shape, groups):
    _compare(shape, groups, torch.float32, True,
             layout="channels_last" if len(shape) in (4, 5) else "contiguous")


def test_group_norm_other_layouts_are_copied_and_without_affine():
    _compare((2, 12, 4, 5), 4, torch.float32, True, layout="strided")
    _compare((2, 12, 4, 5), 4, torch.float32, False, affine=False)


def test_group_norm_reads_positions_by_the_view_strides_when_a_spatial_dim_is_one():
    """(N, C, H, 1) from a permute + unsqueeze: PyTorch calls it channels-last without a copy,
    but its last dim's stride (1) is not the distance between positions (C)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g).permute(0, 2, 1).unsqueeze(-1)  # (2, 8, 5, 1)
    assert x.is_contiguous(memory_format=torch.channels_last) and x.stride(-1) == 1
    w, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
    torch.testing.assert_close(group_norm(x, w, b, 4, 1e-5, True),
                               group_norm_reference(x, w, b, 4, 1e-5, True),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("per_sample", [False, True], ids=["per-channel", "per-sample"])
def test_group_norm_of_x_plus_a_bias_matches_reference_output_and_all_gradients(per_sample,
                                                                                 dtype):
    """x_bias (a convolution's bias, plus a time embedding per sample) is added in fp32 inside
    the kernels: output and the gradients of x, weight, bias and x_bias as the reference's of
    x + x_bias. A large shift checks that it moves the means, not the variance."""
    N, C = 3, 40
    x, w, b, dy = _inputs((N, C, 6, 5), 8, dtype, layout="channels_last")
    g = torch.Generator().manual_seed(1)
    xb = 50 + 3 * torch.randn((N, C) if per_sample else (C,), generator=g)

    def run(fn, upcast):
        cast = (lambda t: t.double()) if upcast else (lambda t: t)
        leaves = [cast(t.detach()).clone().requires_grad_() for t in (x, w, b, xb)]
        out = fn(*leaves[:3], 8, 1e-5, True, x_bias=leaves[3])
        out.backward(cast(dy))
        return out, [t.grad for t in leaves]

    out, grads = run(group_norm, False)
    ref, ref_grads = run(group_norm_reference, True)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, **tol)
    for name, got, want, leaf in zip("x w b x_bias".split(), grads, ref_grads, (x, w, b, xb)):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape, name
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got.double() / scale, want / scale, **tol,
                                   msg=lambda m: f"grad of {name}: {m}")


def test_group_norm_x_bias_on_2d_input_and_with_only_some_gradients():
    """(N, C) input has no positions to sum the bias gradient over: it is dx itself."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g)
    for xb in (torch.randn(8, generator=g), torch.randn(4, 8, generator=g)):
        grads = []
        for fn in (group_norm, group_norm_reference):
            leaf, xbl = x.clone().requires_grad_(), xb.clone().requires_grad_()
            fn(leaf, w, b, 4, 1e-5, True, x_bias=xbl).square().sum().backward()
            grads.append((leaf.grad, xbl.grad))
        for got, want in zip(*grads):  # groups of 2 values: gradients up to ~60, fp32 sums
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    xb = torch.randn(8, generator=g, requires_grad=True)  # the bias alone needs a gradient
    group_norm(x, w, b, 4, x_bias=xb).sum().backward()
    assert xb.grad.shape == (8,)


def test_group_norm_keeps_the_variance_under_a_large_mean():
    # mean 1000, std 2: E[x²] − E[x]² in fp32 would lose the variance (off by ~0.1); the
    # pivot keeps the error at x's own rounding (fp32 steps of 6e-5 at 1000, over std 2)
    _compare((2, 16, 8, 8), 4, torch.float32, False, dict(rtol=1e-4, atol=1e-4),
             layout="channels_last", mean=1000.0)


def test_group_norm_with_many_programs_per_sample(monkeypatch):
    """Several splits of the positions and several channel blocks per sample, as on a GPU. The
    reduction pass's pipelining (``sum_stages``) only sets ``num_stages``, which the interpreter
    ignores: its settings are checked on the GPU (test_activations_gpu.py)."""
    monkeypatch.setattr(gn, "programs_cap", lambda device, per_sm=4: 64)
    monkeypatch.setitem(gn.LAUNCH, "sum_rows", 4)
    monkeypatch.setitem(gn.LAUNCH, "apply_rows", 8)
    monkeypatch.setitem(gn.LAUNCH, "max_channels", 16)
    # the combining kernels: a few groups a program, the last block of groups partly masked
    monkeypatch.setitem(gn.LAUNCH, "stats_elements", 24)
    assert gn._group_grid(torch.empty(3, 7, 40), 5) == ((3, 3), {
        "BLOCK_S": 8, "BLOCK_G": 2, "BLOCK_CG": 8, "num_warps": 1})
    _compare((2, 40, 7, 3), 5, torch.float32, True, layout="channels_last")
    assert gn._blocks(90, 64, 2, torch.device("cpu")) == (16, 4, 8, 12)
    _compare((2, 64, 9, 10), 8, torch.float32, True, layout="channels_last")
    _compare((2, 48, 9, 10), 4, torch.bfloat16, True, layout="contiguous")
    # splits meet a partly masked channel block, and a short last split
    assert gn._blocks(83, 40, 3, torch.device("cpu")) == (16, 3, 7, 12)  # last split: 11
    _compare((3, 40, 83), 8, torch.float32, True)
    # one group a program, as on a GPU, with more splits than one load takes
    monkeypatch.setitem(gn.LAUNCH, "stats_groups", 1)
    monkeypatch.setattr(gn, "programs_cap", lambda device, per_sm=4: 200)
    assert gn._blocks(2000, 40, 2, torch.device("cpu"))[2] > 16
    _compare((2, 40, 50, 40), 8, torch.float32, True, layout="channels_last")


def test_group_norm_gradient_layouts_and_parameter_dtypes():
    # an expanded (zero-stride) output gradient, as y.sum().backward() gives
    x = torch.randn(2, 8, 3, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    xr = x.detach().double().requires_grad_()
    group_norm(x, None, None, 4, silu=True).sum().backward()
    group_norm_reference(xr, None, None, 4, silu=True).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-5)
    # a channels-last gradient for a contiguous x
    x, w, b, dy = _inputs((2, 8, 3, 5), 4, torch.float32)
    out, grads = _run(group_norm, x, w, b, dy.contiguous(memory_format=torch.channels_last), 4,
                      True, upcast=False)
    ref, ref_grads = _run(group_norm_reference, x, w, b, dy, 4, True, upcast=True)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # bf16 parameters with bf16 activations (bf16-true): gradients in the parameters' dtype;
    # only one of weight and bias
    w16, b16 = torch.randn(8).bfloat16().requires_grad_(), torch.randn(8).bfloat16()
    y = group_norm(x.bfloat16(), w16, None, 4) + group_norm(x.bfloat16(), None, b16, 4)
    y.float().sum().backward()
    assert w16.grad.dtype == torch.bfloat16 and w16.grad.shape == (8,)


def test_group_norm_empty_batch():
    x = torch.zeros(0, 8, 3, 3, requires_grad=True)
    y = group_norm(x, torch.ones(8), torch.zeros(8), 4, silu=True)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape


@pytest.mark.parametrize("call, message", [
    (lambda: group_norm(torch.randn(2, 6, 3).int(), None, None, 3), "float32, bfloat16"),
    (lambda: group_norm(torch.randn(6), None, None, 3), "batch, channels"),
    (lambda: group_norm(torch.randn(2, 6, 3), None, None, 4), "6 channels do not split"),
    (lambda: group_norm(torch.randn(2, 6, 3), torch.ones(5), None, 3), "weight must be a"),
    (lambda: group_norm(torch.randn(2, 6, 3), None, torch.ones(6).long(), 3), "bias must be a"),
    (lambda: group_norm(torch.randn(2, 6, 3), None, None, 3, x_bias=torch.ones(3, 6)),
     "x_bias must be a"),
])
def test_group_norm_rejects_bad_input_in_one_line(call, message):
    with pytest.raises(ValueError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


def test_group_norm_compiles_without_graph_breaks():
    x, w, b, dy = _inputs((2, 16, 4, 4), 4, torch.float32, layout="channels_last")

    def fn(x, w, b):
        return (group_norm(x, w, b, 4, 1e-5, True) * dy).sum()

    assert_compiled_matches_eager(fn, [x, w, b])


def test_sd_group_norm_layers_keep_their_outputs_and_gradients():
    from fasttrain.layers.norm import GroupNorm

    torch.manual_seed(0)
    for silu in (True, False):
        layer = GroupNorm(4, 16, eps=1e-6, silu=silu)
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(layer.bias)
        x = torch.randn(2, 16, 5, 5).contiguous(memory_format=torch.channels_last)
        outs = []
        for fused in (False, True):
            layer.use_fused(fused)
            layer.zero_grad()
            xi = x.clone().requires_grad_()
            y = layer(xi)
            (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
            outs.append([y, xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone()])
        for got, want in zip(outs[1], outs[0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "silu" in repr(GroupNorm(2, 4, silu=True))
