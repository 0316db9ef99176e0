"""The converters on CUDA (marker ``gpu``; skipped without a GPU): timm's ViT and Swin, a
transformers Llama and diffusers' SD v1, converted with every fused path as compiled Triton kernels (the CPU tests
interpret them), keep the unconverted model's outputs and gradients, and train through fasttrain
(bf16 autocast, compile, and the presets' switches) with its losses, within bf16's tolerance.
The GPU machine has timm with its torchvision and transformers (diffusers from the peer wheels);
elsewhere these skip."""
import copy

import pytest
import torch

from fasttrain.recipe import Recipe
from fasttrain.run.loop import train
from fasttrain.workloads import load_workload

pytestmark = pytest.mark.gpu

MODELS = {  # workload → (library to import, what the kernels line must name)
    "timm:vit_base_patch16_224": ("timm", "self-attention"),
    "timm:swin_base_patch4_window7_224": ("timm", "window attention"),
    "hf:llama": ("transformers", "RMSNorm"),
    "diffusers:sd-v1": ("diffusers", "GroupNorm + SiLU"),
}


# compiled whole, as its H100 ladder rows show and the CPU shows with every kernel (its attention
# layers once broke the graph in every layer, reading SDPA's flash flag through a wrapper that
# Dynamo did not fold: on CUDA only)
ONE_GRAPH = {"hf:llama"}


def _workload(spec: str):
    pytest.importorskip(MODELS[spec][0])
    torch._dynamo.reset()  # earlier tests' compiled code must not make these shapes dynamic
    return load_workload(spec, "tiny")


def _converted_pair(spec: str):
    """The tiny workload, its model on CUDA, a copy converted with every fused kernel, and a
    batch of two on CUDA."""
    import fasttrain

    wl = _workload(spec)
    torch.manual_seed(0)
    with torch.device("cuda"):
        original = wl.build_model()
    converted = copy.deepcopy(original)
    report = fasttrain.convert(converted, kernels="fused")
    assert report and report.kernels and report.kernels_kept is None, report.summary()
    batch = wl.collate([wl.dataset()[i] for i in range(2)])
    return wl, original, converted, {k: v.cuda() for k, v in batch.items()}


def _assert_close_rel(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=rel,
                               atol=rel * max(want.abs().max().item(), 1e-6))


