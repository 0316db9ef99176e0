"""The narrow convolution's Triton kernel (kernels/narrow_conv.py) against F.conv2d, run on the
CPU through the Triton interpreter: fp32/bf16/fp16, inputs in any layout, odd shapes and
padded channel blocks, bad input; the GemmConv2d layer's fused path (frozen only, under
autocast, compiled without graph breaks) and kernels=conv in SD's training step."""
import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from tests.interpreted import interpret, kernels_interpreted  # noqa: E402,F401

with kernels_interpreted():
    from fasttrain.kernels import narrow_conv
    from fasttrain.kernels.narrow_conv import narrow_conv2d, narrow_conv2d_reference

from fasttrain.layers.conv import GemmConv2d, as_gemm  # noqa: E402


def _ulp_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within one rounding of the exact result in ``dtype`` (fp32: a few fp32 ulps)."""
    eps = torch.finfo(dtype).eps
    tol = want.abs() * (eps if dtype != torch.float32 else 8 * eps) + 1e-6
    assert ((got.double() - want).abs() <= tol).all(), (got.double() - want).abs().max()


CASES = [(3, 128, (3, 3), (1, 1), 9, 7), (4, 20, (3, 3), (1, 1), 5, 6),
         (1, 16, (1, 3), (0, 1), 4, 5), (3, 16, (1, 1), (0, 0), 3, 3),
         (7, 33, (3, 3), (0, 0), 6, 5), (2, 200, (3, 1), (1, 0), 5, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_narrow_conv_gives_the_plain_convolution(case, dtype, layout):
    c, o, k, pad, h, w = case
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, c, h, w, generator=g).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":  # every other column of a wider tensor
        x = torch.cat([x, x], dim=-1)[..., ::2]
    weight = (torch.randn(o, c, *k, generator=g) / 3).to(dtype)
    for bias in (torch.randn(o, generator=g).to(dtype), None):
        got = narrow_conv2d(x, weight, bias, pad)
        want = narrow_conv2d_reference(x.double(), weight.double(),
                                       None if bias is None else bias.double(), pad)
        assert got.dtype == dtype and got.shape == want.shape
        assert got.is_contiguous(memory_format=torch.channels_last)
        _ulp_close(got, want.to(dtype).double() if dtype != torch.float32 else want, dtype)


@pytest.mark.parametrize("tiles", [1, 3])
def test_narrow_conv_over_more_pixels_than_one_tile_and_more_filters_than_one_block(
        tiles, monkeypatch):
    monkeypatch.setitem(narrow_conv.LAUNCH, "tiles", tiles)  # 3: a program's last tile masked
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 13, 11, generator=g)
    weight, bias = torch.randn(300, 3, 3, 3, generator=g), torch.randn(300, generator=g)
    assert narrow_conv.LAUNCH["block_m"] < 2 * 13 * 11 and narrow_conv.LAUNCH["max_block_n"] < 300
    torch.testing.assert_close(narrow_conv2d(x, weight, bias, (1, 1)),
                               narrow_conv2d_reference(x, weight, bias, (1, 1)),
                               rtol=1e-5, atol=1e-5)


def test_narrow_conv_refuses_what_it_cannot_compute():
    x, w = torch.randn(1, 3, 8, 8), torch.randn(16, 3, 3, 3)
    for args, says in [((torch.randn(1, 8, 8, 8), torch.randn(4, 8, 3, 3)), "up to 7 input"),
                       ((torch.randn(1, 7, 8, 8), torch.randn(4, 7, 5, 5)), "64 values"),
                       ((x, torch.randn(16, 4, 3, 3)), "the weights 4"),
                       ((x, w.double()), "one of fp32"),
                       ((x[0], w), "(N, C, H, W)"),
                       ((x, w, torch.randn(15)), "bias of shape"),
                       ((x, w, None, (3, 1)), "padding (3, 1)"),
                       ((x.requires_grad_(), w), "forward-only")]:
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            narrow_conv2d(*args)
    with torch.no_grad():  # no gradient asked for: fine
        narrow_conv2d(x, w, None, (1, 1))


def _layer(frozen: bool, cin: int = 3) -> tuple[nn.Conv2d, GemmConv2d]:
    torch.manual_seed(0)
    plain, fused = nn.Conv2d(cin, 24, 3, padding=1), nn.Conv2d(cin, 24, 3, padding=1)
    fused.load_state_dict(plain.state_dict())
    as_gemm(fused)
    plain.requires_grad_(not frozen)
    fused.requires_grad_(not frozen)
    return plain, fused


def test_frozen_gemm_conv_runs_the_triton_pass_and_gives_the_plain_output(monkeypatch):
    plain, fused = _layer(frozen=True)
    assert fused.use_fused(True) == [
        "3 → 24 channels, 3 × 3 convolution in one Triton pass (frozen, forward only)"]
    calls = []
    real = narrow_conv.narrow_conv2d
    monkeypatch.setattr(narrow_conv, "narrow_conv2d", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(2, 3, 10, 9)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", torch.bfloat16):
        got, want = fused(x), plain(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert len(calls) == 2
    # an input that needs a gradient takes the gather + GEMM, whose backward gives it one
    xg = x.clone().requires_grad_()
    fused(xg).sum().backward()
    assert len(calls) == 2 and xg.grad is not None


def test_a_trained_gemm_conv_keeps_the_gather_and_gemm():
    plain, fused = _layer(frozen=False)
    said = fused.use_fused(True)
    assert not fused.fused and "kept as a gather + GEMM (its weights train" in said[0]
    x = torch.randn(2, 3, 6, 6)
    fused(x).square().sum().backward()
    plain(x).square().sum().backward()
    torch.testing.assert_close(fused.weight.grad, plain.weight.grad, rtol=1e-4, atol=1e-4)


def test_fused_gemm_conv_compiles_without_graph_breaks():
    from torch._dynamo.utils import counters

    plain, fused = _layer(frozen=True)
    fused.use_fused(True)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(lambda x: fused(x).relu())(x)
    assert not counters["graph_break"]
    torch.testing.assert_close(got, plain(x).relu(), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_kernels_conv_runs_the_vae_input_in_triton_with_the_plain_losses():
    from fasttrain.recipe import Recipe
    from fasttrain.run.loop import train
    from fasttrain.workloads import load_workload

    wl = load_workload("sd", "tiny")
    base = Recipe(precision="bf16-mixed")  # no channels_last: kernels=conv converts the VAE's
    plain = train(wl, base, steps=2, warmup=0, device="cpu")
    fused = train(wl, base.replace(kernels="conv"), steps=2, warmup=0, device="cpu")
    assert fused.applied["kernels"] == ("3 → 32 channels, 3 × 3 convolution in one Triton pass "
                                        "(frozen, forward only) ×1")
    assert not fused.warnings
    torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(plain.losses),
                               rtol=2e-2, atol=0)
