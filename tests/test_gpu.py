"""CUDA-only checks (marker ``gpu``; skipped without a GPU). Run on the H200 with
``python3 -m pytest -q -m gpu``."""
import pytest
import torch

from fasttrain.recipe import Recipe
from fasttrain.run.loop import train
from fasttrain.techniques.ema import Ema
from fasttrain.workloads import load_workload

pytestmark = pytest.mark.gpu


def test_side_stream_ema_equals_plain_ema_under_a_busy_main_stream():
    torch.manual_seed(0)
    params = [torch.randn(1024, 1024, device="cuda") for _ in range(8)]
    plain = Ema(params, 0.99, "per-tensor")
    side = Ema(params, 0.99, "side-stream")
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(5):
        side.before_optimizer()  # the "optimizer" may write only after the EMA has read
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p))
        plain.update()
        side.update()
        for _ in range(3):  # keep the main stream busy while the side stream runs
            big = big @ big / 4096
    side.synchronize()
    torch.cuda.synchronize()
    for a, b in zip(plain.shadow, side.shadow):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cuda_graph_step_matches_eager_losses():
    wl = load_workload("vit", "tiny")
    base = Recipe(precision="bf16-mixed", optimizer_impl="fused", attention="auto")
    eager = train(wl, base, steps=6, warmup=4, device="cuda")
    graphed = train(wl, base.replace(cuda_graphs=True, workers=1, pin_memory=True,
                                     device_prefetch=True), steps=6, warmup=4, device="cuda")
    assert "into two device buffers used in turn" in graphed.applied["dataloader"]
    assert not [w for w in graphed.warnings if "prefetch" in w]
    torch.testing.assert_close(torch.tensor(graphed.losses), torch.tensor(eager.losses),
                               rtol=2e-3, atol=0)
    assert "graph" in graphed.phases_s


def test_flash_attention_runs_on_cuda_and_math_is_reported():
    wl = load_workload("llama", "tiny")
    res = train(wl, Recipe(precision="bf16-mixed", attention="flash"), steps=1, warmup=0,
                device="cuda")
    assert "ran flash" in res.applied["attention"] and not res.warnings
    wl = load_workload("swin", "tiny")  # an additive bias: flash cannot take it
    res = train(wl, Recipe(precision="bf16-mixed", attention="flash"), steps=1, warmup=0,
                device="cuda")
    assert "fell back to math" in res.applied["attention"]


def test_fp16_gradscaler_and_peak_memory_on_cuda():
    res = train(load_workload("vit", "tiny"), Recipe(precision="fp16-mixed"), steps=3, warmup=1,
                device="cuda")
    assert res.peak_allocated_gib > 0 and res.peak_reserved_gib >= res.peak_allocated_gib
    assert all(torch.isfinite(torch.tensor(res.losses)))


def test_device_prefetch_gives_the_same_batches():
    wl = load_workload("vit", "tiny")
    base = Recipe(workers=2, pin_memory=True, non_blocking=True, batch=8, accumulation=2)
    plain = train(wl, base, steps=5, warmup=1, device="cuda")
    pre = train(wl, base.replace(device_prefetch=True), steps=5, warmup=1, device="cuda")
    assert "side stream" in pre.applied["dataloader"]
    assert pre.losses == plain.losses


def test_slot_prefetch_hands_out_the_same_batches_as_plain_copies():
    from fasttrain.run.data import HostBatches, SlotPrefetcher, make_loader

    wl, dev = load_workload("vit", "tiny"), torch.device("cuda")
    plain = HostBatches(iter(make_loader(wl, 4, 0, pin_memory=True)), dev, 2, True)
    slots = SlotPrefetcher(iter(make_loader(wl, 4, 0, pin_memory=True)), dev, 2)
    big = torch.randn(2048, 2048, device=dev)
    for _ in range(6):
        want, got = next(plain), next(slots)
        got = [{k: v.clone() for k, v in mb.items()} for mb in got]  # as the graphed step does
        for _ in range(4):  # the main stream busy while the side stream fills the other slot
            big = big @ big / 2048
        for w, g in zip(want, got):
            assert w.keys() == g.keys() and all(torch.equal(w[k], g[k]) for k in w)


