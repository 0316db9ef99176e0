"""Pre-norm blocks (layers/blocks.py) on the fused LayerNorm path: the attention projection's
and fc2's biases and both residual adds move into the norms' kernels, one block handing its MLP
branch to the next, and the model computes what the plain path does (kernels interpreted).
Llama's blocks do the same with fused RMSNorms, the final norm adding the last branch."""
import copy

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreted import interpret, kernels_interpreted  # noqa: E402,F401

with kernels_interpreted():
    import fasttrain.kernels.norms  # noqa: F401

from fasttrain.layers.blocks import run_blocks  # noqa: E402
from fasttrain.layers.norm import LayerNorm, RMSNorm  # noqa: E402
from fasttrain.workloads import load_workload  # noqa: E402


def _loss_and_grads(model, images, labels):
    model.zero_grad()
    loss = model(images, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _fused(model):
    fused = copy.deepcopy(model)
    for m in fused.modules():
        if isinstance(m, (LayerNorm, RMSNorm)):
            m.use_fused(True)
    return fused


@pytest.mark.parametrize("name", ["vit", "swin"])
def test_fused_blocks_hand_their_branch_on_and_keep_every_gradient(name):
    torch.manual_seed(0)
    model = load_workload(name, "tiny").build_model()
    for n, p in model.named_parameters():  # biases away from their zero init
        if n.endswith("bias"):
            torch.nn.init.normal_(p, std=0.1)
    fused = _fused(model)
    seen = []
    blocks = [b for b in fused.modules() if hasattr(b, "mlp") and hasattr(b, "norm1")]
    for b in blocks:
        b.register_forward_hook(lambda m, args, out: seen.append((args[1] is not None, args[2],
                                                                  out[1] is not None)))
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    labels = torch.tensor([1, 7])
    want_loss, want = _loss_and_grads(model, images, labels)
    got_loss, got = _loss_and_grads(fused, images, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    for n, g in got.items():
        torch.testing.assert_close(g, want[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    # every block but the last of its sequence handed its MLP branch on, and the next took it
    assert [s[0] for s in seen] == [False] + [s[2] for s in seen[:-1]]
    assert any(s[2] for s in seen) and not seen[-1][2]
    assert all(s[1] == s[2] for s in seen)


def test_only_fused_unsharded_blocks_hand_their_branch_on():
    """Blocks hand their MLP branch on where their norms are fused, they are not sharded and
    their projections are plain layers."""
    from torch.distributed.fsdp import FSDPModule

    calls = []

    from types import SimpleNamespace

    class Block(torch.nn.Module):
        norm2 = LayerNorm(2)
        norm2.fused = True
        attn = SimpleNamespace(proj=torch.nn.Linear(2, 2))
        mlp = SimpleNamespace(fc2=torch.nn.Linear(2, 2))

        def forward(self, x, branch, hand_on):
            calls.append(hand_on)
            return x + 1, None

    x = torch.zeros(2)
    assert torch.equal(run_blocks([Block(), Block(), Block()], x), x + 3)
    assert calls == [True, True, False]
    calls.clear()
    Block.norm2.fused = False  # plain norms: nothing to hand on
    run_blocks([Block(), Block()], x)
    assert calls == [False, False]
    Block.norm2.fused = True
    calls.clear()
    sharded = [Block(), Block()]
    for b in sharded:  # what fully_shard does to a module: its class becomes an FSDPModule
        b.__class__ = type("FSDPBlock", (FSDPModule, Block), {})
    run_blocks(sharded, x)
    assert calls == [False, False]
    calls.clear()
    wrapped = Block()  # a layer another library wrapped: its bias is not the norm's to add
    wrapped.mlp = SimpleNamespace(fc2=torch.nn.Sequential(torch.nn.Linear(2, 2)))
    run_blocks([wrapped, Block(), Block()], x)
    assert calls == [False, True, False]


def test_layers_whose_bias_a_kernel_adds_keep_their_float8_matmul(monkeypatch):
    # fc1 (bias + GELU kernel), fc2 and the attention projection (biases in the norms) run
    # their matmul without the bias; where fp8 made them Float8Linear that matmul stays float8
    from fasttrain.kernels import fp8_linear as fp8
    from fasttrain.layers.linear import Float8Linear
    from fasttrain.layers.mlp import Mlp

    model = load_workload("vit", "tiny").build_model()
    linears = [m for blk in model.blocks for m in blk.modules() if type(m) is torch.nn.Linear]
    for m in linears:
        m.__class__ = Float8Linear
    fused = _fused(model)
    for m in fused.modules():
        if isinstance(m, Mlp):
            m.use_fused(True)
    calls = []
    real = fp8.fp8_linear
    monkeypatch.setattr(fp8, "fp8_linear", lambda x, w, b=None: calls.append(b) or real(x, w, b))
    fused(torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8), torch.tensor([1, 7]))
    assert len(calls) == len(linears)  # qkv, proj, fc1, fc2 of each block
    assert sum(b is None for b in calls) == 5  # block 1: proj, fc1, fc2; block 2: proj, fc1


def test_sd_transformer_with_fused_norms_computes_the_plain_block():
    """SD's transformer block: norm2 and norm3 take the residual add and the attention output
    projection's bias (left out of its matmul), and every gradient matches the plain block."""
    from fasttrain.layers.unet import SpatialTransformer

    torch.manual_seed(0)
    plain = SpatialTransformer(32, 2, 16)
    for n, p in plain.named_parameters():  # biases away from their zero init
        if n.endswith("bias"):
            torch.nn.init.normal_(p, std=0.1)
    fused = _fused(plain)
    block = fused.transformer_blocks[0]
    assert block.fp32_params() == [block.attn1.to_out[0].bias, block.attn2.to_out[0].bias]
    assert plain.transformer_blocks[0].fp32_params() == []
    x = torch.randn(2, 32, 3, 5)
    ctx = torch.randn(2, 4, 16)
    outs = []
    for model in (plain, fused):
        model.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = model(xi, ctx)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    (y0, dx0, g0), (y1, dx1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx1, dx0, rtol=1e-4, atol=1e-5)
    for n, g in g1.items():
        torch.testing.assert_close(g, g0[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


def test_llama_with_fused_rms_norms_hands_each_branch_on_and_keeps_every_gradient():
    torch.manual_seed(0)
    model = load_workload("llama", "tiny").build_model()
    for n, p in model.named_parameters():  # norm weights away from their init of ones
        if "norm" in n:
            torch.nn.init.normal_(p, mean=1.0, std=0.1)
    fused = _fused(model)
    seen = []
    for b in fused.layers:
        b.register_forward_hook(lambda m, args, out: seen.append((args[3] is not None,
                                                                  out[1] is not None)))
    ids = torch.randint(0, model.cfg.vocab, (2, 16))
    labels = torch.randint(0, model.cfg.vocab, (2, 16))
    want_loss, want = _loss_and_grads(model, ids, labels)
    got_loss, got = _loss_and_grads(fused, ids, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    for n, g in got.items():
        torch.testing.assert_close(g, want[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    # every block hands its MLP branch on; every block but the first takes one
    assert seen == [(False, True)] + [(True, True)] * (len(seen) - 1)
