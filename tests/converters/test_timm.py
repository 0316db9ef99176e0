"""fasttrain.converters on timm's ViT and Swin (CPU; the fused paths' Triton kernels interpreted):
the converted model computes the original's output and every gradient, plain and fused; the
report counts what it did; state dicts and parameter objects are untouched; what the layers do
not compute is refused with its reason; and the ``convert`` switch, the ``timm:NAME`` workload,
its peer and its ladder rung behave."""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from tests.converters.timm_stub import import_timm

timm = import_timm()
if timm is None:
    pytest.skip("timm is not installed", allow_module_level=True)
pytest.importorskip("triton")

from tests.converters.compare import LoraLike, assert_close, assert_same_function  # noqa: E402
from tests.interpreted import interpret, kernels_interpreted  # noqa: E402,F401

with kernels_interpreted():
    import fasttrain.kernels.activations  # noqa: F401
    import fasttrain.kernels.norms  # noqa: F401
    import fasttrain.kernels.seq_attention  # noqa: F401
    import fasttrain.kernels.window_attention  # noqa: F401

import fasttrain.converters.apply as convert_apply  # noqa: E402
from fasttrain.converters import convert, registry  # noqa: E402
from fasttrain.converters import timm_vit  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.ladder.rungs import build_ladder  # noqa: E402
from fasttrain.layers.attention import SelfAttention  # noqa: E402
from fasttrain.layers.blocks import ChainedBlocks  # noqa: E402
from fasttrain.layers.fused import StreamCarrier, fused_layers  # noqa: E402
from fasttrain.layers.mlp import Mlp  # noqa: E402
from fasttrain.layers.norm import LayerNorm  # noqa: E402
from fasttrain.layers.patch import PatchEmbed  # noqa: E402
from fasttrain.layers.windows import WindowAttention  # noqa: E402
from fasttrain.measure.parity import compare  # noqa: E402
from fasttrain.peers import run_peer  # noqa: E402
from fasttrain.peers.timm_peers import model_kwargs  # noqa: E402
from fasttrain.recipe import Recipe  # noqa: E402
from fasttrain.run.loop import train  # noqa: E402
from fasttrain.workloads import load_workload  # noqa: E402

from timm.models import swin_transformer as timm_swin  # noqa: E402
from timm.models import vision_transformer as timm_vit_models  # noqa: E402

VIT_NAME, SWIN_NAME = "vit_base_patch16_224", "swin_base_patch4_window7_224"
VIT = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)
SWIN = dict(img_size=56, window_size=7, embed_dim=32, depths=(2, 2), num_heads=(2, 4),
            num_classes=10)  # timm's default drop_path_rate (0.1) stays: stochastic depth on
MODELS = {  # id → (timm name, kwargs)
    "vit": (VIT_NAME, VIT),
    "swin": (SWIN_NAME, SWIN),
    "vit-26-tokens": (VIT_NAME, dict(VIT, img_size=40)),  # 5x5 patches + cls
    "vit-3-heads": (VIT_NAME, dict(VIT, embed_dim=48, num_heads=3)),  # head dim 16
    "vit-no-qkv-proj-bias": (VIT_NAME, dict(VIT, qkv_bias=False, proj_bias=False)),
}
PLAIN_REL, FUSED_REL, BF16_REL = 1e-6, 1e-4, 2e-2


# ----------------------------------------------------------------------------- helpers

def build(key: str, seed: int = 0, **extra) -> tuple[nn.Module, torch.Tensor]:
    """The timm miniature (train mode) with biases, norms and position-bias tables moved off
    their init (a dropped bias or a misread table would show), and a batch of 2 images."""
    name, kwargs = MODELS[key]
    kwargs = {**kwargs, **extra}
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, **kwargs)
    size = kwargs["img_size"]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "relative_position_bias_table" in n:
                p.add_(torch.randn_like(p), alpha=0.1)
    return model.train(), torch.randn(2, 3, size, size)


def converted(model: nn.Module):
    """A converted deep copy (converted in eval mode: see
    test_self_check_in_train_mode_is_deterministic for why) and its report."""
    twin = copy.deepcopy(model).eval()
    report = convert(twin)
    return twin.train(model.training), report