def test_profile_on_cuda_has_kernels_memory_and_a_trace(tmp_path):
    from fasttrain.profile.runner import run_profile

    p = run_profile(load_workload("vit", "tiny"), Recipe(), "cuda", steps=3, warmup=2, active=2,
                    trace_dir=tmp_path, snapshot=tmp_path / "snap.pickle")
    k, m = p["kernels"], p["memory"]
    assert k["launches_per_step"] > 10 and abs(sum(k["share"].values()) - 1) < 1e-6
    assert m["peak_allocated_mib"] > 0 and m["device_used_mib"] >= m["peak_reserved_mib"]
    assert (tmp_path / "snap.pickle").exists() and k["trace"]["mb"] < 20
    assert "precision" in {f["rule"] for f in p["findings"]}


def test_memory_growth_rule_catches_a_leak_on_cuda():
    from fasttrain.profile.runner import run_profile
    from tests.helpers import leaky_workload

    p = run_profile(leaky_workload(), Recipe(), "cuda", steps=4, warmup=1, active=1)
    assert p["memory"]["growth_mib_per_step"] > 10
    assert "memory_growth" in {f["rule"] for f in p["findings"]}


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


def _compiled_and_reference(fused, reference, inputs, loss, rel: float = 2e-2):
    """The outputs of ``fn(*inputs)`` and the gradients of ``loss`` of them, for fused compiled
    by inductor (the Triton path the CPU tests cannot run) and for the plain reference, agree
    elementwise to ``rel`` of each tensor's largest magnitude (bf16 rounds differently)."""
    results = []
    torch._dynamo.reset()
    for fn in (torch.compile(fused, fullgraph=True), reference):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*leaves)
        loss(out).backward()
        outs = out if isinstance(out, tuple) else (out,)
        results.append([o.detach().float() for o in outs] +
                       [t.grad.float() for t in leaves if t.requires_grad])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=rel, atol=rel * want.abs().max().item())


def test_window_attention_compiled_on_cuda_matches_the_reference():
    from fasttrain.kernels.window_attention import window_attention, window_attention_reference
    from fasttrain.layers.windows import shift_mask

    torch.manual_seed(0)
    # 16 windows per image, 80 images: more windows than the persistent programs of both
    # kernels, so each walks several (the forward's next windows loaded while it computes)
    qkv = torch.randn(1280, 49, 3 * 128, device="cuda", dtype=torch.bfloat16)
    bias = 0.5 * torch.randn(4, 49, 49, device="cuda")
    mask = shift_mask(28, 7, 3).cuda()
    cot = torch.randn(1280, 49, 128, device="cuda")
    _compiled_and_reference(lambda q, b: window_attention(q, b, mask, 4),
                            lambda q, b: window_attention_reference(q, b, mask, 4), [qkv, bias],
                            lambda out: (out.float() * cot).sum())


def test_map_window_attention_compiled_on_cuda_matches_the_reference():
    from fasttrain.kernels.window_attention import (map_window_attention,
                                                    map_window_attention_reference)
    from fasttrain.layers.windows import shift_mask

    torch.manual_seed(0)
    qkv = torch.randn(4, 28, 28, 3 * 128, device="cuda", dtype=torch.bfloat16)
    bias = 0.5 * torch.randn(4, 49, 49, device="cuda")
    mask = shift_mask(28, 7, 3).cuda()
    cot = torch.randn(4, 28, 28, 128, device="cuda")
    _compiled_and_reference(lambda q, b: map_window_attention(q, b, mask, 4, 7, 3),
                            lambda q, b: map_window_attention_reference(q, b, mask, 4, 7, 3),
                            [qkv, bias], lambda out: (out.float() * cot).sum())


def test_seq_attention_compiled_on_cuda_matches_the_reference():
    from fasttrain.kernels.seq_attention import seq_attention, seq_attention_reference

    torch.manual_seed(0)
    # ViT-B/16's 197 tokens (three blocks of 64 and a partial one) and 12 heads of 64
    qkv = torch.randn(16, 197, 3 * 768, device="cuda", dtype=torch.bfloat16)
    cot = torch.randn(16, 197, 768, device="cuda")
    _compiled_and_reference(lambda q: seq_attention(q, 12),
                            lambda q: seq_attention_reference(q, 12), [qkv],
                            lambda out: (out.float() * cot).sum())
    # the projection with its bias, whose gradient the backward kernels sum
    from fasttrain.kernels.seq_attention import (projected_seq_attention,
                                                 projected_seq_attention_reference)
    x = torch.randn(16, 197, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3 * 768, 768, device="cuda", dtype=torch.bfloat16) / 28
    b = 0.2 * torch.randn(3 * 768, device="cuda", dtype=torch.bfloat16)
    _compiled_and_reference(lambda *a: projected_seq_attention(*a, 12),
                            lambda *a: projected_seq_attention_reference(*a, 12), [x, w, b],
                            lambda out: (out.float() * cot).sum())


