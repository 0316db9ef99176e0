"""SD workload: the tiny step trains only the UNet, the data is deterministic, and the base
shapes have the parameter counts of diffusers' SD v1 UNet / AutoencoderKL encoder and
transformers' CLIP ViT-L/14 text model."""
from __future__ import annotations

import json
import math

import pytest
import torch

from fasttrain.workloads import load_workload
from fasttrain.workloads.data import write_synthetic_images
from fasttrain.workloads.sd import (CONFIGS, SDImages, SDTrainStep, SDWorkload,
                                    ddpm_alphas_cumprod, make)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path))


@pytest.fixture(autouse=True)
def _one_thread():
    # The tiny model is too small for intra-op threads; on a loaded CPU they cost 10-100×.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batch(wl, indices=(0, 1)):
    ds = wl.dataset()
    return wl.collate([ds[i] for i in indices])


def test_tiny_step_trains_the_unet_only():
    wl = make("tiny")
    torch.manual_seed(0)
    model = wl.build_model()
    batch = _batch(wl)
    assert set(batch) == {"images", "input_ids", "noise", "timesteps", "posterior_noise"}
    assert batch["noise"].shape == (2, 4, 4, 4) and wl.count(batch) == 2
    assert wl.trainable(model) is model.unet
    opt = torch.optim.Adam(wl.trainable(model).parameters(), lr=1e-3)
    losses = []
    for step in range(4):
        opt.zero_grad()
        loss = wl.loss(model, batch)
        loss.backward()
        if step == 0:
            no_grad = [n for n, p in model.unet.named_parameters()
                       if p.grad is None or not p.grad.abs().sum() > 0]
            assert not no_grad, no_grad
            for frozen in (model.vae_encoder, model.text_encoder):
                assert all(not p.requires_grad and p.grad is None for p in frozen.parameters())
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert 2 * 0.5 < losses[0] < 2 * 4  # summed per-image MSE against unit-variance noise
    assert losses[-1] < losses[0]


def test_loss_is_summed_per_image_mean():
    wl = make("tiny")
    torch.manual_seed(0)
    model = wl.build_model()
    batch = _batch(wl)
    one = [wl.loss(model, {k: v[i:i + 1] for k, v in batch.items()}) for i in range(2)]
    torch.testing.assert_close(wl.loss(model, batch), one[0] + one[1], rtol=1e-4, atol=1e-5)


def test_dataset_is_deterministic_per_seed_epoch_index():
    wl = make("tiny")
    ds = wl.dataset()
    a, b = ds[3], ds[3]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["input_ids"].shape == (77,) and a["input_ids"].dtype == torch.long
    text = CONFIGS["tiny"].text
    ids = a["input_ids"].tolist()
    assert ids[0] == text.bos and ids[-1] == text.eos and max(ids) < text.vocab
    assert 0 <= int(a["timesteps"]) < 1000
    ds.set_epoch(1)
    c = ds[3]
    assert not torch.equal(a["noise"], c["noise"])
    assert not torch.equal(a["posterior_noise"], c["posterior_noise"])
    assert not torch.equal(a["input_ids"], c["input_ids"])


def test_captions_json_is_used(tmp_path):
    folder = write_synthetic_images(tmp_path / "imgs", 3, 40, 1, seed=0)
    files = sorted(p.name for p in folder.glob("*.jpg"))
    captions = {f: [998, 5, i, 999] for i, f in enumerate(files)}
    (folder / "captions.json").write_text(json.dumps(captions))
    ds = SDImages(folder, CONFIGS["tiny"])
    item = ds[2]
    assert item["input_ids"][:5].tolist() == [998, 5, 2, 999, 999]
    assert item["images"].shape == (32, 32, 3)


def test_base_parameter_counts_match_sd_v1():
    with torch.device("meta"):
        model = SDTrainStep(CONFIGS["base"])
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(model.unet) == 859_520_964  # diffusers UNet2DConditionModel, SD v1
    # CLIPTextModel ViT-L/14: 49408·768 + 77·768 + 12·7,087,872 + 2·768
    assert count(model.text_encoder) == 123_060_480
    assert count(model.vae_encoder) == 34_163_592 + 72  # AutoencoderKL.encoder + quant_conv
    assert CONFIGS["base"].latent == 64


