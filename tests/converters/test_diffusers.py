"""fasttrain.converters on diffusers' Stable Diffusion classes (CPU; the fused paths' Triton kernels
interpreted): the converted UNet and VAE encoder compute the original's output and every gradient,
plain and fused; the report counts what it did; state dicts and parameter objects are untouched;
what the layers do not compute is refused with its reason, and a call they do not compute goes to
diffusers' own forward; and the ``diffusers:sd-v1`` workload, its peer and its ladder rung behave."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("triton")

from tests.converters.compare import LoraLike, assert_close, assert_same_function  # noqa: E402
from tests.interpreted import interpret, kernels_interpreted  # noqa: E402,F401

with kernels_interpreted():
    import fasttrain.kernels.geglu  # noqa: F401
    import fasttrain.kernels.group_norm  # noqa: F401
    import fasttrain.kernels.norms  # noqa: F401

from diffusers.models.attention_processor import (AttnProcessor2_0,  # noqa: E402
                                                   IPAdapterAttnProcessor2_0)

from fasttrain.converters import convert  # noqa: E402
from fasttrain.converters import diffusers_sd  # noqa: E402
from fasttrain.errors import FasttrainError  # noqa: E402
from fasttrain.ladder.rungs import build_ladder  # noqa: E402
from fasttrain.layers.fused import fused_layers  # noqa: E402
from fasttrain.measure.parity import compare  # noqa: E402
from fasttrain.peers import run_peer  # noqa: E402
from fasttrain.peers.diffusers_peer import TINY  # noqa: E402
from fasttrain.recipe import Recipe  # noqa: E402
from fasttrain.run.loop import train  # noqa: E402
from fasttrain.workloads import load_workload  # noqa: E402

UNET, VAE = TINY["unet"], TINY["vae"]  # the miniatures of the workload and its peer
PLAIN_REL, FUSED_REL, BF16_REL = 1e-5, 1e-4, 3e-2
SPEC = "diffusers:sd-v1"


# ----------------------------------------------------------------------------- helpers

def offset(model: nn.Module) -> nn.Module:
    """Biases and norm weights moved off their init, where a dropped one would not show."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p), alpha=0.1)
    return model


def unet(seed: int = 0, **extra) -> nn.Module:
    torch.manual_seed(seed)
    return offset(diffusers.UNet2DConditionModel(**{**UNET, **extra})).train()


def unet_inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, 16, 16, generator=gen), torch.tensor([3, 917]),
            torch.randn(2, 5, UNET["cross_attention_dim"], generator=gen))


def converted(model: nn.Module, **kwargs):
    twin = copy.deepcopy(model)
    report = convert(twin, **kwargs)
    return twin, report


def run(model: nn.Module, inputs, autocast: torch.dtype | None = None):
    """Output, the sample's gradient and every parameter's gradient of a weighted sum of the
    output."""
    model.zero_grad(set_to_none=True)
    sample, t, text = inputs
    sample = sample.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(sample, t, text, return_dict=False)[0]
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    return out.detach().float(), sample.grad, grads


# ----------------------------------------------------------------------------- the function

def test_converted_unet_keeps_the_output_and_every_gradient():
    """Plain paths (fp32): the converted UNet gives the original's output, the sample's gradient
    and every parameter gradient; it is still a diffusers UNet of the same classes to
    ``isinstance``."""
    model = unet()
    twin, report = converted(model)
    assert not report.skipped, report.skipped_lines()
    assert_same_function(run(twin, unet_inputs()), run(model, unet_inputs()), PLAIN_REL,
                         "sample")
    blocks = twin.down_blocks[0]
    assert isinstance(blocks.attentions[0], diffusers.models.Transformer2DModel)
    assert isinstance(blocks.resnets[0], diffusers.models.resnet.ResnetBlock2D)
    assert type(blocks.attentions[0]).__name__ == "DiffusersSpatialTransformer"


def test_fused_paths_keep_the_output_and_every_gradient():
    """Every fused path of the converted UNet on (GroupNorm + SiLU with conv1's bias and the time
    embedding, LayerNorm with the residual adds, GEGLU; Triton kernels interpreted, fp32): the
    original's output and gradients within 1e-4 of each tensor's largest magnitude."""
    model = unet()
    twin, report = converted(model, kernels="groupnorm,layernorm,gelu")
    assert report.kernels and not report.kernels_kept, report.as_dict()
    kinds = {m.fused_kind for m in fused_layers(twin) if m.fused}
    assert kinds == {"groupnorm", "layernorm", "gelu"}
    said = " ".join(report.kernels)
    assert "the convolution's bias and time embedding added in its kernels" in said
    assert_same_function(run(twin, unet_inputs()), run(model, unet_inputs()), FUSED_REL,
                         "sample")