def test_activation_and_rope_kernels_compiled_on_cuda_match_the_reference():
    from fasttrain.kernels import activations as act
    from fasttrain.kernels.rope import rope, rope_reference

    torch.manual_seed(0)
    x = torch.randn(300, 1000, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1000, device="cuda")
    for approximate in ("none", "tanh"):
        _compiled_and_reference(lambda x, b: act.bias_gelu(x, b, approximate),
                                lambda x, b: act.bias_gelu_reference(x, b, approximate), [x, b],
                                lambda y: (y.float() * 1.5).square().sum())
    g, u = torch.randn(2, 3, 999, device="cuda", dtype=torch.bfloat16).unbind(0)
    _compiled_and_reference(act.swiglu, act.swiglu_reference, [g, u],
                            lambda y: (y.float() * 1.5).square().sum())
    q = torch.randn(2, 100, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 100, 2, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    ang = torch.rand(100, 32, device="cuda") * 6
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    _compiled_and_reference(
        lambda q, k: rope(q, k, cos, sin), lambda q, k: rope_reference(q, k, cos, sin), [q, k],
        lambda qk: (qk[0].float().square() * 2).sum() + qk[1].float().sum())


def test_exact_gelu_kernels_on_cuda_are_within_a_few_ulp_of_erf():
    """Compiled for the GPU, fp32, z in [-9, 9], against PyTorch's GELU in float64."""
    from fasttrain.kernels import activations as act
    from tests.helpers import check_exact_gelu

    check_exact_gelu(act.bias_gelu, "cuda", 40001)


def test_group_norm_kernel_compiled_on_cuda_matches_the_reference():
    """Channels-last bf16 at UNet and VAE widths (groups of 10, 4 and 40 channels), with and
    without SiLU, compiled by Inductor; an NCHW input; several programs per sample."""
    from fasttrain.kernels.group_norm import group_norm, group_norm_reference

    torch.manual_seed(0)
    for shape, silu in [((4, 320, 24, 24), True), ((2, 128, 96, 80), True),
                        ((4, 1280, 8, 8), False)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
        x = x.contiguous(memory_format=torch.channels_last)
        w, b = torch.randn(shape[1], device="cuda"), torch.randn(shape[1], device="cuda")
        cot = torch.randn(shape, device="cuda")
        _compiled_and_reference(lambda x, w, b: group_norm(x, w, b, 32, 1e-5, silu),
                                lambda x, w, b: group_norm_reference(x, w, b, 32, 1e-5, silu),
                                [x, w, b], lambda y: (y.float() * cot).sum())
    x = torch.randn(2, 64, 33, 17, device="cuda", dtype=torch.bfloat16)
    w, b = torch.ones(64, device="cuda"), torch.zeros(64, device="cuda")
    _compiled_and_reference(lambda x, w, b: group_norm(x, w, b, 32, 1e-6, True),
                            lambda x, w, b: group_norm_reference(x, w, b, 32, 1e-6, True),
                            [x, w, b], lambda y: (y.float() * 1.5).square().sum())
    # more samples than a CUDA grid's second axis holds (65,535)
    x = torch.randn(70_000, 64, device="cuda")
    torch.testing.assert_close(group_norm(x, w, b, 32, 1e-6, True),
                               group_norm_reference(x, w, b, 32, 1e-6, True))


def test_narrow_conv_kernel_on_cuda_matches_cudnn_eager_and_compiled():
    """SD's VAE input convolution (3 → 128, 3 × 3, padding 1) and a masked case (4 → 20
    channels, odd sides, 1 × 3, tail tiles), bf16 and fp32, channels-last and NCHW inputs,
    eagerly and compiled (no graph break): within a rounding of cuDNN's output."""
    from fasttrain.kernels.narrow_conv import narrow_conv2d

    torch.manual_seed(0)
    for (n, c, h, w, o, k, pad) in [(2, 3, 96, 80, 128, (3, 3), (1, 1)),
                                    (3, 4, 17, 29, 20, (1, 3), (0, 1))]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
            weight = torch.randn(o, c, *k, device="cuda", dtype=dtype) / 3
            bias = torch.randn(o, device="cuda", dtype=dtype)
            want = torch.nn.functional.conv2d(x.double(), weight.double(), bias.double(),
                                              padding=pad)
            tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else \
                dict(rtol=1e-5, atol=1e-5)
            torch._dynamo.reset()
            compiled = torch.compile(lambda x: narrow_conv2d(x, weight, bias, pad) * 2,
                                     fullgraph=True)
            for fmt in (torch.channels_last, torch.contiguous_format):
                xf = x.contiguous(memory_format=fmt)
                got = narrow_conv2d(xf, weight, bias, pad)
                assert got.is_contiguous(memory_format=torch.channels_last)
                torch.testing.assert_close(got.double(), want, **tol)
                torch.testing.assert_close(compiled(xf).double(), 2 * want, **tol)
    torch._dynamo.reset()


def test_sd_narrow_conv_kernel_in_the_graphed_training_loop_keeps_the_losses():
    _kernels_keep_the_losses("sd", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                          compile="regional", channels_last=True,
                                          cuda_graphs=True, kernels="groupnorm"),
                             ("groupnorm,conv",), "convolution in one Triton pass (frozen")


def _kernels_over(code: list[str], numel: int) -> list[str]:
    """The Triton kernels in Inductor's generated ``code`` whose elementwise loop covers
    ``numel`` elements."""
    import re

    return [k for k in re.split(r"@triton\.jit", "\n".join(code))
            if re.search(rf"xnumel = {numel}\b", k)]


def test_group_norm_of_a_bias_add_is_written_once_by_inductor():
    """GroupNorm of a convolution's output + bias (the VAE's and UNet's ResNet blocks): the
    sum is a value Inductor has not written yet, and the kernels take it three times (the
    reduction, the elementwise pass, the first position's values). Inductor must write it once;
    handed views of it, it wrote one copy per kernel argument (four stores in one kernel)."""
    from torch._inductor.utils import run_and_get_code

    from fasttrain.kernels.group_norm import group_norm, group_norm_reference

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(32, 64, 3, padding=1).cuda().to(torch.bfloat16)
    conv = conv.to(memory_format=torch.channels_last)
    w, b = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")

    def block(x):
        return group_norm(conv(x), w, b, 32, 1e-6, True)

    x = torch.randn(2, 32, 32, 32, device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        y, code = run_and_get_code(torch.compile(block, fullgraph=True), x)
        ref = group_norm_reference(conv(x), w, b, 32, 1e-6, True)
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)
    full = _kernels_over(code, y.numel())  # the convolution's output; x has half as many
    assert len(full) == 1, f"{len(full)} elementwise kernels over the convolution's output"
    assert full[0].count("tl.store(") == 1


def test_frozen_resnet_block_with_group_norm_kernels_writes_its_input_once():
    """A VAE ResNet block (frozen, bf16, channels-last) with the GroupNorm kernels, compiled,
    its input a sum Inductor has not written yet (a previous block's output): the sum is
    written once, and the block's output kernel reads it back (with conv2's output and bias)
    rather than recomputing it from its two terms; conv1's bias goes into norm2's kernels, so
    no kernel writes conv1 + bias. Two elementwise kernels over the block's size in all."""
    import re

    from torch._inductor.utils import run_and_get_code

    from fasttrain.workloads.sd_unet import ResnetBlock

    torch.manual_seed(0)
    blk = ResnetBlock(64, 64, None, 1e-6).cuda().to(torch.bfloat16).requires_grad_(False)
    blk = blk.to(memory_format=torch.channels_last)
    a, b = (torch.randn(2, 64, 32, 32, device="cuda", dtype=torch.bfloat16)
            .contiguous(memory_format=torch.channels_last) for _ in range(2))
    with torch.no_grad():
        ref = blk(a + b)
        for m in (blk.norm1, blk.norm2):
            m.use_fused(True)
        y, code = run_and_get_code(torch.compile(lambda s, t: blk(s + t), fullgraph=True), a, b)
    torch.testing.assert_close(y.float(), ref.float(), atol=3e-2, rtol=3e-2)
    full = _kernels_over(code, y.numel())
    heads = [re.search(r"def \w+\([^)]*\)", k).group(0) for k in full]
    assert len(full) == 2, f"elementwise kernels over the block's size: {heads}"
    assert all(k.count("tl.store(") == 1 for k in full), heads
    # inputs, counting a buffer Inductor writes over (conv2's output, in_out_ptr)
    inputs = sorted(len(set(re.findall(r"\bin_(?:out_)?ptr\d+\b", h))) for h in heads)
    assert inputs == [2, 3], f"{heads}: want the sum's two terms, then the output's sum, conv2 "\
        "and its bias"


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
    blk = torch.compile(blk.to(memory_format=torch.channels_last), fullgraph=True)

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


def test_pipelined_loops_over_many_tiles_per_program_match_the_reference():
    """The persistent loops with software-pipelined loads (the interpreter ignores num_stages,
    so only a GPU runs them), at shapes where each program walks many tiles: bias + GELU's
    backward (dx and the bias gradient), GEGLU's (dx and the bias gradient) and GroupNorm's
    reduction pass."""
    from fasttrain.kernels import activations as act
    from fasttrain.kernels import group_norm as gn

    torch.manual_seed(0)
    x = torch.randn(20_000, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, device="cuda")
    block_r, block_d = act._tile(512, act.LAUNCH["bwd_elements"], act.LAUNCH["bwd_block_d"])
    per = act._grid_persistent(x.device, 20_000, 512, block_r, block_d,
                               act.LAUNCH["programs_per_sm"])[2]
    assert act.LAUNCH["stages"] > 1 and per >= 4 * block_r  # several tiles a program
    _compiled_and_reference(lambda x, b: act.bias_gelu(x, b), act.bias_gelu_reference, [x, b],
                            lambda y: (y.float() * 1.5).square().sum())
    from fasttrain.kernels import geglu as gg

    x = torch.randn(20_000, 2 * 640, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2 * 640, device="cuda")
    progs, _, per, block_r, _ = gg._geglu_bwd_grid(x.device, 20_000, 640)
    assert gg.GEGLU["stages"] > 1 and per >= 4 * block_r and progs > 1
    _compiled_and_reference(gg.geglu, gg.geglu_reference, [x, b],
                            lambda y: (y.float() * 1.5).square().sum())
    shape = (2, 128, 256, 256)
    x = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 2 + 0.5).contiguous(
        memory_format=torch.channels_last)
    w, bias = torch.randn(128, device="cuda"), torch.randn(128, device="cuda")
    rows_per = gn._blocks(256 * 256, 128, 2, x.device)[3]
    assert gn.LAUNCH["sum_stages"] > 1 and rows_per >= 4 * gn.LAUNCH["sum_rows"]
    cot = torch.randn(shape, device="cuda")
    _compiled_and_reference(lambda x, w, b: gn.group_norm(x, w, b, 32, 1e-5, True),
                            lambda x, w, b: gn.group_norm_reference(x, w, b, 32, 1e-5, True),
                            [x, w, bias], lambda y: (y.float() * cot).sum())