def run(model: nn.Module, x: torch.Tensor, seed: int = 0, autocast: torch.dtype | None = None):
    """Output, input gradient and every parameter's gradient of a weighted sum of the output
    (the same stochastic-depth draws for the same seed)."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(x)
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    return out.detach().float(), x.grad, grads


def use_fused(model: nn.Module) -> list[str]:
    layers = fused_layers(model)
    assert layers
    return [what for m in layers for what in m.use_fused(True)]


# ----------------------------------------------------------------------------- the function

@pytest.mark.parametrize("key", list(MODELS))
def test_converted_plain_path_keeps_the_output_and_every_gradient(key):
    """Plain path (fp32): the converted copy gives the original's output, input gradient and
    every parameter gradient (stochastic depth drawn alike under the same seed)."""
    model, x = build(key)
    twin, report = converted(model)
    assert report and not report.skipped
    assert_same_function(run(twin, x), run(model, x), PLAIN_REL)


@pytest.mark.parametrize("key", list(MODELS))
def test_fused_paths_keep_the_output_and_every_gradient(key):
    """Every fused path switched on (Triton kernels interpreted, fp32): the original's output
    and gradients within 1e-4 of each tensor's largest magnitude."""
    model, x = build(key)
    twin, _ = converted(model)
    said = use_fused(twin)
    kinds = {m.fused_kind for m in fused_layers(twin)}
    assert kinds == ({"patch", "layernorm", "gelu", "window"} if key == "swin"
                     else {"patch", "layernorm", "gelu", "attention"})
    assert not any("kept on SDPA" in s for s in said)
    assert_same_function(run(twin, x), run(model, x), FUSED_REL)


def test_a_lora_wrapper_added_after_converting_runs_whole_on_the_fused_paths():
    """Layers wrapped after the conversion (the attention's proj, the MLP's fc1 and fc2): the
    fused norms and the bias + GELU kernel leave their biases to them and call them whole, so
    the update is not lost; the blocks without a wrapper keep handing their branch on."""
    model, x = build("vit")
    twin, _ = converted(model)
    use_fused(twin)
    for m in (model, twin):
        torch.manual_seed(9)
        blk = m.blocks[0]
        blk.attn.proj = LoraLike(blk.attn.proj)
        blk.mlp.fc1, blk.mlp.fc2 = LoraLike(blk.mlp.fc1), LoraLike(blk.mlp.fc2)
    assert_same_function(run(twin, x), run(model, x), FUSED_REL)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_bf16_autocast_keeps_the_function(fused):
    """Under CPU bf16 autocast the converted ViT (plain, and fused interpreted) gives the
    original's output and gradients within bf16 tolerance."""
    model, x = build("vit")
    twin, _ = converted(model)
    if fused:
        use_fused(twin)
    got, want = run(twin, x, autocast=torch.bfloat16), run(model, x, autocast=torch.bfloat16)
    assert_same_function(got, want, BF16_REL)


def test_layer_scale_and_stochastic_depth_convert_and_keep_the_train_mode_output():
    """A ViT with layer scale and stochastic depth converts; in train mode under the same seed
    it gives the original's output and gradients (plain and fused); the draws do matter."""
    model, _ = build("vit", init_values=1e-2, drop_path_rate=0.1)
    x = torch.randn(8, 3, 32, 32)
    twin, report = converted(model)
    assert report.converted["timm ViT Block"] == 2 and not report.skipped
    assert twin.blocks[0].post() is not None and isinstance(twin.blocks, ChainedBlocks)
    assert twin.training and model.training
    assert_same_function(run(twin, x, seed=3), run(model, x, seed=3), PLAIN_REL)
    assert not torch.equal(run(model, x, seed=3)[0], run(model, x, seed=4)[0])  # drops happen
    use_fused(twin)
    assert_same_function(run(twin, x, seed=3), run(model, x, seed=3), FUSED_REL)


# ----------------------------------------------------------------------------- the report

