"""fp8 linear layers: the float8 matmuls against an emulation of the same quantisation, the
fallback for unaligned shapes, and the technique's choice of layers (CPU: torch's reference
float8 kernels)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.errors import FasttrainError
from fasttrain.kernels.fp8_linear import E4M3, E5M2, fp8_linear, to_fp8
from fasttrain.layers.linear import Float8Linear
from fasttrain.recipe import Recipe
from fasttrain.run.loop import train
from fasttrain.workloads import load_workload


def _dequant(x, dtype):
    x8, inv = to_fp8(x, dtype)
    return x8.float() * inv


def test_to_fp8_maps_the_absolute_maximum_to_the_format_maximum():
    x = torch.tensor([[0.5, -3.0], [1.5, 0.25]])
    x8, inv = to_fp8(x, E4M3)
    assert x8.dtype == E4M3 and x8.float().abs().max() == torch.finfo(E4M3).max
    assert torch.allclose(x8.float() * inv, x, rtol=2 ** -3)  # 3 mantissa bits
    z8, zinv = to_fp8(torch.zeros(4, 4), E5M2)
    assert torch.isfinite(zinv) and not z8.float().any()


@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_matches_an_emulation_of_its_quantisation(bias):
    torch.manual_seed(0)
    x = torch.randn(2, 32, 48, requires_grad=True)
    w = torch.randn(64, 48, requires_grad=True)
    b = torch.randn(64, requires_grad=True) if bias else None
    g = torch.randn(2, 32, 64)
    y = fp8_linear(x, w, b)
    (y.float() * g).sum().backward()
    assert y.dtype == torch.bfloat16 and y.shape == (2, 32, 64)
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    # the same quantisation in fp32 arithmetic
    xq, wq = _dequant(x.detach().reshape(64, 48), E4M3), _dequant(w.detach(), E4M3)
    ref = xq @ wq.t() + (b.detach().to(torch.bfloat16).float() if bias else 0)
    gq = _dequant(g.reshape(64, 64).to(torch.bfloat16), E5M2)
    close = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.float().reshape(64, 64), ref, **close)
    torch.testing.assert_close(x.grad.reshape(64, 48), gq @ wq, **close)
    torch.testing.assert_close(w.grad, gq.t() @ xq, **close)
    if bias:
        torch.testing.assert_close(b.grad, g.reshape(64, 64).to(torch.bfloat16).float().sum(0),
                                   **close)
    # and within float8's rounding of the exact product
    exact = x.detach().reshape(64, 48) @ w.detach().t()
    exact = exact + (b.detach() if bias else 0)
    assert (y.float().reshape(64, 64) - exact).norm() / exact.norm() < 0.1


def test_fp8_linear_runs_unaligned_token_counts_in_bf16():
    x, w = torch.randn(3, 5, 32), torch.randn(16, 32)  # 15 tokens: not a multiple of 16
    assert torch.equal(fp8_linear(x, w), F.linear(x.bfloat16(), w.bfloat16()))


def test_technique_converts_trainable_aligned_block_linears_only():
    wl = load_workload("sd", "tiny")
    model = wl.build_model()
    keys = set(model.state_dict())
    r = Recipe(precision="bf16-mixed", fp8="linear")
    res = train(load_workload("llama", "tiny"), r, steps=1, warmup=0, device="cpu")
    assert "linear layers in float8" in res.applied["fp8"]
    from fasttrain.techniques.fp8 import fp8_targets

    layers, _ = fp8_targets(wl.regional_blocks(model))
    assert layers and all(m.weight.requires_grad for m in layers)  # the UNet, not the encoders
    for m in layers:
        m.__class__ = Float8Linear
    assert set(model.state_dict()) == keys


def test_fp8_keeps_the_loss_and_needs_bf16():
    base = Recipe(precision="bf16-mixed", attention="auto")
    wl = load_workload("llama", "tiny")
    ref = train(wl, base, steps=3, warmup=0, device="cpu").losses
    got = train(load_workload("llama", "tiny"), base.replace(fp8="linear"), steps=3, warmup=0,
                device="cpu").losses
    assert got != ref and max(abs(a - b) / b for a, b in zip(got, ref)) < 2e-2
    with pytest.raises(FasttrainError, match="fp8=linear needs precision=bf16"):
        Recipe(precision="fp32", fp8="linear")


def test_large_mode_takes_only_layers_of_2_24_weights():
    from fasttrain.techniques.fp8 import fp8_targets

    blocks = [nn.Sequential(nn.Linear(2048, 8192), nn.Linear(2048, 2048), nn.Linear(8, 8))]
    with torch.device("meta"):
        big, left = fp8_targets(blocks, "large")
        every, unaligned = fp8_targets(blocks, "linear")
    assert [m.out_features for m in big] == [8192] and left == 2
    assert len(every) == 2 and unaligned == 1


@pytest.mark.gpu
def test_fp8_linear_on_cuda_matches_its_emulation_eager_and_compiled():
    from fasttrain.kernels.fp8_linear import E4M3, E5M2, fp8_linear, to_fp8

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 tensor cores need compute capability 8.9+")
    torch.manual_seed(0)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(384, 256, device="cuda", requires_grad=True)
    g = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)

    def deq(t, dtype):
        t8, inv = to_fp8(t, dtype)
        return t8.float() * inv

    xq, wq, gq = deq(x.detach(), E4M3), deq(w.detach(), E4M3), deq(g, E5M2)
    for fn in (fp8_linear, torch.compile(fp8_linear)):
        x.grad = w.grad = None
        y = fn(x, w)
        y.backward(g)
        close = dict(rtol=2e-2, atol=2e-1)
        torch.testing.assert_close(y.float(), xq @ wq.t(), **close)
        torch.testing.assert_close(x.grad.float(), gq @ wq, **close)
        torch.testing.assert_close(w.grad, gq.t() @ xq, **close)