def _kernels_keep_the_losses(workload: str, base: Recipe, kernels: tuple[str, ...],
                             says: str) -> None:
    """Each ``kernels`` setting on top of ``base`` (compiled, bf16 autocast) trains the tiny
    workload with the plain run's losses (bf16 tolerance), says ``says``, warns of nothing."""
    wl = load_workload(workload, "tiny")
    plain = train(wl, base, steps=4, warmup=0, device="cuda")
    for k in kernels:
        fused = train(wl, base.replace(kernels=k), steps=4, warmup=0, device="cuda")
        assert says in fused.applied["kernels"] and not fused.warnings
        torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(plain.losses),
                                   rtol=2e-2, atol=0)


def test_sd_group_norm_kernel_in_the_compiled_training_loop_keeps_the_losses():
    _kernels_keep_the_losses("sd", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                          compile="regional", channels_last=True),
                             ("groupnorm", "groupnorm,gelu,layernorm"),
                             "GroupNorm + SiLU in Triton")


def test_swin_window_kernel_in_the_compiled_training_loop_keeps_the_losses():
    _kernels_keep_the_losses("swin", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                            compile="model"),
                             ("window", "window,layernorm"), "window attention")


def test_vit_layer_norm_kernel_in_the_graphed_training_loop_keeps_the_losses():
    _kernels_keep_the_losses("vit", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                           compile="model", cuda_graphs=True),
                             ("layernorm",), "LayerNorm (with the residual add before it) in Triton")