def test_report_counts_the_vit_by_class():
    """ViT: 'timm ViT Block' × depth, 'timm PatchEmbed' × 1, one chained stack, nothing skipped;
    the layers became fasttrain's; a second convert finds nothing left."""
    model, _ = build("vit")
    report = convert(model.eval())
    assert dict(report.converted) == {"timm ViT Block": 2, "timm PatchEmbed": 1}
    assert report.chained == 1 and not report.skipped and report.skipped_lines() == []
    assert report.summary() == "timm PatchEmbed ×1; timm ViT Block ×2; 1 block stack chained"
    assert report.as_dict() == {"converted": {"timm PatchEmbed": 1, "timm ViT Block": 2},
                                "chained": 1, "skipped": [], "kernels": {},
                                "kernels_kept": None}
    assert type(model.blocks) is ChainedBlocks
    blk = model.blocks[0]
    assert isinstance(blk.attn, SelfAttention) and type(blk.mlp) is Mlp
    assert type(blk.norm1) is LayerNorm and type(blk.norm2) is LayerNorm
    assert type(model.patch_embed.proj) is PatchEmbed
    assert type(model.norm) is timm.layers.LayerNorm  # no block's norm: left as it was
    again = convert(model)
    assert not again and again.chained == 0


def test_report_counts_the_swin_by_class():
    """Swin: 'timm Swin block' × 4 and both stages' stacks chained; window attention with the
    block's window and shift; the torch LayerNorms outside the blocks (the patch embedding's,
    the patch merging's, the final one) as torch.nn's converter makes them."""
    model, _ = build("swin")
    report = convert(model.eval())
    assert dict(report.converted) == {"timm Swin block": 4, "timm PatchEmbed": 1,
                                      "torch LayerNorm": 3}
    assert report.chained == 2 and not report.skipped
    assert report.summary() == ("timm PatchEmbed ×1; torch LayerNorm ×3; timm Swin block ×4; "
                                "2 block stacks chained")
    assert all(type(m) is LayerNorm for m in (model.patch_embed.norm, model.norm,
                                              model.layers[1].downsample.norm))
    assert all(type(stage.blocks) is ChainedBlocks for stage in model.layers)
    attn = [b.attn for stage in model.layers for b in stage.blocks]
    assert all(type(a) is WindowAttention for a in attn)
    assert [(a.window, a.shift) for a in attn] == [(7, 0), (7, 3), (7, 0), (7, 0)]


# ----------------------------------------------------------------------------- state dicts

@pytest.mark.parametrize("key", ["vit", "swin"])
def test_state_dicts_round_trip_both_ways(key):
    """Keys, shapes and dtypes are unchanged; the original's state dict loads strictly into the
    converted model (same output), and the converted one into a fresh timm model."""
    model, x = build(key)
    model.eval()
    twin, _ = converted(model)
    twin.eval()
    want, got = model.state_dict(), twin.state_dict()
    assert list(got) == list(want)
    assert all(got[k].shape == want[k].shape and got[k].dtype == want[k].dtype for k in want)
    other, _ = build(key, seed=1)
    other_twin, _ = converted(other)
    other_twin.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        assert_close(other_twin.eval()(x), model(x), PLAIN_REL)
    fresh, _ = build(key, seed=2)
    fresh.load_state_dict(twin.state_dict(), strict=True)
    with torch.no_grad():
        assert_close(fresh.eval()(x), twin(x), PLAIN_REL)


def test_parameters_and_buffers_stay_the_same_objects():
    """Conversion swaps classes only: the parameter and buffer objects are the ones an
    optimizer built before holds, and its step moves the converted model."""
    model, x = build("swin")
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convert(model.eval())
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all(b is buffers[n] for n, b in model.named_buffers())
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters(),
                                      strict=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()(x).square().mean().backward()
    opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())


# ----------------------------------------------------------------------------- refusals

