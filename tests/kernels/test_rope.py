"""The rotary-embedding Triton kernel against the plain-PyTorch reference, run on CPU through
the Triton interpreter: outputs and both gradients, GQA, non-contiguous (transposed) q/k and
their output layout, bad input, and torch.compile without graph breaks."""
import re

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreted import (assert_compiled_matches_eager, interpret,  # noqa: E402,F401
                               kernels_interpreted)

with kernels_interpreted():
    from fasttrain.kernels import rope as rope_module
    from fasttrain.kernels.rope import rope, rope_reference
    from fasttrain.workloads.llama import CONFIGS, rope_tables
    from fasttrain.layers.rope import apply_rope


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=4e-3, atol=4e-3)}
# (B, Hq, Hk, T, D): GQA, D/2 not a power of two, T odd, Hq == Hk, MQA
SHAPES = [(2, 4, 2, 7, 16), (1, 3, 3, 5, 10), (2, 2, 1, 9, 64)]


def _tables(t: int, d: int, g: torch.Generator, rotation: bool = True):
    """cos, sin (t, d) fp32: a real rope table (equal halves), or arbitrary numbers."""
    if not rotation:
        return torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), torch.rand(d // 2, generator=g))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _inputs(shape, dtype, layout: str = "transposed", rotation: bool = True, extra_rows: int = 0):
    """q, k in ``layout``; cos, sin with ``extra_rows`` more positions than T; cotangents."""
    b, hq, hk, t, d = shape
    g = torch.Generator().manual_seed(0)

    def head_tensor(h):
        if layout == "transposed":  # proj(x).view(B, T, H, D).transpose(1, 2)
            return torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
        if layout == "qkv-slice":  # a non-dense slice of a wider projection
            return torch.randn(b, t, h, 2 * d, generator=g).to(dtype)[..., :d].transpose(1, 2)
        return torch.randn(b, h, t, d, generator=g).to(dtype)

    q, k = head_tensor(hq), head_tensor(hk)
    cos, sin = _tables(t + extra_rows, d, g, rotation)
    cotangents = [torch.randn(x.shape, generator=g).to(dtype) for x in (q, k)]
    return q, k, cos, sin, cotangents


def _run(fn, q, k, cos, sin, cotangents, upcast: bool):
    cast = (lambda t: t.float()) if upcast else (lambda t: t)
    # leaves with the same strides as q and k (clone keeps a dense tensor's layout)
    leaves = [cast(x.detach()).clone(memory_format=torch.preserve_format).requires_grad_()
              for x in (q, k)]
    outs = fn(*leaves, cos, sin)
    torch.autograd.backward(outs, [cast(c) for c in cotangents])
    return outs, [x.grad for x in leaves]


def _compare(q, k, cos, sin, cotangents):
    outs, grads = _run(rope, q, k, cos, sin, cotangents, upcast=False)
    ref_outs, ref_grads = _run(rope_reference, q, k, cos, sin, cotangents, upcast=True)
    tol = TOL[q.dtype]
    for x, got, want, grad, ref_grad, name in zip((q, k), outs, ref_outs, grads, ref_grads, "qk"):
        assert got.dtype == x.dtype and got.shape == x.shape, name
        torch.testing.assert_close(got.float(), want, **tol, msg=lambda m: f"{name}_rot: {m}")
        assert grad.dtype == x.dtype, name
        torch.testing.assert_close(grad.float(), ref_grad, **tol,
                                   msg=lambda m: f"grad of {name}: {m}")
    return outs


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
def test_matches_reference_outputs_and_all_gradients(layout, dtype, shape):
    q, k, *rest = _inputs(shape, dtype, layout, extra_rows=3)  # tables longer than T
    outs = _compare(q, k, *rest)
    # outputs keep the inputs' memory layout
    assert outs[0].stride() == q.stride() and outs[1].stride() == k.stride()


def test_fp16_matches_reference_outputs_and_all_gradients():
    _compare(*_inputs((1, 3, 3, 5, 10), torch.float16, extra_rows=3))  # D/2 odd, T odd


def test_non_dense_inputs_and_arbitrary_tables():
    # slices of a wider projection (outputs come back dense), and cos/sin without equal halves:
    # the backward is the exact transpose of the forward, not only a rotation by -θ
    _compare(*_inputs((2, 4, 2, 5, 12), torch.float32, "qkv-slice", rotation=False))


def test_many_heads_loop_in_tiles(monkeypatch):
    monkeypatch.setattr(rope_module, "_TILE", 16)  # 2 heads x 8 pairs per tile: 3 and 2 tiles
    _compare(*_inputs((1, 5, 3, 4, 16), torch.float32))


def test_matches_the_llama_model_rotation():
    cfg = CONFIGS["tiny"]
    cos, sin = rope_tables(cfg)
    q, k, _, _, _ = _inputs((2, cfg.heads, cfg.kv_heads, 6, cfg.dim // cfg.heads),
                            torch.float32)
    q_rot, k_rot = rope(q, k, cos, sin)
    torch.testing.assert_close(q_rot, apply_rope(q, cos[:6], sin[:6]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_rot, apply_rope(k, cos[:6], sin[:6]), rtol=1e-5, atol=1e-5)


def test_one_output_used_and_expanded_gradient():
    q, k, cos, sin, _ = _inputs((2, 4, 2, 3, 8), torch.float32)
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    rope(q, k, cos, sin)[0].sum().backward()  # a stride-0 gradient for q_rot, none for k_rot
    q2 = q.detach().clone().requires_grad_()
    rope_reference(q2, k.detach(), cos, sin)[0].sum().backward()
    torch.testing.assert_close(q.grad, q2.grad, rtol=1e-5, atol=1e-5)
    assert k.grad is None or not k.grad.any()


def _bad(**change):
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
    cos, sin = torch.randn(6, 8), torch.randn(6, 8)
    args = dict(q=q, k=k, cos=cos, sin=sin)
    args.update(change)
    return lambda: rope(**args)


@pytest.mark.parametrize("call, message", [
    (_bad(q=torch.randn(2, 4, 6, 7), k=torch.randn(2, 2, 6, 7)), "head dim D must be even"),
    (_bad(k=torch.randn(2, 2, 5, 8)), "k must match q in B, T, D"),
    (_bad(k=torch.randn(2, 2, 6, 8, dtype=torch.float64)), "k must match q in B, T, D"),
    (_bad(q=torch.randn(2, 6, 8)), "q and k must be (B, H, T, D)"),
    (_bad(cos=torch.randn(5, 8)), "cos must be (T' >= 6, 8), got (5, 8)"),
    (_bad(sin=torch.randn(6, 4)), "sin must be (T' >= 6, 8), got (6, 4)"),
    (_bad(q=torch.randn(2, 4, 6, 8).long()), "q must be float32"),
    (_bad(cos=torch.randn(6, 8, requires_grad=True)), "cos requires grad"),
], ids=["odd-d", "k-shape", "k-dtype", "q-dims", "cos-rows", "sin-cols", "q-dtype", "grad"])
def test_bad_input_is_a_one_line_value_error(call, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        call()
    assert "\n" not in str(err.value)


def _attention_inputs(q, k, cos, sin):
    b, t = q.shape[:2]  # (B, T, H*D) projections, viewed as in the Llama attention
    q_rot, k_rot = rope(q.view(b, t, 4, 8).transpose(1, 2), k.view(b, t, 2, 8).transpose(1, 2),
                        cos, sin)
    return (q_rot * q_rot).sum() + (k_rot[:, :1] * q_rot[:, 1:2]).sum()


def test_torch_compile_fullgraph_matches_eager():
    # interpreted: opaque custom ops (see fasttrain.kernels._triton); no graph break
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 16, generator=g)]
    cos, sin = _tables(5, 8, g)
    assert_compiled_matches_eager(lambda q, k: _attention_inputs(q, k, cos, sin), leaves)