def relative_errors(a, b) -> dict[str, float]:
    """Each tensor's distance to the reference over the reference's norm."""
    (out_a, dx_a, g_a), (out_b, dx_b, g_b) = a, b
    pairs = {"output": (out_a, out_b), "sample gradient": (dx_a, dx_b),
             **{n: (g_a[n], g_b[n]) for n in g_b}}
    return {k: float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-12))
            for k, (x, y) in pairs.items()}


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_bf16_autocast_keeps_the_function(fused):
    """Under CPU bf16 autocast the converted UNet (plain, and fused interpreted) is about as
    close to the fp32 original as the original itself is under bf16: no tensor's relative error
    more than three times the library's own (the fused kernels round to bf16 in other places)
    or 0.1%; the output within 3%."""
    model = unet()
    twin, _ = converted(model, kernels="groupnorm,layernorm,gelu" if fused else "none")
    exact = run(model, unet_inputs())
    ours = relative_errors(run(twin, unet_inputs(), autocast=torch.bfloat16), exact)
    library = relative_errors(run(model, unet_inputs(), autocast=torch.bfloat16), exact)
    worse = {k: (ours[k], library[k]) for k in library if ours[k] > max(3 * library[k], 1e-3)}
    assert not worse, worse
    assert ours["output"] < BF16_REL


def test_vae_encoder_converts_its_resnets_and_keeps_its_latents():
    """The VAE encoder's ResNet blocks (no time embedding) convert; its mid-block attention,
    with its own GroupNorm and residual connection, is another kind of layer, passed over
    without a word; the latents are the original's."""
    torch.manual_seed(0)
    vae = offset(diffusers.AutoencoderKL(**VAE)).eval().requires_grad_(False)
    twin, report = converted(vae.encoder)
    assert report.converted == {"diffusers ResnetBlock2D": 4} and not report.skipped
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(twin(x), vae.encoder(x), PLAIN_REL, "latent moments")


def test_report_counts_the_unet_by_class():
    _, report = converted(unet())
    assert report.converted == {"diffusers ResnetBlock2D": 8, "diffusers Transformer2DModel": 4,
                                "diffusers Upsample2D": 1}
    assert sorted(report.summary().split("; ")) == [
        "diffusers ResnetBlock2D ×8", "diffusers Transformer2DModel ×4", "diffusers Upsample2D ×1"]


def test_state_dicts_round_trip_both_ways():
    """The converted UNet's state dict has the library's keys, shapes and dtypes: it loads into
    an unconverted UNet, and an unconverted one's loads into it, strictly."""
    model = unet()
    twin, _ = converted(model)
    want = model.state_dict()
    got = twin.state_dict()
    assert list(got) == list(want)
    assert all(got[k].shape == v.shape and got[k].dtype == v.dtype for k, v in want.items())
    fresh = unet(seed=5)
    fresh.load_state_dict(got, strict=True)
    other = unet(seed=7)
    twin.load_state_dict(other.state_dict(), strict=True)
    assert all(torch.equal(twin.state_dict()[k], v) for k, v in other.state_dict().items())


def test_parameters_stay_the_same_objects():
    model = unet()
    before = {n: p for n, p in model.named_parameters()}
    convert(model)
    assert {n: p for n, p in model.named_parameters()} == before


# ----------------------------------------------------------------------------- what it does not do

def test_an_unsupported_layout_is_refused_with_its_reason():
    """SD 2's linear projections: the spatial transformer stays diffusers' (with the reason) and
    its transformer blocks convert one by one, computing the same function."""
    model = unet(use_linear_projection=True)
    twin, report = converted(model)
    assert any("diffusers Transformer2DModel at down_blocks.0.attentions.0" in line
               and "not SD v1's layout" in line for line in report.skipped_lines())
    assert report.converted["diffusers BasicTransformerBlock"] == 4
    assert_same_function(run(twin, unet_inputs()), run(model, unet_inputs()), PLAIN_REL,
                         "sample")


@pytest.mark.parametrize("change,reason", [
    (dict(resnet_time_scale_shift="scale_shift"), "time_embedding_norm 'scale_shift'"),
    (dict(dropout=0.1), "dropout inside the block"),
], ids=["scale-shift", "dropout"])
def test_resnets_the_block_does_not_compute_stay_diffusers(change, reason):
    _, report = converted(unet(**change))
    assert "diffusers ResnetBlock2D" not in report.converted
    assert any(reason in line for line in report.skipped_lines()), report.skipped_lines()