REFUSALS = [  # (model, timm kwargs, converter, where, reason)
    ("vit", dict(qk_norm=True), "timm ViT Block", "blocks.0",
     "qk-norm or scale-norm is not in the fused attention"),
    ("vit", dict(attn_drop_rate=0.1), "timm ViT Block", "blocks.0",
     "attention dropout is not in the fused attention"),
    ("vit", dict(proj_drop_rate=0.1), "timm ViT Block", "blocks.0",
     "attention dropout is not in the fused attention"),
    ("vit", dict(act_layer="silu"), "timm ViT Block", "blocks.0",
     "activation SiLU is not GELU"),
    ("vit", dict(act_layer="gelu_tanh"), "timm ViT Block", "blocks.0",
     "activation GELUTanh is not GELU"),
    ("swin", dict(img_size=60), "timm Swin block", "layers.0.blocks.0",
     "a 15x15 map does not tile into 7x7 windows (timm pads it)"),
]


@pytest.mark.parametrize("key,kwargs,conv,where,why", REFUSALS,
                         ids=["qk-norm", "attn-drop", "proj-drop", "silu", "gelu-tanh",
                              "swin-untiled"])
def test_what_the_layers_do_not_compute_is_refused_with_its_reason(key, kwargs, conv, where,
                                                                   why):
    """A configuration the fasttrain layers do not compute leaves each block its timm class,
    with the reason in skipped_lines(); whatever was converted inside keeps the function."""
    model, x = build(key, **kwargs)
    model.eval()
    twin, report = converted(model)
    block_class = timm_swin.SwinTransformerBlock if key == "swin" else timm_vit_models.Block
    blocks = [m for m in twin.modules() if isinstance(m, block_class)]
    assert blocks and all(type(b) is block_class for b in blocks)
    assert report.converted[conv] == 0
    assert f"{conv} at {where} (and 1 more) left as it was: {why}" in report.skipped_lines()
    assert not any(type(m) is ChainedBlocks for m in twin.modules())
    with torch.no_grad():
        assert_close(twin(x), model(x), PLAIN_REL)


def test_a_failed_numeric_self_check_leaves_the_module_as_it_was(monkeypatch):
    """A converter whose swap changes the function (one head instead of two) or raises fails
    its self-check: every block stays timm's, with the reason; check=False skips the check."""
    real = next(c for c in registry().values() if c.name == "timm ViT Block")

    def one_head(m):
        timm_vit.swap_block(m)
        m.attn.heads = 1

    def raises(m):
        raise RuntimeError("swap broke\nsecond line")

    for swap, why in ((one_head, "numeric self-check failed (largest difference "),
                      (raises, "numeric self-check failed (RuntimeError: swap broke)")):
        broken = dataclasses.replace(real, swap=swap)
        monkeypatch.setattr(convert_apply, "registry", lambda: {s: broken for s in real.sources})
        model, x = build("vit")
        model.eval()
        twin, report = converted(model)
        assert not report and report.chained == 0
        assert all(type(b) is timm_vit_models.Block for b in twin.blocks)
        assert type(twin.blocks) is nn.Sequential
        assert sum(report.skipped.values()) == 2  # both blocks, each with its difference
        assert report.skipped_lines()[0].startswith("timm ViT Block at blocks.0")
        assert all(line.split(" left as it was: ")[1].startswith(why)
                   for line in report.skipped_lines())
        with torch.no_grad():
            assert torch.equal(twin(x), model(x))
    monkeypatch.setattr(convert_apply, "registry",
                        lambda: {s: dataclasses.replace(real, swap=one_head)
                                 for s in real.sources})
    unchecked = convert(model, check=False)  # the (broken) swap is trusted
    assert unchecked.converted["timm ViT Block"] == 2
    with torch.no_grad():
        assert not torch.allclose(model(x), twin(x))


def test_self_check_in_train_mode_is_deterministic():
    """A model left in train mode (as timm.create_model returns it) with stochastic depth on
    (timm's Swin default, drop_path_rate 0.1) converts every block, whatever the seed, and the
    check leaves the caller's random state as it was."""
    counts = []
    for seed in range(8):
        model, _ = build("swin", seed=seed)
        assert model.training
        before = torch.random.get_rng_state()
        counts.append(convert(model).converted["timm Swin block"])
        assert torch.equal(torch.random.get_rng_state(), before)
    assert counts == [4] * 8


