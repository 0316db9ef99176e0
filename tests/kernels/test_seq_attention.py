"""ViT's self-attention Triton kernels (kernels=attention) against their plain-PyTorch
reference, in Triton's interpreter on CPU: output and the qkv gradient for odd lengths (a
partial block of its own size), lengths below one block, head dims below a tile, the
batch-second layout, int64 offsets, bad input, torch.compile without graph breaks, and the ViT
model with the kernel switched on."""
import re

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreted import (assert_compiled_matches_eager, interpret,  # noqa: E402,F401
                               kernels_interpreted)

with kernels_interpreted():
    from fasttrain.kernels import seq_attention as module
    from fasttrain.kernels.seq_attention import seq_attention, seq_attention_reference


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
       torch.float16: dict(rtol=5e-3, atol=5e-3)}


def _run(fn, qkv, heads, cot, batch_second=False):
    qkv = qkv.clone().requires_grad_()
    out = fn(qkv, heads, batch_second=batch_second)
    out.backward(cot)
    return out.detach(), qkv.grad


def _inputs(batch, tokens, heads, head_dim, dtype, batch_second=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = (tokens, batch) if batch_second else (batch, tokens)
    qkv = torch.randn(*lead, 3 * heads * head_dim, generator=g).to(dtype)
    return qkv, torch.randn(*lead, heads * head_dim, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("batch, tokens, heads, head_dim", [
    (2, 197, 2, 64),  # ViT-B/16's length: three blocks of 64 and a partial one of 16
    (3, 64, 1, 24),  # one full block, no partial one; head_dim not a power of two
    (2, 17, 2, 16),  # shorter than one block (ViT tiny: 16 patches + the class token)
], ids=["197", "64", "17"])
def test_output_and_gradient_match_the_reference(dtype, batch, tokens, heads, head_dim):
    qkv, cot = _inputs(batch, tokens, heads, head_dim, dtype)
    got = _run(seq_attention, qkv, heads, cot)
    want = _run(seq_attention_reference, qkv, heads, cot)
    for name, a, b in zip(("out", "dqkv"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("block, tokens, wide, batch_second", [
    (32, 100, False, False),  # three blocks of 32 and a partial one of 16 (4 rows)
    (16, 40, False, True),  # (T, B, 3C) layout: token stride B·3C
    (64, 70, True, False),  # int64 offsets (WIDE), which qkv of 2³¹ elements take
], ids=["block32", "batch-second", "int64"])
def test_launch_settings_and_layouts_match_the_reference(monkeypatch, block, tokens, wide,
                                                         batch_second):
    for way in ("fwd", "bwd"):
        monkeypatch.setitem(module.LAUNCH, f"{way}_block", block)
    if wide:
        monkeypatch.setattr(module, "WIDE_ELEMENTS", 1)
    qkv, cot = _inputs(2, tokens, 2, 16, torch.float32, batch_second)
    got = _run(seq_attention, qkv, 2, cot, batch_second)
    want = _run(seq_attention_reference, qkv, 2, cot, batch_second)
    for name, a, b in zip(("out", "dqkv"), got, want):
        torch.testing.assert_close(a, b, **TOL[torch.float32], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype, tokens, head_dim, batch_second", [
    (torch.float32, 70, 24, False),  # blocks of 32: two full, a partial one of 6 rows (padded)
    (torch.bfloat16, 197, 64, False),  # ViT-B/16's length and head dim
    (torch.float32, 40, 16, True),
], ids=["fp32-70", "bf16-197", "batch-second"])
def test_projected_attention_sums_the_bias_gradient_in_its_kernels(monkeypatch, dtype, tokens,
                                                                   head_dim, batch_second):
    if tokens == 70:
        for way in ("fwd", "bwd"):
            monkeypatch.setitem(module.LAUNCH, f"{way}_block", 32)
    g = torch.Generator().manual_seed(1)
    x, cot = _inputs(2, tokens, 2, head_dim, dtype, batch_second)
    x = x[..., :2 * head_dim].contiguous()  # the model width C = heads · head_dim
    weight = (torch.randn(3 * 2 * head_dim, 2 * head_dim, generator=g) / 8).to(dtype)
    bias = (torch.randn(3 * 2 * head_dim, generator=g) * 0.2).to(dtype)
    results = []
    for fn in (module.projected_seq_attention, module.projected_seq_attention_reference):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        out = fn(*leaves, 2, batch_second=batch_second)
        out.backward(cot)
        results.append((out.detach(), *(t.grad for t in leaves)))
    for name, a, b in zip(("out", "dx", "dweight", "dbias"), *results):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        tol = TOL[dtype] if dtype == torch.float32 else \
            dict(rtol=3e-2, atol=3e-2 * b.float().abs().max().item())  # sums of bf16 products
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="bias must be a vector of the projection's"):
        module.projected_seq_attention(x, weight, bias[1:], 2)


def test_the_kernels_launch_opaque_with_their_register_caps(monkeypatch):
    """The caps (LAUNCH's ``*_maxnreg``) and the dk/dv kernel's own stages reach the launches,
    which go around Inductor (``opaque``), as it would drop the cap."""
    seen = {}
    monkeypatch.setattr(module, "launch",
                        lambda kernel, grid, *args, **meta: seen.setdefault(kernel.fn.__name__,
                                                                            meta))
    monkeypatch.setitem(module.LAUNCH, "dkv_stages", 5)
    qkv, cot = _inputs(2, 70, 2, 16, torch.float32)
    out, lse = torch.ops.fasttrain.seq_attention_fwd(qkv, None, 2, 0.25, False)
    torch.ops.fasttrain.seq_attention_bwd(cot, qkv, out, lse, 2, 0.25, False, True)
    assert set(seen) == {"_fwd_kernel", "_dq_kernel", "_dkv_kernel"}
    for name, way in (("_fwd_kernel", "fwd"), ("_dq_kernel", "dq"), ("_dkv_kernel", "dkv")):
        assert seen[name]["opaque"] and seen[name]["maxnreg"] == module.LAUNCH[f"{way}_maxnreg"]
    assert seen["_dkv_kernel"]["STAGES"] == 5
    assert seen["_dq_kernel"]["STAGES"] == module.LAUNCH["bwd_stages"]


def test_the_reference_is_sdpa_on_the_permuted_projection():
    qkv, _ = _inputs(2, 9, 2, 8, torch.float64)
    q, k, v = qkv.view(2, 9, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(seq_attention_reference(qkv, 2),
                               want.transpose(1, 2).reshape(2, 9, 16))
    torch.testing.assert_close(seq_attention_reference(qkv.transpose(0, 1), 2, batch_second=True),
                               want.permute(2, 0, 1, 3).reshape(9, 2, 16))


@pytest.mark.parametrize("call, message", [
    (lambda q: seq_attention(q.long(), 2), "qkv must be float32"),
    (lambda q: seq_attention(q[..., :-1], 2), "qkv must be (batch, tokens, 3 * heads"),
    (lambda q: seq_attention(q[0], 2), "qkv must be (batch, tokens, 3 * heads"),
    (lambda q: seq_attention(torch.zeros(1, 4, 3 * 512), 1), "head_dim 512 is more than"),
], ids=["dtype", "width", "rank", "head-dim"])
def test_bad_input_is_a_one_line_value_error(call, message):
    qkv, _ = _inputs(2, 9, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        call(qkv)
    assert "\n" not in str(err.value)


def test_torch_compile_fullgraph_matches_eager():
    qkv, _ = _inputs(2, 20, 2, 16, torch.float32)
    proj = torch.randn(32, 32)

    def block(qkv):
        return (seq_attention(qkv * 2, 2) @ proj).square().sum()

    assert_compiled_matches_eager(block, [qkv])


@pytest.mark.parametrize("batch_second", [False, True], ids=["batch-first", "batch-second"])
def test_vit_with_the_attention_kernel_keeps_its_losses(batch_second):
    from fasttrain.recipe import Recipe
    from fasttrain.run.loop import train
    from fasttrain.workloads import load_workload

    wl = load_workload("vit", "tiny", batch_second=batch_second)
    plain = train(wl, Recipe(batch=2), steps=2, warmup=0, device="cpu")
    fused = train(wl, Recipe(batch=2, kernels="attention"), steps=2, warmup=0, device="cpu")
    assert fused.losses == pytest.approx(plain.losses, rel=1e-5)
    assert fused.applied["kernels"] == ("self-attention from the qkv projection's layout in one "
                                        "Triton kernel each way ×2")
    assert fused.applied["attention"] == ("the Triton self-attention kernel in 2 layers "
                                          "(kernels=attention); SDPA is not called")
