"""stream_dtype=bf16: the residual stream of ViT, Swin and Llama in bf16 under bf16-mixed (CPU)."""
import pytest
import torch

from fasttrain.errors import FasttrainError
from fasttrain.recipe import Recipe
from fasttrain.run.loop import prepare, train
from fasttrain.workloads import load_workload

CPU = torch.device("cpu")


def _stream_dtypes(workload: str, recipe: Recipe) -> tuple[set[torch.dtype], set[torch.dtype]]:
    """The dtypes of the tensors entering the blocks' residual adds, forward and backward: each
    block's input and the gradient that arrives at it."""
    wl = load_workload(workload, "tiny")
    state, ds, _ = prepare(wl, recipe, CPU)
    blocks = list(wl.regional_blocks(state.model))
    fwd, bwd = set(), set()

    def pre(_m, args):
        x = args[0]
        fwd.add(x.dtype)
        if x.requires_grad:
            x.register_hook(lambda g: bwd.add(g.dtype))

    for b in blocks:
        b.register_forward_pre_hook(pre)
    batch = wl.collate([ds[i] for i in range(2)])
    try:
        with state.step_context():
            loss = wl.loss(state.model, batch)
        loss.backward()
    finally:
        state.restore.close()  # the global flags the techniques set, as train() restores them
    return fwd, bwd


@pytest.mark.parametrize("workload, kernels", [("vit", "none"), ("vit", "layernorm"),
                                              ("llama", "none"), ("llama", "rmsnorm")])
def test_the_stream_is_bf16_both_ways_only_when_asked(workload, kernels):
    base = Recipe(precision="bf16-mixed", batch=2, kernels=kernels)
    assert _stream_dtypes(workload, base) == ({torch.float32}, {torch.float32})
    assert _stream_dtypes(workload, base.replace(stream_dtype="bf16")) == (
        {torch.bfloat16}, {torch.bfloat16})


def test_swin_starts_its_stream_in_bf16():
    fwd, bwd = _stream_dtypes("swin", Recipe(precision="bf16-mixed", batch=2,
                                             stream_dtype="bf16"))
    assert fwd == {torch.bfloat16} and bwd == {torch.bfloat16}


@pytest.mark.parametrize("workload", ["vit", "swin", "llama"])
def test_a_bf16_stream_keeps_the_loss_within_bf16_rounding_and_says_so(workload):
    wl = load_workload(workload, "tiny")
    base = Recipe(precision="bf16-mixed", batch=2,
                  kernels="rmsnorm" if workload == "llama" else "layernorm")
    plain = train(wl, base, steps=3, warmup=0, device="cpu")
    ours = train(wl, base.replace(stream_dtype="bf16"), steps=3, warmup=0, device="cpu")
    assert ours.losses == pytest.approx(plain.losses, rel=2e-2)
    model = {"vit": "ViT", "swin": "Swin", "llama": "Llama"}[workload]
    assert ours.applied["stream_dtype"].startswith(f"the residual stream of {model} in bf16")
    assert not ours.warnings


def test_a_model_without_a_stream_switch_says_nothing_changed():
    res = train(load_workload("sd", "tiny"), Recipe(precision="bf16-mixed", stream_dtype="bf16"),
                steps=1, warmup=0)
    assert "stream_dtype" not in res.applied
    assert any(w.startswith("stream_dtype: SDTrainStep has no residual stream")
               for w in res.warnings)


def test_bf16_true_is_bf16_already_and_other_precisions_are_refused():
    res = train(load_workload("vit", "tiny"), Recipe(precision="bf16-true", stream_dtype="bf16"),
                steps=1, warmup=0)
    assert any("bf16 already" in w for w in res.warnings)
    with pytest.raises(FasttrainError, match="stream_dtype=bf16 needs precision=bf16-mixed"):
        Recipe(precision="fp32", stream_dtype="bf16")
    with pytest.raises(FasttrainError, match="stream_dtype='fp16' is not one of auto, bf16"):
        Recipe(precision="bf16-mixed", stream_dtype="fp16")


@pytest.mark.gpu
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