def test_vit_attention_kernel_in_the_graphed_training_loop_keeps_the_losses():
    _kernels_keep_the_losses("vit", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                           compile="model", cuda_graphs=True),
                             ("attention", "attention,layernorm,gelu"),
                             "self-attention from the qkv projection's layout")


def test_llama_rms_norm_kernels_in_the_graphed_training_loop_keep_the_losses():
    _kernels_keep_the_losses("llama", Recipe(precision="bf16-mixed", optimizer_impl="fused",
                                             compile="model", cuda_graphs=True),
                             ("rmsnorm", "rmsnorm,rope"),
                             "RMSNorm (with the residual add before it) in Triton")


@pytest.mark.parametrize("fused_loss", [False, True], ids=["plain-loss", "chunked-loss"])
def test_padded_gemm_widths_in_the_compiled_training_loop_keep_the_losses(fused_loss):
    wl = load_workload("llama", "tiny", vocab=509)
    base = Recipe(precision="bf16-mixed", optimizer_impl="fused", compile="model",
                  kernels="loss" if fused_loss else "none")
    plain = train(wl, base, steps=4, warmup=0, device="cuda")
    padded = train(wl, base.replace(gemm_pad=64), steps=4, warmup=0, device="cuda")
    assert "head_loss vocabulary 509 → 512" in padded.applied["gemm_pad"]
    torch.testing.assert_close(torch.tensor(padded.losses), torch.tensor(plain.losses),
                               rtol=1e-2, atol=0)