def test_convert_switches_the_asked_kernels_on():
    """convert(model, kernels=…) switches on the named families' fused paths after converting
    (here under the Triton interpreter), says so in the report, and a bad family name is a
    FasttrainError; fasttrain.convert is this function."""
    import fasttrain

    assert fasttrain.convert is convert
    model, x = build("vit")
    report = convert(model, kernels="layernorm,attention")
    assert {m.fused_kind for m in fused_layers(model) if m.fused} == {"layernorm", "attention"}
    assert report.kernels and "LayerNorm" in report.summary() and report.kernels_kept is None
    with pytest.raises(FasttrainError, match="kernels='nope'"):
        convert(build("vit")[0], kernels="nope")


def test_a_model_with_nothing_to_convert():
    """strict=True raises a one-line FasttrainError naming the model's class; without it the
    report is falsy; a non-module is a FasttrainError."""
    with pytest.raises(FasttrainError) as err:
        convert(nn.Sequential(nn.Linear(4, 4)), strict=True)
    assert "\n" not in str(err.value) and str(err.value).startswith("Sequential ")
    report = convert(nn.Sequential(nn.Linear(4, 4)))
    assert not report and report.summary() == "nothing converted"
    with pytest.raises(FasttrainError, match="torch.nn.Module, not str"):
        convert("not a module")
    # everything refused: the message says the first reason
    model, _ = build("vit", qk_norm=True, act_layer="silu")
    model.patch_embed.proj = nn.Conv2d(3, 64, 8, 4)  # overlapping patches: refused too
    with pytest.raises(FasttrainError, match="VisionTransformer: nothing converted; timm "):
        convert(model.eval(), strict=True)


# ----------------------------------------------------------------------------- training

@pytest.mark.parametrize("name,kernel", [(VIT_NAME, "the Triton self-attention kernel"),
                                         (SWIN_NAME, "the Triton window attention kernel")],
                         ids=["vit", "swin"])
def test_convert_keeps_the_training_losses(name, kernel):
    """Recipe(convert=True) trains with the plain run's very losses and says what it converted;
    with kernels=fused (interpreted) the losses stay within tf32 tolerance and the Triton
    attention kernel ran."""
    wl = load_workload(f"timm:{name}", "tiny")
    plain = train(wl, Recipe(batch=2), steps=2, warmup=0, device="cpu")
    conv = train(wl, Recipe(batch=2, convert=True), steps=2, warmup=0, device="cpu")
    assert conv.losses == plain.losses and not conv.warnings
    block = "timm ViT Block ×2" if name == VIT_NAME else "timm Swin block ×4"
    assert block in conv.applied["convert"]
    fused = train(wl, Recipe(batch=2, convert=True, kernels="fused"), steps=2, warmup=0,
                  device="cpu")
    assert compare(fused.losses, plain.losses, "tf32")["passed"], (fused.losses, plain.losses)
    assert fused.applied["attention"].startswith(kernel) and not fused.warnings
    assert "LayerNorm (with the residual add before it) in Triton" in fused.applied["kernels"]


def test_convert_on_a_fasttrain_model_converts_only_its_torch_layers():
    """The reference ViT is fasttrain's own: convert=True finds no block to convert, only its
    final norm, a torch LayerNorm (torch.nn's converter)."""
    res = train(load_workload("vit", "tiny"), Recipe(batch=2, convert=True), steps=1, warmup=0,
                device="cpu")
    assert res.applied["convert"] == "torch LayerNorm ×1" and not res.warnings, res.warnings


def test_bf16_stream_reaches_the_converted_blocks():
    """stream_dtype=bf16 finds the chained blocks (a StreamCarrier) once converted, and nothing
    without convert."""
    assert isinstance(ChainedBlocks(), StreamCarrier)
    wl = load_workload(f"timm:{VIT_NAME}", "tiny")
    base = Recipe(batch=2, precision="bf16-mixed", stream_dtype="bf16")
    res = train(wl, base.replace(convert=True), steps=1, warmup=0, device="cpu")
    assert "ChainedBlocks in bf16" in res.applied["stream_dtype"] and not res.warnings
    assert all(math.isfinite(x) for x in res.losses)
    unconverted = train(wl, base, steps=1, warmup=0, device="cpu")
    assert "stream_dtype" not in unconverted.applied
    assert any(w.startswith("stream_dtype: ") for w in unconverted.warnings)


