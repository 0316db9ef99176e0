"""Attention to a short context (kernels/context_attention.py) against SDPA, run on the CPU
through the Triton interpreter: output and q/k/v gradients in fp32/bf16/fp16, odd lengths,
128 keys, several programs per head, strided k and v (the text projection's stacked output),
bad input; SD's cross-attention layer on its fused path (kernels=context) and compiled."""
import pytest
import torch

pytest.importorskip("triton")

from tests.interpreted import interpret, kernels_interpreted  # noqa: E402,F401

with kernels_interpreted():
    from fasttrain.kernels import context_attention as ca
    from fasttrain.kernels.context_attention import (context_attention,
                                                     context_attention_reference)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=3e-3, atol=3e-3)}


def _grads(fn, q, k, v, heads, dy, upcast):
    cast = (lambda t: t.double()) if upcast else (lambda t: t)
    leaves = [cast(t.detach()).clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, heads)
    out.backward(cast(dy))
    return [out] + [t.grad for t in leaves]


def _compare(B, T, Tk, heads, D, dtype, kv=None):
    g = torch.Generator().manual_seed(T * 7 + Tk)
    C = heads * D
    q = torch.randn(B, T, C, generator=g).to(dtype)
    k, v = kv if kv is not None else (torch.randn(B, Tk, C, generator=g).to(dtype),
                                      torch.randn(B, Tk, C, generator=g).to(dtype))
    dy = torch.randn(B, T, C, generator=g).to(dtype)
    got = _grads(context_attention, q, k, v, heads, dy, upcast=False)
    want = _grads(context_attention_reference, q, k, v, heads, dy, upcast=True)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and a.shape == b.shape, name
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double() / scale, b / scale, **TOL[dtype],
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 70, 13, 2, 40), (1, 33, 77, 3, 16), (2, 129, 128, 1, 64),
                                   (1, 5, 1, 2, 8)], ids=str)
def test_context_attention_gives_sdpa_and_its_gradients(shape, dtype):
    _compare(*shape, dtype)


def test_context_attention_with_one_program_per_block_and_strided_keys(monkeypatch):
    # more blocks of queries than programs per head, and fewer; k and v as the two halves of
    # one stacked projection's output (rows 2·C apart)
    monkeypatch.setitem(ca.LAUNCH, "fwd_block", 16)
    monkeypatch.setitem(ca.LAUNCH, "bwd_block", 16)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 77, 2 * 48, generator=g)
    for per_head in (2, 64):
        monkeypatch.setitem(ca.LAUNCH, "bwd_programs_per_head", per_head)
        _compare(2, 100, 77, 3, 16, torch.float32, kv=kv.split(48, dim=-1))


@pytest.mark.parametrize("args, says", [
    (((2, 8, 32), (2, 5, 32), (2, 5, 16)), "takes q \\(B, T, C\\)"),
    (((2, 8, 32), (3, 5, 32), (3, 5, 32)), "takes q \\(B, T, C\\)"),
    (((2, 8, 30), (2, 5, 30), (2, 5, 30)), "30 channels do not split into 4 heads"),
    (((2, 8, 512), (2, 5, 512), (2, 5, 512)), "head dims up to 64"),
    (((2, 8, 32), (2, 129, 32), (2, 129, 32)), "up to 128 keys")])
def test_context_attention_refuses_what_it_cannot_compute(args, says):
    q, k, v = (torch.randn(*s) for s in args)
    with pytest.raises(ValueError, match=says):
        context_attention(q, k, v, 4)
    with pytest.raises(ValueError, match="one of fp32"):
        context_attention(torch.randn(1, 2, 8).double(), torch.randn(1, 2, 8).double(),
                          torch.randn(1, 2, 8).double(), 2)


def _layers():
    from fasttrain.workloads.sd_transformer import Attention

    torch.manual_seed(0)
    plain, fused = Attention(64, 2, context=24), Attention(64, 2, context=24)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def test_sd_cross_attention_layer_on_the_fused_path():
    plain, fused = _layers()
    assert fused.fused_kind == "context"
    assert fused.use_fused(True) == [
        "cross-attention to the text (up to 128 keys, head dim 32) in one Triton kernel each "
        "way, from the projections' layout"]
    x, ctx = torch.randn(2, 10, 64), torch.randn(2, 77, 24)
    outs = []
    for layer in (plain, fused):
        xl = x.clone().requires_grad_()
        y = layer(xl, ctx)
        y.square().sum().backward()
        outs.append((y, xl.grad, layer.to_q.weight.grad, layer.to_k.weight.grad,
                     layer.to_v.weight.grad))
        kv = layer.text_heads(layer.to_k(ctx), layer.to_v(ctx))  # the UNet's stacked path
        torch.testing.assert_close(layer(x, ctx, kv=kv), outs[-1][0], rtol=1e-5, atol=1e-5)
    for got, want in zip(*outs[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_self_attention_and_wide_heads_keep_sdpa():
    from fasttrain.workloads.sd_transformer import Attention

    assert Attention(64, 2).fused_kind is None  # self-attention: not this family
    wide = Attention(640, 8, context=24)
    assert wide.use_fused(True) == ["cross-attention kept on SDPA (head dim 80 > 64)"]
    assert not wide.fused


def test_fused_cross_attention_compiles_without_graph_breaks():
    from torch._dynamo.utils import counters

    plain, fused = _layers()
    fused.use_fused(True)
    x, ctx = torch.randn(2, 10, 64), torch.randn(2, 77, 24)
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(fused)(x, ctx)
    assert not counters["graph_break"]
    torch.testing.assert_close(got, plain(x, ctx), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_kernels_context_in_sd_training_keeps_the_losses():
    from fasttrain.recipe import Recipe
    from fasttrain.run.loop import train
    from fasttrain.workloads import load_workload

    wl = load_workload("sd", "tiny")
    base = Recipe(precision="bf16-mixed")
    plain = train(wl, base, steps=2, warmup=0, device="cpu")
    fused = train(wl, base.replace(kernels="context"), steps=2, warmup=0, device="cpu")
    assert "cross-attention to the text (up to 128 keys, head dim 16)" in fused.applied["kernels"]
    assert not fused.warnings
    torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(plain.losses),
                               rtol=2e-2, atol=0)
