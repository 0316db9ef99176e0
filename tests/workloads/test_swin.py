"""Swin workload: trains, shapes/FLOPs of Swin-B match timm, shifted-window masking is right."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from fasttrain.errors import FasttrainError
from fasttrain.workloads import load_workload
from fasttrain.workloads.swin import CONFIGS, Swin, SwinBlock
from fasttrain.layers.windows import cyclic_shift, shift_mask, window_partition, window_reverse


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path))


def test_tiny_trains_and_grads_reach_every_parameter():
    wl = load_workload("swin", "tiny")
    torch.manual_seed(0)
    model = wl.build_model()
    batch = next(iter(DataLoader(wl.dataset(), batch_size=wl.default_batch,
                                 collate_fn=wl.collate)))
    assert batch["images"].shape == (8, 32, 32, 3) and batch["images"].dtype == torch.uint8
    losses = []
    for step in range(5):
        model.zero_grad()
        loss = wl.loss(model, batch)
        loss.backward()
        if step == 0:
            missing = [n for n, p in model.named_parameters()
                       if p.grad is None or not p.grad.abs().sum() > 0]
            assert not missing, missing
        with torch.no_grad():  # plain SGD: torch.optim's first step imports dynamo (seconds)
            for p in model.parameters():
                p -= 0.05 * p.grad
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(8 * math.log(10), rel=0.1)  # summed, not mean
    assert losses[-1] < losses[0]


def test_same_seed_same_weights():
    wl = load_workload("swin", "tiny")
    states = []
    for _ in range(2):
        torch.manual_seed(3)
        states.append(wl.build_model().state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_window_partition_round_trip():
    x = torch.randn(2, 8, 12, 5)
    win = window_partition(x, 4)  # (2·2·3, 16, 5)
    assert win.shape == (12, 16, 5)
    # window 4 is image 0, window-row 1, window-column 1
    assert torch.equal(win[4], x[0, 4:8, 4:8].reshape(16, 5))
    assert torch.equal(window_reverse(win, 4, 8, 12), x)
    assert torch.equal(cyclic_shift(cyclic_shift(x, 2), -2), x)
    assert torch.equal(cyclic_shift(x, 2)[:, 0, 0], x[:, 2, 2])


def test_shift_mask_hand_count():
    # 8x8 map, window 4, shift 2: the top-left window is one region (16² pairs allowed), the
    # top-right and bottom-left windows hold two regions of 8 tokens (2·8²), the bottom-right
    # window four regions of 4 tokens (4·4²).
    mask = shift_mask(8, 4, 2)
    assert mask.shape == (4, 16, 16)
    assert (mask == 0).sum(dim=(1, 2)).tolist() == [256, 128, 128, 64]
    assert set(mask.unique().tolist()) == {0.0, -100.0}
    assert torch.equal(mask, mask.transpose(1, 2))


def _reference_shifted_attention(blk: SwinBlock, x: torch.Tensor) -> torch.Tensor:
    """Per-token loop: each query attends only to keys of its window that were its neighbours
    before the roll (same side of the wrap on both axes); bias index from its definition."""
    B, H, W, C = x.shape
    w, s, heads = blk.attn.window, blk.attn.shift, blk.attn.heads
    xs = cyclic_shift(x, s)
    q, k, v = blk.attn.qkv(xs).view(B, H, W, 3, heads, C // heads).unbind(3)  # (B, H, W, h, D)
    table = blk.attn.relative_position_bias_table  # ((2w-1)², heads)
    out = torch.empty_like(x)
    for b, i, j in itertools.product(range(B), range(H), range(W)):
        rows = range(i // w * w, i // w * w + w)
        cols = range(j // w * w, j // w * w + w)
        keys = [(ki, kj) for ki in rows for kj in cols
                if (ki >= H - s) == (i >= H - s) and (kj >= W - s) == (j >= W - s)]
        kk = torch.stack([k[b, ki, kj] for ki, kj in keys])  # (K, h, D)
        vv = torch.stack([v[b, ki, kj] for ki, kj in keys])
        rel = torch.stack([table[(i - ki + w - 1) * (2 * w - 1) + (j - kj + w - 1)]
                           for ki, kj in keys])  # (K, h)
        logits = (kk * q[b, i, j]).sum(-1) / math.sqrt(C // heads) + rel
        o = (logits.softmax(0).unsqueeze(-1) * vv).sum(0)  # (h, D)
        out[b, (i + s) % H, (j + s) % W] = blk.attn.proj(o.reshape(C))
    return out


def test_shifted_window_attention_matches_per_region_reference():
    torch.manual_seed(0)
    blk = SwinBlock(dim=8, heads=2, res=8, window=4, shift=2, mlp_ratio=4)
    torch.nn.init.normal_(blk.attn.relative_position_bias_table, std=1.0)  # make it matter
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        got = blk.attn(x, blk.attn_mask)
        want = _reference_shifted_attention(blk, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_base_matches_timm_swin_base_patch4_window7_224():
    with torch.device("meta"):
        model = Swin(CONFIGS["base"])
        images = torch.zeros(1, 224, 224, 3, dtype=torch.uint8)
        labels = torch.zeros(1, dtype=torch.long)
        counter = FlopCounterMode(display=False)
        with counter:
            model(images, labels)
    assert sum(p.numel() for p in model.parameters()) == 87_768_224
    # 15.43 GMACs forward (timm/paper's "15.4 GFLOPs"); FlopCounterMode counts 2 per MAC
    assert counter.get_total_flops() == pytest.approx(30.86e9, rel=0.005)
    shifts = [[blk.attn.shift for blk in stage.blocks] for stage in model.stages]
    assert shifts[:3] == [[0, 3] * (d // 2) for d in (2, 2, 18)]
    assert shifts[3] == [0, 0]  # 7x7 map, one window: no shift, no mask
    assert model.stages[3].blocks[1].attn_mask is None


def test_registry_sizes_and_variant():
    wl = load_workload("swin", "tiny")
    assert (wl.name, wl.unit, wl.conv, wl.default_batch) == ("swin", "img", True, 8)
    assert load_workload("swin", "base").default_batch == 64
    assert load_workload("swin", "large").cfg.dim == 192
    swin_t = load_workload("swin", "base", variant="t")
    assert (swin_t.cfg.dim, swin_t.cfg.depths) == (96, (2, 2, 6, 2))
    assert swin_t.describe()["variant"] == "t"
    with pytest.raises(FasttrainError):
        load_workload("swin", "base", variant="xl")


def test_regional_blocks_are_the_swin_blocks():
    wl = load_workload("swin", "tiny")
    blocks = wl.regional_blocks(wl.build_model())
    assert len(blocks) == sum(CONFIGS["tiny"].depths)
    assert all(isinstance(b, SwinBlock) for b in blocks)


def test_attention_bias_reaches_sdpa_with_a_unit_last_stride(monkeypatch):
    """The fused SDPA kernels take a mask whose last dim is contiguous; a permuted bias view
    made every unshifted window block fall back to math attention on the H200."""
    import torch.nn.functional as F

    from fasttrain.workloads import load_workload

    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask.stride(-1))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    wl = load_workload("swin", "tiny")
    model = wl.build_model()
    batch = wl.collate([wl.dataset()[i] for i in range(2)])
    model(**batch)
    assert seen and all(s == 1 for s in seen)


def test_patch_embedding_as_a_gemm_equals_the_convolution():
    from fasttrain.layers.patch import PatchEmbed

    torch.manual_seed(0)
    embed = PatchEmbed(3, 32, 4)
    x = torch.randn(2, 3, 16, 12)
    conv = embed.tokens(x)
    assert embed.use_fused(True) == ["4x4 patch embedding as one GEMM"]
    gemm = embed.tokens(x)
    assert gemm.shape == (2, 4, 3, 32)
    torch.testing.assert_close(gemm, conv, rtol=1e-5, atol=1e-5)
    conv.sum().backward()
    w_conv = embed.weight.grad.clone()
    embed.weight.grad = None
    embed.tokens(x).sum().backward()
    torch.testing.assert_close(embed.weight.grad, w_conv, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not tile by 4x4"):
        embed.tokens(torch.randn(1, 3, 10, 8))