# ----------------------------------------------------------------------------- the workload

def test_timm_workload_names_and_sizes():
    """An unknown model, a missing name, an unknown size and a family without a miniature are
    FasttrainErrors that say so."""
    with pytest.raises(FasttrainError, match="nope_model"):
        load_workload("timm:nope_model", "tiny")
    with pytest.raises(FasttrainError, match="name the model"):
        load_workload("timm:", "tiny")
    with pytest.raises(FasttrainError, match="not 'large'"):
        load_workload(f"timm:{VIT_NAME}", "large")
    with pytest.raises(FasttrainError, match="size tiny exists for"):
        load_workload("timm:resnet18", "tiny")
    wl = load_workload(f"timm:{VIT_NAME}", "tiny")
    assert wl.converts and wl.name == f"timm:{VIT_NAME}" and wl.image == 32 and wl.classes == 10


def test_timm_workload_weights_are_checked(tmp_path):
    """weights=: a missing file, a file that is not .safetensors and one with wrong keys are
    refused with what is wrong; the right state dict loads exactly."""
    from safetensors.torch import save_file

    spec = f"timm:{VIT_NAME}"
    with pytest.raises(FasttrainError, match="no such file"):
        load_workload(spec, "tiny", weights=str(tmp_path / "absent.safetensors"))
    pickled = tmp_path / "w.pt"
    torch.save({}, pickled)
    # the suffix and the keys (from the file's header) are checked when the workload is made
    with pytest.raises(FasttrainError, match="give a .safetensors file"):
        load_workload(spec, "tiny", weights=str(pickled))
    wrong = tmp_path / "wrong.safetensors"
    save_file({"not_a_key": torch.zeros(2)}, str(wrong))
    with pytest.raises(FasttrainError, match=r"keys missing .*; 1 unexpected \(not_a_key\)"):
        load_workload(spec, "tiny", weights=str(wrong))
    torch.manual_seed(123)
    ref = timm.create_model(VIT_NAME, pretrained=False, **model_kwargs(VIT_NAME, "tiny", 0.0))
    good = tmp_path / "good.safetensors"
    save_file(ref.state_dict(), str(good))
    built = load_workload(spec, "tiny", weights=str(good)).build_model()
    got = built.model.state_dict()
    assert got.keys() == ref.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())


def test_timm_peer_runs_with_the_workloads_kwargs():
    """The peer of timm:NAME trains the same miniature; the workload's drop_path_rate shows in
    its recipe."""
    row = run_peer(f"timm:{VIT_NAME}", size="tiny", steps=2, warmup=0, device="cpu")
    assert row["error"] is None and row["peer"].startswith(f"timm:{VIT_NAME}")
    assert len(row["losses"]) == 2 and all(math.isfinite(x) for x in row["losses"])
    assert row["recipe"]["model"]["kwargs"] == model_kwargs(VIT_NAME, "tiny", 0.0)
    row = run_peer(f"timm:{VIT_NAME}", size="tiny", steps=1, warmup=0, device="cpu",
                   options={"drop_path_rate": 0.1})
    assert row["error"] is None and row["recipe"]["model"]["kwargs"]["drop_path_rate"] == 0.1


def test_ladder_has_a_convert_rung_before_compile_for_timm_only():
    """A timm workload's ladder converts right before compiling (and keeps it after); the
    reference ViT's has no convert rung."""
    ladder = build_ladder(load_workload(f"timm:{VIT_NAME}", "tiny"), None, Recipe())
    names = [rung.name for rung, _ in ladder]
    assert names.index("convert") + 1 == names.index("compile")
    recipes = dict((rung.name, recipe) for rung, recipe in ladder)
    assert recipes["convert"].convert and recipes["compile"].convert
    assert not recipes[names[names.index("convert") - 1]].convert
    assert "convert" not in [r.name for r, _ in build_ladder(load_workload("vit", "tiny"), None,
                                                             Recipe())]