def test_schedule_stays_float32_when_the_model_is_cast():
    torch.manual_seed(0)
    model = SDTrainStep(CONFIGS["tiny"]).to(torch.bfloat16)
    acp = model.schedule.alphas_cumprod
    assert acp.dtype == torch.float32
    torch.testing.assert_close(acp, ddpm_alphas_cumprod(CONFIGS["tiny"]))
    assert acp[0].item() == pytest.approx(1 - 0.00085, rel=1e-6)
    assert acp[-1].item() == pytest.approx(0.0047, abs=2e-4)  # SD v1's ᾱ_999


def test_channels_last_gives_the_same_loss():
    wl = make("tiny")
    torch.manual_seed(0)
    model = wl.build_model()
    batch = _batch(wl)
    ref = wl.loss(model, batch)
    model.channels_last = True
    model.to(memory_format=torch.channels_last)
    torch.testing.assert_close(wl.loss(model, batch), ref, rtol=1e-4, atol=1e-5)


def test_registry():
    wl = load_workload("sd", "tiny")
    assert isinstance(wl, SDWorkload)
    assert (wl.name, wl.unit, wl.conv, wl.has_ema, wl.default_batch) == ("sd", "img", True, True, 2)
    assert load_workload("sd", "base").default_batch == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_attention_matches_sdpa(dtype):
    """The wide-head path (the VAE's one head of 512): two GEMMs around an fp32 softmax."""
    from fasttrain.layers.attention import gemm_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1, 70, 512, dtype=dtype) for _ in range(3))
    k = k[:, :, :45]
    v = v[:, :, :45]
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    out = gemm_attention(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_wide_heads_take_the_gemm_path_only_for_frozen_16_bit_gpu_inputs():
    """The GEMM path is for frozen encoders on a GPU (fake CUDA tensors here): not with autograd,
    not on the CPU, not for heads SDPA's fused kernels take, not past the scores' memory cap."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fasttrain.layers.attention import SCORES_MAX_BYTES, _wide_inference

    def qkv(d=512, t=64, device="cuda", dtype=torch.bfloat16):
        return [torch.empty(2, 1, t, d, device=device, dtype=dtype) for _ in range(3)]

    with FakeTensorMode():
        assert _wide_inference(*qkv())
        with torch.no_grad():
            q, k, v = qkv()
            assert _wide_inference(q.requires_grad_(), k, v)
        q, k, v = qkv()
        assert not _wide_inference(q.requires_grad_(), k, v)  # autograd: SDPA
        assert not _wide_inference(*qkv(d=256))
        assert not _wide_inference(*qkv(device="cpu"))
        assert not _wide_inference(*qkv(dtype=torch.float32))
        t = int((SCORES_MAX_BYTES // 8) ** 0.5) + 1  # 2 × t × t × 4 bytes over the cap
        assert not _wide_inference(*qkv(t=t))
        three_d = [torch.empty(2, 64, 512, device="cuda", dtype=torch.bfloat16)] * 3
        assert not _wide_inference(*three_d)  # not (B, heads, T, D)


def test_flop_counter_counts_bmm_with_an_output_dtype():
    """The GEMM attention's fp32-output bmm is counted (torch's own formula raises on it)."""
    from fasttrain.measure.flops import flop_counter

    a = torch.empty(2, 5, 8, dtype=torch.bfloat16, device="meta")
    b = torch.empty(2, 8, 6, dtype=torch.bfloat16, device="meta")
    counter = flop_counter()
    with counter:
        torch.bmm(a, b, out_dtype=torch.float32)
        torch.bmm(a, b)
    assert counter.get_total_flops() == 2 * (2 * 2 * 5 * 8 * 6)


def test_regional_blocks_are_the_whole_vae_encoder_then_the_repeated_blocks():
    wl = make("tiny")
    model = wl.build_model()
    blocks = wl.regional_blocks(model)
    assert blocks[0] is model.vae_encoder
    inside = set(model.vae_encoder.modules())
    assert not any(b in inside for b in blocks[1:])
    assert set(blocks[1:]) >= set(model.text_encoder.layers) | set(model.unet.down_blocks)


@pytest.mark.parametrize("context", [None, 12])
def test_stacked_projections_compute_the_separate_ones(monkeypatch, context):
    """q, k, v (or the text's k, v) from one GEMM over stacked weights: the same outputs and
    gradients as one GEMM each, and a layer another technique replaced keeps its own call."""
    from fasttrain.layers.sd_transformer import Attention

    torch.manual_seed(0)
    attn = Attention(16, 2, context)
    x = torch.randn(2, 5, 16)
    ctx = None if context is None else torch.randn(2, 3, context)

    def run(stacked):
        monkeypatch.setattr(Attention, "stacked", stacked)
        attn.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = attn(xi, ctx)
        (y * y).sum().backward()
        return y.detach(), xi.grad, [p.grad.clone() for p in attn.parameters()]

    want, got = run(False), run(True)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w)

    calls = []

    class Replaced(torch.nn.Linear):  # what fp8's layer swap leaves: a subclass with its own matmul
        def forward(self, inp):
            calls.append(self)
            return super().forward(inp)

    swapped = Replaced(attn.to_k.in_features, 16, bias=False)
    swapped.load_state_dict(attn.to_k.state_dict())
    attn.to_k = swapped
    torch.testing.assert_close(run(True)[0], want[0])
    assert calls == [swapped]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
def test_upsample_sums_the_gradient_of_each_2x2_block(channels_last):
    """The UNet's nearest 2× upsampling: interpolate's values forward, each 2 × 2 block of the
    gradient summed backward (interpolate's backward, as a reduction), eager and compiled, in
    the input's memory format."""
    import torch.nn.functional as F

    from fasttrain.layers.unet import upsample_nearest2x

    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 4)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    want_x = x.clone().requires_grad_(True)
    want = F.interpolate(want_x, scale_factor=2.0, mode="nearest")
    dy = torch.randn(2, 3, 10, 8)
    want.backward(dy)
    for fn in (upsample_nearest2x, torch.compile(upsample_nearest2x, fullgraph=True)):
        for g in (dy, dy.contiguous(memory_format=torch.channels_last)):
            xi = x.clone().requires_grad_(True)
            y = fn(xi)
            y.backward(g)
            torch.testing.assert_close(y, want, rtol=0, atol=0)
            torch.testing.assert_close(xi.grad, want_x.grad, rtol=1e-6, atol=1e-6)
            assert y.is_contiguous(memory_format=torch.channels_last) == channels_last
            # the gradient in x's layout, so the convolution before it need not copy it
            assert xi.grad.is_contiguous(memory_format=torch.channels_last) == channels_last


@pytest.mark.parametrize("formats", [(True, True), (True, False), (False, False)])
def test_skip_concatenation_hands_back_dense_gradients(formats):
    """The up blocks' concatenation with a skip connection: torch.cat's values both ways, and
    each input's gradient dense in that input's memory format (not a channel slice of the
    concatenation's gradient), eager and compiled."""
    from fasttrain.layers.unet import cat_channels

    torch.manual_seed(0)
    fmt = {True: torch.channels_last, False: torch.contiguous_format}
    a = torch.randn(2, 3, 4, 5).contiguous(memory_format=fmt[formats[0]])
    b = torch.randn(2, 6, 4, 5).contiguous(memory_format=fmt[formats[1]])
    dy = torch.randn(2, 9, 4, 5).contiguous(memory_format=torch.channels_last)
    for fn in (cat_channels, torch.compile(cat_channels, fullgraph=True)):
        ai, bi = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        y = fn(ai, bi)
        torch.testing.assert_close(y, torch.cat([a, b], dim=1), rtol=0, atol=0)
        y.backward(dy)
        torch.testing.assert_close(ai.grad, dy[:, :3], rtol=0, atol=0)
        torch.testing.assert_close(bi.grad, dy[:, 3:], rtol=0, atol=0)
        for grad, cl in zip((ai.grad, bi.grad), formats):
            assert grad.is_contiguous(memory_format=fmt[cl])


def test_unet_runs_the_time_and_text_projections_as_one_gemm_each(monkeypatch):
    """The time embedding's projections of every ResNet block, and the text's keys and values of
    every cross-attention, from one GEMM each: the same loss and gradients as the blocks' own
    projections, and none of those layers is called on its own; a layer another technique
    replaced sends its kind back to the blocks."""
    from fasttrain.layers.sd_transformer import Attention
    from fasttrain.workloads.sd_unet import UNet

    wl = make("tiny")
    torch.manual_seed(0)
    model = wl.build_model()
    unet = model.unet
    batch = _batch(wl)
    times = [m for name, m in unet.named_modules() if name.endswith("time_emb_proj")]
    texts = [m for name, m in unet.named_modules() if name.endswith(("attn2.to_k", "attn2.to_v"))]
    assert len(times) > 6 and len(texts) > 6
    called = []
    for m in times + texts:
        m.register_forward_hook(lambda mod, args, out: called.append(mod))

    def run(stacked):
        monkeypatch.setattr(UNet, "stacked", stacked)
        monkeypatch.setattr(Attention, "stacked", stacked)  # off: each of k and v calls its layer
        unet.zero_grad()
        called.clear()
        loss = wl.loss(model, batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in unet.parameters()]

    want = run(False)
    assert len(called) == len(times) + len(texts)
    got = run(True)
    assert called == []
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)

    class Replaced(torch.nn.Linear):  # what fp8's layer swap leaves: a subclass
        pass

    first = unet.down_blocks[0].resnets[0]
    swapped = Replaced(first.time_emb_proj.in_features, first.time_emb_proj.out_features)
    swapped.load_state_dict(first.time_emb_proj.state_dict())
    swapped.register_forward_hook(lambda mod, args, out: called.append(mod))
    first.time_emb_proj = swapped
    loss = run(True)[0]
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-6)
    assert set(called) == {swapped, *times[1:]}  # the time projections back in the blocks