@pytest.mark.parametrize("workload", ["vit", "swin", "llama"])
def test_a_bf16_stream_in_the_graphed_training_loop_keeps_the_losses(workload):
    wl = load_workload(workload, "tiny")
    base = Recipe(precision="bf16-mixed", optimizer_impl="fused", compile="model",
                  cuda_graphs=True,
                  kernels={"vit": "layernorm,gelu,attention", "swin": "layernorm,gelu,window",
                           "llama": "rmsnorm,rope"}[workload])
    plain = train(wl, base, steps=4, warmup=4, device="cuda")
    ours = train(wl, base.replace(stream_dtype="bf16"), steps=4, warmup=4, device="cuda")
    assert "in bf16 from the embeddings on" in ours.applied["stream_dtype"]
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(plain.losses),
                               rtol=2e-2, atol=0)


def test_dependent_launch_and_combo_kernels_in_the_graphed_training_loop_keep_the_losses():
    # Inductor's kernels launched with PDL (on Hopper) and grouped into combo kernels, inside
    # the step's CUDA graph: the same losses, each switch said in the compile text
    wl = load_workload("swin", "tiny")
    base = Recipe(precision="bf16-mixed", optimizer_impl="fused", compile="model",
                  cuda_graphs=True, lr=1e-3)
    plain = train(wl, base, steps=4, warmup=2, device="cuda")
    ours = train(wl, base.replace(pdl=True, combo_kernels=True), steps=4, warmup=2,
                 device="cuda")
    applied = ours.applied["compile"]
    assert "combo kernels" in applied and not ours.warnings
    assert ("programmatic dependent launch" in applied) == (
        torch.cuda.get_device_capability()[0] >= 9)
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(plain.losses),
                               rtol=2e-2, atol=0)