def test_calls_the_layers_do_not_compute_go_to_diffusers():
    """A text attention mask, cross-attention kwargs and an upsampler's output_size reach
    diffusers' own forward on the converted modules, with diffusers' results."""
    model = unet()
    twin, _ = converted(model)
    sample, t, text = unet_inputs()
    mask = torch.ones(2, 5)
    mask[0, 3:] = 0
    with torch.no_grad():
        got = twin(sample, t, text, encoder_attention_mask=mask, return_dict=False)[0]
        want = model(sample, t, text, encoder_attention_mask=mask, return_dict=False)[0]
        assert_close(got, want, PLAIN_REL, "masked output")
        x = torch.randn(1, 64, 5, 5)
        up_got = twin.up_blocks[0].upsamplers[0](x, output_size=(11, 11))
        up_want = model.up_blocks[0].upsamplers[0](x, output_size=(11, 11))
        assert up_got.shape == (1, 64, 11, 11)
        assert_close(up_got, up_want, PLAIN_REL, "upsampler with output_size")


def test_resnet_calls_diffusers_only_warns_about_go_to_its_forward_with_one_silu():
    """A ResNet block called with diffusers' deprecated ``scale`` goes to diffusers' forward,
    with the converted norms plain for the call (diffusers applies its own SiLU after each);
    the norms are the converted ones again afterwards."""
    model = unet()
    twin, _ = converted(model, kernels="groupnorm")
    mine, theirs = twin.down_blocks[0].resnets[0], model.down_blocks[0].resnets[0]
    x = torch.randn(2, 32, 8, 8)
    temb = torch.randn(2, mine.time_emb_proj.in_features)
    with torch.no_grad(), pytest.warns(FutureWarning):
        assert_close(mine(x, temb, scale=1.0), theirs(x, temb), PLAIN_REL, "with scale")
    assert mine.norm1.silu and mine.norm2.silu and mine.norm1.fused


class Halving(AttnProcessor2_0):
    """A processor of a user's own: half of plain attention."""

    def __call__(self, *args, **kwargs):
        return 0.5 * super().__call__(*args, **kwargs)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_processor_set_after_converting_is_honoured(fused):
    """set_attn_processor after the conversion: the converted blocks hand their attention to
    diffusers' processor (the output bias added once, also where the fused norms would have
    added it), and give the library model's output with the same processor."""
    model = unet()
    twin, _ = converted(model, kernels="layernorm" if fused else "none")
    for m in (model, twin):
        m.set_attn_processor(Halving())
    with torch.no_grad():
        assert_close(twin(*unet_inputs(), return_dict=False)[0],
                     model(*unet_inputs(), return_dict=False)[0], FUSED_REL, "halved attention")


def test_an_ip_adapters_text_and_image_pair_goes_to_diffusers():
    """An IP adapter's processor takes (text, image embeddings) as encoder_hidden_states: the
    converted spatial transformer hands that call to diffusers and gives its output."""
    model = unet()
    torch.manual_seed(4)
    ip = IPAdapterAttnProcessor2_0(hidden_size=32, cross_attention_dim=32, num_tokens=(4,))
    ours, theirs = converted(model)[0].down_blocks[0].attentions[0], \
        model.down_blocks[0].attentions[0]
    for t in (ours, theirs):
        t.transformer_blocks[0].attn2.set_processor(copy.deepcopy(ip))
    x, text = torch.randn(2, 32, 8, 8), torch.randn(2, 5, 32)
    image = [torch.randn(2, 1, 4, 32)]
    with torch.no_grad():
        got = ours(x, encoder_hidden_states=(text, image), return_dict=False)[0]
        want = theirs(x, encoder_hidden_states=(text, image), return_dict=False)[0]
    assert_close(got, want, PLAIN_REL, "ip adapter")


def test_a_lora_wrapper_added_after_converting_runs_whole_on_the_fused_paths():
    """A layer wrapped after the conversion (the attention's output projection, GEGLU's
    projection): the fused norms and GEGLU kernel leave its bias to it and call it whole, so the
    update is not lost."""
    model = unet()
    twin, _ = converted(model, kernels="layernorm,gelu")
    for m in (model, twin):
        block = m.down_blocks[0].attentions[0].transformer_blocks[0]
        torch.manual_seed(9)
        block.attn1.to_out[0] = LoraLike(block.attn1.to_out[0])
        block.ff.net[0].proj = LoraLike(block.ff.net[0].proj)
    assert_same_function(run(twin, unet_inputs()), run(model, unet_inputs()), FUSED_REL,
                         "sample")


def test_a_failed_numeric_self_check_leaves_the_module_as_it_was(monkeypatch):
    real = diffusers_sd.ResnetBlock.forward

    def off_by_one(self, x, temb=None, emb=None):
        return real(self, x, temb, emb) + 1

    monkeypatch.setattr(diffusers_sd.ResnetBlock, "forward", off_by_one)
    model = unet()
    report = convert(model)
    assert "diffusers ResnetBlock2D" not in report.converted
    assert any("numeric self-check failed (largest difference" in line
               for line in report.skipped_lines())
    assert all(type(r).__name__ == "ResnetBlock2D" for r in model.down_blocks[0].resnets)


