"""The RMSNorm and LayerNorm kernels compiled on CUDA (marker ``gpu``; skipped without a GPU).
A sibling of test_kernels.py, whose kernels run in Triton's interpreter and which is skipped
on a GPU (tests/interpreted.py)."""
import pytest
import torch

from fasttrain.recipe import Recipe
from tests.gpu_helpers import kernels_keep_the_losses


@pytest.mark.gpu
@pytest.mark.parametrize("rows, dim", [(300, 1000), (50_000, 128)], ids=["odd", "many-tiles"])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_triton_norms_compiled_on_cuda_match_the_reference(op, rows, dim):
    """The compiled Triton path (the CPU tests run the interpreter): bf16, odd width, more
    tiles than persistent backward programs, torch.compile fullgraph with inductor, outputs
    and all gradients."""
    from fasttrain.kernels import norms

    torch.manual_seed(0)
    x, r = (torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    w = torch.rand(dim, device="cuda", requires_grad=True)
    b = torch.randn(dim, device="cuda", requires_grad=True)

    xb = (0.3 * torch.randn(dim, device="cuda")).requires_grad_()  # layer_norm's x_bias

    def block(f):
        def run(x, r, w, b, xb):
            y, h = f(x, w, 1e-6, residual=r) if op == "rms_norm" else \
                f(x, w, b, 1e-6, residual=r, x_bias=xb)
            return (y.float() * 1.5 * torch.linspace(0, 1, dim, device="cuda")).sum() + \
                h.float().sum()
        return run

    results = []
    for fn in (torch.compile(block(getattr(norms, op)), fullgraph=True),
               block(getattr(norms, f"{op}_reference"))):
        for t in (x, r, w, b, xb):
            t.grad = None
        out = fn(x, r, w, b, xb)
        out.backward()
        results.append([out.detach().float()] + [t.grad.float() for t in (x, r, w)] +
                       ([b.grad, xb.grad] if op == "layer_norm" else []))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_vit_layer_norm_kernel_in_the_graphed_training_loop_keeps_the_losses():
    kernels_keep_the_losses("vit", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                           compile="model", cuda_graphs=True),
                             ("layernorm",), "LayerNorm (with the residual add before it) in Triton")


@pytest.mark.gpu
def test_llama_rms_norm_kernels_in_the_graphed_training_loop_keep_the_losses():
    kernels_keep_the_losses("llama", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                             compile="model", cuda_graphs=True),
                             ("rmsnorm", "rmsnorm,rope"),
                             "RMSNorm (with the residual add before it) in Triton")



@pytest.mark.gpu
def test_fused_cross_entropy_compiled_on_cuda_matches_the_plain_path():
    """The loss's Triton kernel compiled (fullgraph, inductor) under bf16 autocast at a large
    vocabulary with a padded tail and ignored labels: the loss and both gradients against the
    plain path."""
    from fasttrain.kernels.cross_entropy import linear_cross_entropy_fused
    from fasttrain.kernels.linear_cross_entropy import linear_cross_entropy_reference

    torch.manual_seed(0)
    h = torch.randn(2, 1000, 256, device="cuda", requires_grad=True)
    w = (0.05 * torch.randn(32_064, 256, device="cuda")).requires_grad_()
    y = torch.randint(0, 32_000, (2, 1000), device="cuda")
    y[0, :50] = -100
    results = []
    for fn in (torch.compile(lambda h, w, y: linear_cross_entropy_fused(h, w, y, vocab=32_000),
                             fullgraph=True),
               lambda h, w, y: linear_cross_entropy_reference(h, w, y, vocab=32_000)):
        h.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(h, w, y)
        (loss / 1950).backward()
        results.append((loss.detach(), h.grad.clone(), w.grad.clone()))
    (l1, h1, w1), (l2, h2, w2) = results
    torch.testing.assert_close(l1, l2, rtol=1e-4, atol=0)
    torch.testing.assert_close(h1, h2, rtol=2e-2, atol=2e-2 * h2.abs().max().item())
    torch.testing.assert_close(w1, w2, rtol=2e-2, atol=2e-2 * w2.abs().max().item())
    assert torch.equal(w1[32_000:], torch.zeros_like(w1[32_000:]))


@pytest.mark.gpu
def test_llama_fused_loss_in_the_graphed_training_loop_keeps_the_losses():
    kernels_keep_the_losses("llama", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                             compile="model", cuda_graphs=True),
                             ("loss",), "linear + cross-entropy, the logits' gradient")