@pytest.mark.parametrize("spec", sorted(set(MODELS) - {"diffusers:sd-v1"}))
def test_converted_model_keeps_outputs_and_gradients_with_fused_kernels(spec):
    """fasttrain.convert(model, kernels="fused") on CUDA: the loss and every parameter's gradient
    of one bf16-autocast step agree with the unconverted model's to 2% of their largest value."""
    wl, original, converted, batch = _converted_pair(spec)
    losses = []
    for model in (original, converted):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = wl.loss(model, batch)
        loss.backward()
        losses.append(loss.detach())
    _assert_close_rel(losses[1], losses[0], 2e-2)
    for (name, a), b in zip(original.named_parameters(), converted.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            _assert_close_rel(b.grad, a.grad, 5e-2)


def _loss_and_grads(wl, model, batch, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = wl.loss(model, batch)
    loss.backward()
    return {"loss": loss.detach().reshape(1), **{n: p.grad for n, p in model.named_parameters()
                                                  if p.grad is not None}}


def test_converted_sd_keeps_the_function_with_fused_kernels():
    """diffusers' SD v1 (tiny) converted with every fused kernel compiled, one bf16-autocast
    step: the loss and each gradient are about as close to the fp32 step's as the library's own
    bf16 step is (relative distance at most three times the library's, or 0.1%; the fused
    kernels round to bf16 in other places), the loss within 2%."""
    wl, original, converted, batch = _converted_pair("diffusers:sd-v1")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        exact = _loss_and_grads(wl, original, batch, autocast=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    library = _loss_and_grads(wl, original, batch, autocast=True)
    ours = _loss_and_grads(wl, converted, batch, autocast=True)
    assert ours.keys() == exact.keys()

    def dist(a):
        return {k: float((a[k].float() - v.float()).norm() / v.float().norm().clamp_min(1e-12))
                for k, v in exact.items()}
    d_ours, d_lib = dist(ours), dist(library)
    worse = {k: (d_ours[k], d_lib[k]) for k in exact if d_ours[k] > max(3 * d_lib[k], 1e-3)}
    assert not worse, worse
    assert d_ours["loss"] < 2e-2


@pytest.mark.parametrize("spec", sorted(MODELS))
def test_converted_public_models_train_with_the_plain_losses_on_cuda(spec):
    """convert + every fused kernel, compiled, trains the tiny public model with the losses of the
    same model unconverted; the kernels line names the model's fused attention or norm, and
    neither switch warns."""
    wl = _workload(spec)
    base = Recipe(precision="bf16-mixed", attention="auto", compile="model")
    plain = train(wl, base, steps=4, warmup=0, device="cuda")
    torch._dynamo.reset()
    fused = train(wl, base.replace(convert=True, kernels="fused"), steps=4, warmup=0,
                  device="cuda")
    assert MODELS[spec][1] in fused.applied["kernels"], fused.applied
    assert not [w for w in fused.warnings if w.startswith(("convert", "kernels"))], fused.warnings
    if spec in ONE_GRAPH:  # a break makes the gradients that cross it contiguous copies
        assert fused.compile["graph_breaks"] == 0, fused.compile
    torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(plain.losses),
                               rtol=2e-2, atol=0)


def test_converted_vit_under_the_preset_switches():
    """The timm ViT under the ViT preset's switches (bf16 stream, bf16 master weights in the
    one-launch AdamW, CUDA graph of the whole step): the converted blocks carry the stream, the
    fused paths' biases stay fp32, and the losses are the plain compiled run's."""
    wl = _workload("timm:vit_base_patch16_224")
    base = Recipe(precision="bf16-mixed", attention="auto", compile="model")
    plain = train(wl, base, steps=4, warmup=4, device="cuda")  # the graphed step's warm-up
    torch._dynamo.reset()
    preset = base.replace(convert=True, kernels="gelu,layernorm,patch,attention",
                          stream_dtype="bf16", optimizer_impl="triton", master_weights=True,
                          cuda_graphs=True)
    res = train(wl, preset, steps=4, warmup=4, device="cuda")
    assert "ChainedBlocks" in res.applied["stream_dtype"]
    assert "cuda_graphs" in res.applied, res.applied
    assert not [w for w in res.warnings
                if w.startswith(("convert", "kernels", "stream_dtype", "optimizer"))], res.warnings
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(plain.losses),
                               rtol=3e-2, atol=0)


def test_converted_sd_under_the_preset_switches():
    """diffusers' SD v1 (tiny) under the SD preset's switches (regional compile, CUDA graph of
    the whole step, bf16 master weights in the one-launch AdamW, side-stream EMA, channels-last,
    the GroupNorm, GEGLU, LayerNorm and narrow-convolution kernels): the losses are the plain
    compiled run's, and no switch warns."""
    wl = _workload("diffusers:sd-v1")
    base = Recipe(precision="bf16-mixed", attention="auto", compile="regional")
    plain = train(wl, base, steps=4, warmup=4, device="cuda")
    torch._dynamo.reset()
    preset = base.replace(convert=True, kernels="groupnorm,gelu,layernorm,conv",
                          optimizer_impl="triton", master_weights=True, ema="side-stream",
                          channels_last=True, cuda_graphs=True)
    res = train(wl, preset, steps=4, warmup=4, device="cuda")
    assert "cuda_graphs" in res.applied and "GroupNorm + SiLU" in res.applied["kernels"]
    assert not [w for w in res.warnings
                if w.startswith(("convert", "kernels", "optimizer", "cuda_graphs"))], res.warnings
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(plain.losses),
                               rtol=3e-2, atol=0)
