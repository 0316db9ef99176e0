"""Swin's window attention Triton kernel against its plain-PyTorch reference, in Triton's
interpreter on CPU: output, the qkv and bias gradients, masks, odd window sizes, bad input,
torch.compile without graph breaks, and the Swin model with the kernel switched on."""
import re

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreted import (assert_compiled_matches_eager, interpret,  # noqa: E402,F401
                               kernels_interpreted)

with kernels_interpreted():
    from fasttrain.kernels.window_attention import (map_window_attention,
                                                    map_window_attention_reference,
                                                    map_window_attention_tiles,
                                                    window_attention,
                                                    window_attention_reference,
                                                    window_bias_tiles)


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
       torch.float16: dict(rtol=5e-3, atol=5e-3)}


def _inputs(windows, tokens, heads, head_dim, n_masks, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(windows, tokens, 3 * heads * head_dim, generator=g).to(dtype)
    bias = 0.5 * torch.randn(heads, tokens, tokens, generator=g)
    mask = None if not n_masks else torch.where(
        torch.rand(n_masks, tokens, tokens, generator=g) < 0.3, -100.0, 0.0)
    cot = torch.randn(windows, tokens, heads * head_dim, generator=g).to(dtype)
    return qkv, bias, mask, cot


def _run(fn, qkv, bias, mask, heads, cot):
    qkv, bias = qkv.clone().requires_grad_(), bias.clone().requires_grad_()
    out = fn(qkv, bias, mask, heads)
    out.backward(cot)
    return out.detach(), qkv.grad, bias.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("windows, tokens, heads, head_dim, n_masks", [
    (8, 49, 2, 32, 4),  # Swin's 7x7 windows, shifted: mask per window of the image
    (3, 9, 3, 8, 0),  # 3x3 windows, head_dim below a tile, no mask
    (4, 16, 1, 24, 1),  # one mask for every window, head_dim not a power of two
], ids=["7x7-shifted", "3x3", "4x4-one-mask"])
def test_output_and_gradients_match_the_reference(dtype, windows, tokens, heads, head_dim,
                                                  n_masks):
    qkv, bias, mask, cot = _inputs(windows, tokens, heads, head_dim, n_masks, dtype)
    got = _run(window_attention, qkv, bias, mask, heads, cot)
    want = _run(window_attention_reference, qkv, bias, mask, heads, cot)
    for name, a, b in zip(("out", "dqkv", "dbias"), got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("heads, stages, per_sm", [(2, 1, 2), (1, 3, 2), (2, 1, 0)])
def test_persistent_forward_walks_several_windows_each(monkeypatch, heads, stages, per_sm):
    # the interpreter's 4 programs: 7 windows of 2 heads over 2 parts (4 and 3 windows
    # each), or of 1 head over 4 parts (2, 2, 2 and 1); num_stages only matters on a GPU;
    # 0 programs per SM: one window a program
    import sys

    wa = sys.modules[window_attention.__module__]
    monkeypatch.setitem(wa.LAUNCH, "fwd_programs_per_sm", per_sm)
    monkeypatch.setitem(wa.LAUNCH, "fwd_stages", stages)
    qkv, bias, mask, cot = _inputs(7, 49, heads, 16, 7, torch.float32)
    got = _run(window_attention, qkv, bias, mask, heads, cot)
    want = _run(window_attention_reference, qkv, bias, mask, heads, cot)
    for name, a, b in zip(("out", "dqkv", "dbias"), got, want):
        torch.testing.assert_close(a, b, **TOL[torch.float32], msg=lambda m: f"{name}: {m}")


def test_the_reference_is_plain_attention_with_an_additive_bias():
    qkv, bias, mask, _ = _inputs(4, 9, 2, 8, 2, torch.float64)
    q, k, v = qkv.view(4, 9, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
    # the mask in q's dtype: torch 2.13's CPU SDPA on an AVX2 machine misreads an fp32 mask
    # next to fp64 q/k/v (off by up to 1.8 from the same attention with the mask in fp64)
    full = (bias + mask.repeat(2, 1, 1).unsqueeze(1)).to(q.dtype)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full)
    got = window_attention_reference(qkv, bias, mask, 2)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(4, 9, 16))


def test_fp32_bias_with_bf16_qkv_keeps_the_bias_dtype():
    qkv, bias, mask, cot = _inputs(2, 16, 2, 16, 2, torch.bfloat16)
    _, dqkv, dbias = _run(window_attention, qkv, bias, mask, 2, cot)
    assert (dqkv.dtype, dbias.dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("call, message", [
    (lambda q, b: window_attention(q.long(), b, None, 2), "qkv must be float32"),
    (lambda q, b: window_attention(q[..., :-1], b, None, 2), "qkv must be (windows, tokens"),
    (lambda q, b: window_attention(q, b[:1], None, 2), "bias must be (2, 9, 9)"),
    (lambda q, b: window_attention(q, b, torch.zeros(3, 9, 9), 2), "mask must be (nW, 9, 9)"),
    (lambda q, b: window_attention(torch.zeros(1, 129, 6), torch.zeros(1, 129, 129), None, 1),
     "windows of 129 tokens do not fit one tile"),
], ids=["dtype", "width", "bias", "mask", "too-big"])
def test_bad_input_is_a_one_line_value_error(call, message):
    qkv, bias, _, _ = _inputs(4, 9, 2, 8, 0, torch.float32)
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        call(qkv, bias)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype, height, width, window, shift, masked, wide", [
    *((d, *case) for d in (torch.float32, torch.bfloat16) for case in [
        (8, 12, 4, 2, True, False),  # shifted: 2 x 3 windows an image, a mask per window
        (8, 12, 4, 0, False, False),  # unshifted
        (6, 6, 3, 1, True, False),  # odd window (9 tokens), odd shift
        (4, 4, 4, 0, False, False),  # one window covers the map
        (6, 9, 3, 1, True, True)]),  # int64 offsets (WIDE), which maps of 2³¹ elements take
    (torch.float16, 6, 6, 3, 1, True, False),  # fp16 (fp16-mixed's autocast dtype), odd window
], ids=str)
def test_map_mode_matches_roll_partition_attend_reverse(monkeypatch, dtype, height, width,
                                                        window, shift, masked, wide):
    # the kernel reads the windows of the rolled map by address and writes back in place:
    # output and gradients equal those of the materialised roll + partition and reverses
    if wide:
        from fasttrain.kernels import window_attention as module

        monkeypatch.setattr(module, "WIDE_ELEMENTS", 1)
    g = torch.Generator().manual_seed(1)
    heads, head_dim, N, B = 2, 8, window * window, 2
    qkv = torch.randn(B, height, width, 3 * heads * head_dim, generator=g).to(dtype)
    bias = 0.5 * torch.randn(heads, N, N, generator=g)
    nW = (height // window) * (width // window)
    mask = torch.where(torch.rand(nW, N, N, generator=g) < 0.3, -100.0, 0.0) if masked else None
    cot = torch.randn(B, height, width, heads * head_dim, generator=g).to(dtype)
    got = _run(lambda *a: map_window_attention(*a, window, shift), qkv, bias, mask, heads, cot)
    want = _run(lambda *a: map_window_attention_reference(*a, window, shift), qkv, bias, mask,
                heads, cot)
    for name, a, b in zip(("out", "dqkv", "dbias"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("call, message", [
    (lambda q, b: map_window_attention(q[0], b, None, 2, 3), "qkv must be a (batch, height"),
    (lambda q, b: map_window_attention(q, b, None, 2, 4), "does not tile into 4x4 windows"),
    (lambda q, b: map_window_attention(q, b, None, 2, 3, shift=3), "shifted by 3"),
    (lambda q, b: map_window_attention(q, b, torch.zeros(2, 9, 9), 2, 3),
     "one (N, N) slice per window of an image (4)"),
], ids=["rank", "tiling", "shift", "mask"])
def test_map_mode_bad_input_is_a_one_line_value_error(call, message):
    qkv = torch.randn(2, 6, 6, 48)
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        call(qkv, torch.zeros(2, 9, 9))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype, height, width, window, shift, masked", [
    (torch.float32, 8, 12, 4, 2, True), (torch.bfloat16, 6, 6, 3, 1, True),
    (torch.float16, 8, 12, 4, 0, False)], ids=str)
def test_tiles_built_once_give_the_forward_of_the_call_that_builds_them(dtype, height, width,
                                                                        window, shift, masked):
    # the same tiles the forward builds at every call, built beforehand: the same output
    g = torch.Generator().manual_seed(2)
    heads, head_dim, N = 2, 8, window * window
    qkv = torch.randn(2, height, width, 3 * heads * head_dim, generator=g).to(dtype)
    bias = 0.5 * torch.randn(heads, N, N, generator=g)
    nW = (height // window) * (width // window)
    mask = torch.where(torch.rand(nW, N, N, generator=g) < 0.3, -100.0, 0.0) if masked else None
    tiles = window_bias_tiles(bias, mask, dtype)
    got = map_window_attention_tiles(qkv, tiles, heads, window, shift)
    want = map_window_attention(qkv, bias, mask, heads, window, shift)
    assert torch.equal(got, want)
    ref = map_window_attention_reference(qkv, bias, mask, heads, window, shift)
    torch.testing.assert_close(got, ref, **TOL[dtype])


@pytest.mark.parametrize("call, message", [
    (lambda q, t: map_window_attention_tiles(q[0], t, 2, 3), "qkv must be a (batch, height"),
    (lambda q, t: map_window_attention_tiles(q, t, 2, 4), "does not tile into 4x4 windows"),
    (lambda q, t: map_window_attention_tiles(q, t[:, :1], 2, 3), "tiles must be (1 or 4, 2, 16"),
    (lambda q, t: map_window_attention_tiles(q, t.half(), 2, 3), "torch.float16 on cpu"),
    (lambda q, t: map_window_attention_tiles(q.requires_grad_(), t, 2, 3), "forward only"),
    (lambda q, t: map_window_attention_tiles(torch.randn(1, 12, 12, 48), t, 2, 12),
     "windows of 144 tokens do not fit one tile"),
], ids=["rank", "tiling", "shape", "dtype", "grad", "window"])
def test_tiles_bad_input_is_a_one_line_value_error(call, message):
    qkv = torch.randn(2, 6, 6, 48)
    tiles = window_bias_tiles(torch.zeros(2, 9, 9), torch.zeros(4, 9, 9), torch.float32)
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        call(qkv, tiles)
    assert "\n" not in str(err.value)


def test_torch_compile_fullgraph_matches_eager():
    qkv, bias, mask, _ = _inputs(4, 16, 2, 16, 2, torch.float32)
    proj = torch.randn(32, 32)

    def block(qkv, bias):
        return (window_attention(qkv * 2, bias, mask, 2) @ proj).square().sum()

    assert_compiled_matches_eager(block, [qkv, bias])


def test_swin_with_the_window_kernel_keeps_its_losses():
    from fasttrain.recipe import Recipe
    from fasttrain.run.loop import train
    from fasttrain.workloads import load_workload

    wl = load_workload("swin", "tiny")
    plain = train(wl, Recipe(batch=2), steps=2, warmup=0, device="cpu")
    fused = train(wl, Recipe(batch=2, kernels="window"), steps=2, warmup=0, device="cpu")
    assert fused.losses == pytest.approx(plain.losses, rel=1e-5)
    assert fused.applied["kernels"] == ("window attention with bias, mask, shift and partition "
                                        "in one Triton kernel ×4")
    # what ran in place of SDPA, not what the plain-layer probe saw (and no advice to change it)
    assert "ran math x4" in plain.applied["attention"]
    assert fused.applied["attention"] == ("the Triton window attention kernel in 4 layers "
                                          "(kernels=window); SDPA is not called")


def test_a_swin_with_its_biases_frozen_gives_the_same_logits():
    from fasttrain.converters.apply import convert
    from fasttrain.layers.windows import WindowAttention, freeze_window_biases
    from fasttrain.workloads import load_workload

    model = load_workload("swin", "tiny").build_model().eval()
    assert freeze_window_biases(model) == 0  # plain layers: nothing to freeze
    convert(model, kernels="fused")
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    with torch.inference_mode():
        want = model.head(model.features(images))
        assert freeze_window_biases(model) == 4
        assert all(m.tiles is not None for m in model.modules() if isinstance(m, WindowAttention))
        got = model.head(model.features(images))
    assert torch.equal(got, want)
    # with gradients (training) the layers build the tiles from the table at every call
    model.train()
    model.head(model.features(images)).sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters()
               if "relative_position_bias_table" in n)


def _frozen_swin():
    from fasttrain.converters.apply import convert
    from fasttrain.layers.windows import WindowAttention, freeze_window_biases
    from fasttrain.workloads import load_workload

    torch.manual_seed(0)
    model = load_workload("swin", "tiny").build_model().eval()
    convert(model, kernels="fused")
    assert freeze_window_biases(model) == 4
    layers = [m for m in model.modules() if isinstance(m, WindowAttention)]
    return model, layers


@pytest.mark.parametrize("change", ["load_state_dict", "to", "train"])
def test_tiles_are_dropped_when_they_could_go_stale(change):
    model, layers = _frozen_swin()
    if change == "load_state_dict":
        state = {k: v + 0.5 if "relative_position_bias_table" in k else v
                 for k, v in model.state_dict().items()}
        model.load_state_dict(state)
    elif change == "to":
        model.to(torch.float64)
    else:
        model.train()
    assert all(m.tiles is None for m in layers)
    if change == "load_state_dict":  # the new table, not the old tiles
        images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
        with torch.inference_mode():
            got = model.head(model.features(images))
            from fasttrain.layers.windows import freeze_window_biases

            freeze_window_biases(model)
            assert torch.equal(model.head(model.features(images)), got)


def test_tiles_of_another_dtype_than_the_call_are_not_read():
    # an fp32 model under bf16 autocast: its qkv is bf16, the tiles fp32: the table's path
    model, layers = _frozen_swin()
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    qkv = torch.zeros(1, 7, 7, 3 * layers[0].qkv.out_features // 3, dtype=torch.bfloat16)
    with torch.no_grad():
        assert layers[0]._frozen_tiles(qkv) is None
        assert layers[0]._frozen_tiles(qkv.float()) is layers[0].tiles
    assert layers[0]._frozen_tiles(qkv.float()) is None  # the table takes a gradient here
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(model.head(model.features(images))).all()
