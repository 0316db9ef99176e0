"""Chunked linear + cross-entropy against the full-logits path: loss and both gradients."""
import pytest
import torch
import torch.nn.functional as F

from fasttrain.kernels.linear_cross_entropy import (linear_cross_entropy,
                                                    linear_cross_entropy_reference)


def _inputs(dtype, n=(2, 37), c=16, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*n, c, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(v, c, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randint(0, v, n, generator=g)
    y[0, :5] = -100  # ignored positions (padding)
    return h, w, y


def _run(fn, h, w, y):
    h.grad = w.grad = None
    loss = fn(h, w, y)
    loss.backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("chunk", [1, 7, 10, 74, 500])
def test_matches_fp64_full_logits_for_any_chunking(chunk):
    h, w, y = _inputs(torch.float64)
    exact = lambda h, w, y: F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten(),  # noqa: E731
                                            reduction="sum", ignore_index=-100)
    got = _run(lambda *a: linear_cross_entropy(*a, chunk=chunk), h, w, y)
    want = _run(exact, h, w, y)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_matches_the_reference_in_fp32_and_under_bf16_autocast():
    h, w, y = _inputs(torch.float32)
    for a, b in zip(_run(lambda *a: linear_cross_entropy(*a, chunk=16), h, w, y),
                    _run(linear_cross_entropy_reference, h, w, y)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(lambda *a: linear_cross_entropy(*a, chunk=16), h, w, y)
        want = _run(linear_cross_entropy_reference, h, w, y)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_without_grad_it_only_computes_the_loss():
    h, w, y = _inputs(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y, chunk=8)
    torch.testing.assert_close(loss, linear_cross_entropy_reference(h, w, y).detach())


def test_compiles_without_graph_breaks():
    h, w, y = _inputs(torch.float32)
    torch._dynamo.reset()
    fn = torch.compile(lambda h, w, y: linear_cross_entropy(h, w, y, chunk=16),
                       backend="aot_eager", fullgraph=True)
    for a, b in zip(_run(fn, h, w, y), _run(linear_cross_entropy_reference, h, w, y)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mismatched_shapes_are_one_line_errors():
    h, w, y = _inputs(torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(h, w[:, :8], y)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        linear_cross_entropy(h, w, y, chunk=0)


def test_gradient_work_only_for_what_needs_it():
    """No grad mode: the loss's GEMM only; a frozen weight: no weight-gradient GEMM."""
    from torch.utils.flop_counter import FlopCounterMode

    h, w, y = _inputs(torch.float32)
    one = 2 * h.shape[0] * h.shape[1] * h.shape[2] * w.shape[0]  # one (tokens x C x V) GEMM

    def flops(fn):
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    with torch.no_grad():
        assert flops(lambda: linear_cross_entropy(h, w, y, chunk=16)) == one
    frozen = w.detach()
    assert flops(lambda: linear_cross_entropy(h, frozen, y, chunk=16)) == 2 * one
    h.grad = None
    linear_cross_entropy(h, frozen, y, chunk=16).backward()
    assert h.grad is not None


@pytest.mark.gpu
def test_fused_linear_cross_entropy_on_cuda_matches_the_reference():
    from fasttrain.kernels.linear_cross_entropy import (linear_cross_entropy,
                                                        linear_cross_entropy_reference)

    torch.manual_seed(0)
    h = torch.randn(3000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32000, 256, device="cuda") * 0.02).requires_grad_()
    y = torch.randint(0, 32000, (3000,), device="cuda")
    y[:100] = -100
    results = []
    for f in (lambda: linear_cross_entropy(h, w, y, chunk=1024),
              lambda: linear_cross_entropy_reference(h, w, y)):
        h.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f()
        loss.backward()
        results.append([loss.detach(), h.grad.float(), w.grad])
    for got, want in zip(*results):  # both round their GEMM outputs to bf16, in other orders
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2 * float(want.abs().max()))

