"""gemm_pad: odd GEMM output widths padded to a multiple of N, with the plain path's numbers."""
import pytest
import torch
from torch import nn

from fasttrain.errors import FasttrainError
from fasttrain.kernels.linear_cross_entropy import linear_cross_entropy
from fasttrain.layers.linear import PaddedLinear, linear
from fasttrain.layers.loss import LMHeadLoss
from fasttrain.recipe import Recipe
from fasttrain.run.loop import train
from fasttrain.techniques.gemm_pad import odd_widths, pad_linears
from fasttrain.workloads import load_workload


def _grads(module, *inputs):
    module.zero_grad()
    inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = module(*inputs)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [t.grad for t in inputs if t.is_floating_point()], \
        {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("bias", [True, False])
def test_a_padded_linear_computes_the_plain_layer_and_its_gradients(bias):
    torch.manual_seed(0)
    plain = nn.Linear(24, 1000, bias=bias)
    padded = nn.Linear(24, 1000, bias=bias)
    padded.load_state_dict(plain.state_dict())
    assert pad_linears(padded, 64) == ["Linear 1000 → 1024"]
    assert isinstance(padded, PaddedLinear) and padded.padded == 1024
    assert padded.weight.shape == (1000, 24)  # the parameters keep their shapes
    x = torch.randn(3, 5, 24)
    want, got = _grads(plain, x), _grads(padded, x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1][0], want[1][0], rtol=1e-6, atol=1e-6)
    for n, g in got[2].items():
        torch.testing.assert_close(g, want[2][n], rtol=1e-6, atol=1e-6)
    # the fused paths' matmul without the bias pads as well
    torch.testing.assert_close(linear(padded, x, bias=False), x @ plain.weight.t(),
                               rtol=1e-6, atol=1e-6)


def test_only_widths_worth_padding_are_padded():
    model = nn.Sequential(nn.Linear(8, 96), nn.Linear(96, 32), nn.Linear(32, 1000),
                          nn.Linear(1000, 1024))
    assert [(label, w) for label, _, w in odd_widths(model, 64)] == [("2", 1000)]  # 96: +33%
    assert odd_widths(model, 8) == []  # every width a multiple of 8


@pytest.mark.parametrize("fused", [False, True])
def test_the_lm_head_loss_on_a_padded_vocabulary_keeps_the_loss_and_gradients(fused):
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 7, 16), torch.randn(509, 16)
    labels = torch.randint(0, 509, (2, 7))
    labels[0, 3] = -100
    plain, padded = LMHeadLoss(chunk=4, vocab=509), LMHeadLoss(chunk=4, vocab=509)
    assert pad_linears(padded, 8) == ["LMHeadLoss vocabulary 509 → 512"]
    outs = []
    for layer in (plain, padded):
        layer.use_fused(fused)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = layer(h, w, labels)
        loss.backward()
        outs.append((loss.detach(), h.grad, w.grad))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert outs[1][2].shape == (509, 16)


def test_the_chunked_loss_refuses_a_vocabulary_larger_than_the_weight():
    with pytest.raises(ValueError, match="vocab 600 is not in 1..512"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(512, 8), torch.zeros(4).long(),
                             vocab=600)


def test_llama_with_an_odd_vocabulary_trains_the_same_losses_padded():
    wl = load_workload("llama", "tiny", vocab=509)
    plain = train(wl, Recipe(), steps=3, warmup=0, device="cpu")
    padded = train(wl, Recipe(gemm_pad=8), steps=3, warmup=0, device="cpu")
    assert padded.losses == pytest.approx(plain.losses, rel=1e-6)
    assert padded.applied["gemm_pad"] == ("output widths padded to a multiple of 8: "
                                          "lm_head 509 → 512, head_loss vocabulary 509 → 512")
    assert padded.model_flops == plain.model_flops  # counted on the unpadded model


def test_nothing_to_pad_is_a_warning_and_a_bad_multiple_an_error():
    res = train(load_workload("vit", "tiny"), Recipe(gemm_pad=8), steps=1, warmup=0)
    assert "gemm_pad" not in res.applied
    assert any(w.startswith("gemm_pad: no linear output width of vit") for w in res.warnings)
    with pytest.raises(FasttrainError, match="gemm_pad must be 0 .off. or a multiple of 8, not 12"):
        Recipe(gemm_pad=12)
    with pytest.raises(FasttrainError, match="has no option 'vocab'"):
        load_workload("vit", "tiny", vocab=10)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_loss", [False, True], ids=["plain-loss", "fused-loss"])
def test_padded_gemm_widths_in_the_compiled_training_loop_keep_the_losses(fused_loss):
    wl = load_workload("llama", "tiny", vocab=509)
    base = Recipe(precision="bf16-mixed", optimizer_impl="fused", compile="model",
                  kernels="loss" if fused_loss else "none")
    plain = train(wl, base, steps=4, warmup=0, device="cuda")
    padded = train(wl, base.replace(gemm_pad=64), steps=4, warmup=0, device="cuda")
    assert "head_loss vocabulary 509 → 512" in padded.applied["gemm_pad"]
    torch.testing.assert_close(torch.tensor(padded.losses), torch.tensor(plain.losses),
                               rtol=1e-2, atol=0)