def test_one_launch_adamw_on_cuda_matches_torch_eager_and_in_a_cuda_graph():
    """FlatAdamW (clip + AdamW + EMA in one launch) against PyTorch's fused AdamW, clip and
    foreach EMA on CUDA; then the same steps captured in one CUDA graph and replayed, with fresh
    gradients written by the graph each time, as the training loop's graphed step does."""
    from fasttrain.optim.adamw import FlatAdamW

    torch.manual_seed(0)
    shapes = [(320, 320, 3, 3), (1280,), (77, 768), (5,), (4099, 33)]
    init = [torch.randn(s, device="cuda") for s in shapes]
    init[0] = init[0].contiguous(memory_format=torch.channels_last)
    grads = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(6)]

    def run(graphed: bool):
        ours = [w.clone().requires_grad_() for w in init]
        opt = FlatAdamW(ours, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
        shadow = opt.attach_ema(0.99)
        src = [torch.zeros_like(w) for w in init]  # a graph's input: this step's gradients

        def step():
            for w, g in zip(ours, src):  # "backward": a fresh gradient tensor every step
                w.grad = g * 1.0
            opt.step()

        if not graphed:
            for gs in grads:
                torch._foreach_copy_(src, gs)
                step()
            return ours, shadow, opt
        torch._foreach_copy_(src, grads[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # eager warm-up step (the kernel compiles here)
        torch.cuda.current_stream().wait_stream(side)
        for w in ours:
            w.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for gs in grads[1:]:
            torch._foreach_copy_(src, gs)
            graph.replay()
        return ours, shadow, opt

    ref = [w.clone().requires_grad_() for w in init]
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
    ema = [w.clone() for w in init]
    for gs in grads:
        for w, g in zip(ref, gs):  # in the weight's memory order, as autograd makes them (fused
            w.grad = torch.empty_like(w).copy_(g)  # AdamW misreads a channels-last weight's
        torch.nn.utils.clip_grad_norm_(ref, 1.0)  # contiguous gradient)
        torch_opt.step()
        torch._foreach_lerp_(ema, [w.detach() for w in ref], 0.01)
    for graphed in (False, True):
        ours, shadow, opt = run(graphed)
        torch.cuda.synchronize()
        for a, b, s, e in zip(ours, ref, shadow, ema):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-6)
        assert opt._steps.tolist() == [6.0] * len(shapes)


def test_one_launch_optimizer_in_the_graphed_training_loop_keeps_the_losses():
    wl = load_workload("sd", "tiny")
    base = Recipe(precision="bf16-mixed", optimizer_impl="fused", ema="foreach",
                  compile="regional", cuda_graphs=True, lr=1e-3)
    plain = train(wl, base, steps=6, warmup=4, device="cuda")
    ours = train(wl, base.replace(optimizer_impl="triton"), steps=6, warmup=4, device="cuda")
    assert "one Triton launch" in ours.applied["optimizer"] and not ours.warnings
    assert "folded into the optimizer's Triton kernel" in ours.applied["ema"]
    # bf16 activations: an update that differs in the last fp32 bit can round a few
    # activations the other way, so the bf16 parity tolerance
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(plain.losses),
                               rtol=2e-2, atol=0)


def test_one_launch_adamw_steps_bf16_weights_through_fp32_masters_on_cuda():
    """bf16 weights with fp32 masters (master_weights under bf16-mixed): the masters follow the
    fp32 FlatAdamW given the same (bf16) gradients, the weights are exactly the masters rounded
    to nearest even, eager and in a CUDA graph, next to fp32 weights in the same launch. (The
    clip norm of bf16 gradients, accumulated in fp32, may differ from that of their fp32 copies
    in the last bit: PyTorch's multi-tensor norm sums them in another order.)"""
    from fasttrain.optim.adamw import FlatAdamW

    torch.manual_seed(0)
    shapes = [(320, 320, 3, 3), (1280,), (77, 768), (5,), (4099, 33)]
    init = [torch.randn(s, device="cuda") for s in shapes]
    grads = [[torch.randn(s, device="cuda").bfloat16() for s in shapes] for _ in range(4)]
    half = [True, True, False, True, True]  # one fp32 weight (a norm's) among them
    ref = [w.clone().requires_grad_() for w in init]
    ref_opt = FlatAdamW(ref, lr=1e-3, max_grad_norm=1.0)
    ours = [(w.bfloat16() if h else w.clone()).requires_grad_() for w, h in zip(init, half)]
    opt = FlatAdamW(ours, lr=1e-3, max_grad_norm=1.0,
                    masters=[w.clone() if h else None for w, h in zip(init, half)])
    src = [torch.zeros_like(w) for w in ours]

    def step():
        for w, g in zip(ours, src):
            w.grad = g * 1
        opt.step()

    for k, gs in enumerate(grads):
        for w, g in zip(ref, gs):
            w.grad = g.float()
        ref_opt.step()
        torch._foreach_copy_(src, [g.to(w.dtype) for g, w in zip(gs, ours)])
        if k < 2:
            step()
        elif k == 2:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
        else:
            graph.replay()
    torch.cuda.synchronize()
    for w, r, m, h in zip(ours, ref, opt.masters, half):
        torch.testing.assert_close(m if h else w, r.detach(), rtol=1e-6, atol=1e-6)
        if h:
            assert torch.equal(w.detach(), m.bfloat16())


def test_bf16_master_weights_in_the_graphed_training_loop_keep_the_losses():
    """master_weights under bf16-mixed, compiled and in CUDA graphs: the same losses as
    autocast over fp32 weights (within the bf16 tolerance: compile may fuse casts
    differently), and the linear weights are bf16 while the norms stay fp32."""
    for workload in ("vit", "swin"):
        wl = load_workload(workload, "tiny")
        base = Recipe(precision="bf16-mixed", optimizer_impl="triton", compile="model",
                      cuda_graphs=True, lr=1e-3)
        plain = train(wl, base, steps=6, warmup=2, device="cuda")
        ours = train(wl, base.replace(master_weights=True), steps=6, warmup=2, device="cuda")
        assert "stored in bf16 with fp32 masters" in ours.applied["optimizer"]
        assert not ours.warnings
        torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(plain.losses),
                                   rtol=2e-2, atol=0)