# ----------------------------------------------------------------------------- the workload

def test_convert_keeps_the_training_losses():
    """Recipe(convert=True) trains diffusers:sd-v1 with the plain run's losses and says what it
    converted; with the GroupNorm, LayerNorm and GEGLU kernels (interpreted) the losses stay
    within tf32 tolerance."""
    wl = load_workload(SPEC, "tiny")
    plain = train(wl, Recipe(batch=2), steps=2, warmup=0, device="cpu")
    conv = train(wl, Recipe(batch=2, convert=True), steps=2, warmup=0, device="cpu")
    assert conv.losses == pytest.approx(plain.losses, rel=1e-5) and not conv.warnings
    said = conv.applied["convert"]
    assert "diffusers ResnetBlock2D ×12" in said and "diffusers Transformer2DModel ×4" in said
    fused = train(wl, Recipe(batch=2, convert=True, kernels="groupnorm,layernorm,gelu"),
                  steps=2, warmup=0, device="cpu")
    assert compare(fused.losses, plain.losses, "tf32")["passed"], (fused.losses, plain.losses)
    assert "GroupNorm + SiLU in Triton" in fused.applied["kernels"] and not fused.warnings


def test_workload_names_sizes_and_weights(tmp_path):
    """An unknown model and size are one-line errors; weights= checks every key against the
    UNet and loads them exactly."""
    from safetensors.torch import save_file

    with pytest.raises(FasttrainError, match="use diffusers:sd-v1"):
        load_workload("diffusers:sd-v2", "tiny")
    with pytest.raises(FasttrainError, match="sizes tiny and base"):
        load_workload(SPEC, "large")
    wrong = tmp_path / "wrong.safetensors"
    save_file({"not_a_key": torch.zeros(2)}, str(wrong))
    with pytest.raises(FasttrainError, match=r"1 unexpected \(not_a_key\)"):
        load_workload(SPEC, "tiny", weights=str(wrong))
    torch.manual_seed(3)
    ref = diffusers.UNet2DConditionModel(**TINY["unet"])
    good = tmp_path / "unet.safetensors"
    save_file(ref.state_dict(), str(good))
    wl = load_workload(SPEC, "tiny", weights=str(good))
    assert wl.converts and wl.name == SPEC and wl.default_batch == TINY["batch"]
    got = wl.build_model().unet.state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())


def test_the_step_is_the_library_pipeline():
    """The workload's loss is diffusers' text-to-image loss on the same batch, computed with the
    library's calls: ``vae.encode(x).latent_dist`` with the dataset's posterior noise, the text
    model's last hidden state, ``DDPMScheduler.add_noise`` and the UNet."""
    wl = load_workload(SPEC, "tiny")
    torch.manual_seed(0)
    model = wl.build_model().eval()
    ds = wl.dataset()
    batch = wl.collate([ds[0], ds[1]])
    with torch.no_grad():
        got = wl.loss(model, batch)
        torch.manual_seed(0)
        vae = diffusers.AutoencoderKL(**TINY["vae"])
        vae.encoder.load_state_dict(model.vae_encoder.encoder.state_dict())
        vae.quant_conv.load_state_dict(model.vae_encoder.quant_conv.state_dict())
        x = batch["images"].permute(0, 3, 1, 2).float() / 127.5 - 1
        dist = vae.encode(x).latent_dist
        latents = (dist.mean + dist.std * batch["posterior_noise"]) * 0.18215
        context = model.text_encoder.text(batch["input_ids"]).last_hidden_state
        scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear",
                                            beta_start=0.00085, beta_end=0.012)
        noisy = scheduler.add_noise(latents, batch["noise"], batch["timesteps"])
        pred = model.unet(noisy, batch["timesteps"], context).sample
        want = ((pred - batch["noise"]) ** 2).mean(dim=(1, 2, 3)).sum()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)


def test_peer_and_ladder_of_the_workload():
    """The peer of diffusers:sd-v1 trains the same public classes; the workload's ladder
    converts right before compiling."""
    row = run_peer(SPEC, size="tiny", steps=1, warmup=0, device="cpu")
    assert row["error"] is None and row["workload"] == SPEC
    assert row["peer"].startswith("diffusers:UNet2DConditionModel(SD-v1)")
    assert all(math.isfinite(x) for x in row["losses"])
    ladder = build_ladder(load_workload(SPEC, "tiny"), None, Recipe())
    names = [rung.name for rung, _ in ladder]
    assert names.index("convert") + 1 == names.index("compile")