@pytest.mark.gpu
def test_sd_up_block_backward_hands_dense_gradients_to_its_convolutions():
    """An SD up block (ResNets on [x, skip], then the 2× upsampler) as the SD presets run it:
    channels-last, bf16 autocast, the GroupNorm kernels, compiled. In its backward no
    convolution copies its incoming gradient (a channel slice of the concatenation's gradient,
    or the upsampler's NCHW sum, used to be copied to dense NHWC inside
    ``convolution_backward``), and the gradients of x and the skips come out dense NHWC, so
    the blocks that made them need not copy them either. (Inductor's own GroupNorm backward
    hands the convolutions NCHW gradients: with the plain norms they still copy.)"""
    from torch.profiler import ProfilerActivity, profile

    from fasttrain.workloads.sd_unet import UNetConfig, UpBlock

    torch.manual_seed(0)
    cfg = UNetConfig(channels=(64, 64), cross_attn=(False, False), layers=2)
    blk = UpBlock(64, 64, 64, cfg, 128, attn=False, up=True).cuda()
    for m in blk.modules():
        if getattr(m, "fused_kind", None) == "groupnorm":
            m.use_fused(True)
    # static shapes, as the compile technique compiles: in one process with the other GPU tests,
    # ResnetBlock.forward has been compiled at other shapes already, and dynamo's automatic
    # dynamic shapes would trace this block symbolically (which the realized prim cannot lower)
    torch._dynamo.reset()
    blk = torch.compile(blk.to(memory_format=torch.channels_last), fullgraph=True, dynamic=False)

    def nhwc(*shape):
        return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
                .contiguous(memory_format=torch.channels_last).requires_grad_(True))

    x, skips, temb = nhwc(2, 64, 16, 16), [nhwc(2, 64, 16, 16) for _ in range(3)], \
        torch.randn(2, 128, device="cuda")
    dy = torch.randn(2, 64, 32, 32, device="cuda", dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    try:
        for _ in range(2):  # compile, then the measured pass
            for t in (x, *skips):
                t.grad = None
            with torch.autocast("cuda", torch.bfloat16), \
                    profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                blk(x, tuple(skips), temb, None).backward(dy)
                torch.cuda.synchronize()
    finally:  # UpBlock.forward's compiled code would count as recompiles in later SD runs
        torch._dynamo.reset()
    copies = []
    for e in prof.events():
        p, inside = e.cpu_parent, False
        while p is not None and not inside:
            inside, p = p.name == "aten::convolution_backward", p.cpu_parent
        if inside and e.name in ("aten::clone", "aten::_to_copy"):
            copies.append(e.name)
    assert not copies, f"convolution_backward copied its gradient: {copies}"
    for t in (x, *skips):
        assert t.grad.is_contiguous(memory_format=torch.channels_last), t.grad.stride()


@pytest.mark.gpu
def test_wide_head_attention_on_cuda_takes_the_gemm_path_and_matches_sdpa(monkeypatch):
    """One head of 512 (the SD VAE's mid-block) without autograd: the GEMM path runs, eager
    and compiled, within bf16 rounding of an fp32 SDPA; with autograd, SDPA runs."""
    from fasttrain.layers import attention as attn

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1, 1024, 512, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    calls = []
    gemm = attn.gemm_attention
    monkeypatch.setattr(attn, "gemm_attention", lambda *a: calls.append(1) or gemm(*a))
    with torch.no_grad():
        for fn in (attn.attention, torch.compile(attn.attention)):
            torch.testing.assert_close(fn(q, k, v).float(), ref, atol=2e-2, rtol=2e-2)
    assert len(calls) == 2
    attn.attention(q.requires_grad_(), k, v).float().sum().backward()
    assert len(calls) == 2 and q.grad is not None