def test_rewritten_memsets_store_the_bytes_the_driver_would():
    """Driver memsets of each element size, 1-D and pitched 2-D, captured with a copy after
    them, once as they are and once rewritten as kernel nodes: the same bytes, which are the
    ones the memsets describe."""
    import ctypes

    from fasttrain.run.graph_memsets import _driver, memsets, rewrite

    lib = _driver()
    buf = torch.full((256,), 0xAA, dtype=torch.uint8, device="cuda")
    base = buf.data_ptr()
    want = torch.full((256,), 0xAA, dtype=torch.uint8)
    want[3:10] = 0x5C
    want[16:26] = torch.tensor([0xEF, 0xBE] * 5, dtype=torch.uint8)
    want[32:44] = torch.tensor([0x78, 0x56, 0x34, 0x12] * 3, dtype=torch.uint8)
    for row in range(4):
        want[64 + 16 * row: 69 + 16 * row] = 0x7E
    outs = []
    for edit in (False, True):
        buf.fill_(0xAA)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            u64 = ctypes.c_uint64
            assert lib.cuMemsetD8Async(u64(base + 3), ctypes.c_ubyte(0x5C), ctypes.c_size_t(7),
                                       s) == 0
            assert lib.cuMemsetD16Async(u64(base + 16), ctypes.c_ushort(0xBEEF),
                                        ctypes.c_size_t(5), s) == 0
            assert lib.cuMemsetD32Async(u64(base + 32), ctypes.c_uint(0x12345678),
                                        ctypes.c_size_t(3), s) == 0
            assert lib.cuMemsetD2D8Async(u64(base + 64), ctypes.c_size_t(16),
                                         ctypes.c_ubyte(0x7E), ctypes.c_size_t(5),
                                         ctypes.c_size_t(4), s) == 0
            out = buf.clone()
        assert len(memsets(graph)) == 4
        if edit:
            r = rewrite(graph)
            assert (r.rewritten, r.kept) == (4, 0) and memsets(graph) == []
        graph.instantiate()
        graph.replay()
        torch.cuda.synchronize()
        outs.append(out.cpu())
    assert torch.equal(outs[0], want) and torch.equal(outs[1], want)


def test_library_memsets_rewritten_as_kernels_replay_bit_for_bit():
    """cuBLAS GEMMs, cuDNN attention and a convolution captured twice, once with their small
    memsets as kernel nodes: none of them is left, and the outputs are equal bit for bit."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fasttrain.run.graph_memsets import memsets, rewrite

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 320, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(320, 320, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    q = torch.randn(2, 8, 1024, 40, device="cuda", dtype=torch.bfloat16, generator=g)
    img = torch.randn(2, 64, 32, 32, device="cuda", dtype=torch.bfloat16,
                      generator=g).to(memory_format=torch.channels_last)
    cw = (torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16, generator=g)
          * 0.05).to(memory_format=torch.channels_last)

    def body():
        h = x
        for _ in range(8):
            h = torch.tanh(h @ w)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            a = F.scaled_dot_product_attention(q, q, q)
        return h, a, torch.tanh(F.conv2d(img, cw, padding=1))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    outs = []
    for edit in (False, True):
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            out = body()
        if edit:
            small = [b for b in memsets(graph) if b <= 4096]
            if not small:
                pytest.skip("this cuBLAS and cuDNN captured no small memsets")
            r = rewrite(graph)
            assert r.rewritten == len(small) and all(b > 4096 for b in memsets(graph))
        graph.instantiate()
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        outs.append([o.clone() for o in out])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_graph_memset_kernels_in_the_graphed_training_loop_keep_the_losses():
    wl = load_workload("vit", "tiny")
    base = Recipe(precision="bf16-mixed", optimizer_impl="fused", compile="model",
                  cuda_graphs=True, lr=1e-3)
    plain = train(wl, base, steps=4, warmup=2, device="cuda")
    ours = train(wl, base.replace(graph_memset_kernels=True), steps=4, warmup=2, device="cuda")
    line = ours.applied["graph_memset_kernels"]
    assert "memset nodes of the captured step rewritten as kernel nodes: " in line
    assert "were memsets, now kernels" in line and not ours.warnings
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(plain.losses),
                               rtol=1e-3, atol=0)
