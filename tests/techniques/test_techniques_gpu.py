"""Techniques on CUDA (marker ``gpu``; skipped without a GPU): the side-stream EMA, flash
attention, PDL and combo kernels. Their CPU side is in test_techniques.py."""
import pytest
import torch

from fasttrain.recipe import Recipe
from fasttrain.run.loop import train
from fasttrain.techniques.ema import Ema
from fasttrain.workloads import load_workload


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_flash_attention_runs_on_cuda_and_math_is_reported():
    wl = load_workload("llama", "tiny")
    res = train(wl, Recipe(precision="bf16-mixed", attention="flash"), steps=1, warmup=0,
                device="cuda")
    assert "ran flash" in res.applied["attention"] and not res.warnings
    wl = load_workload("swin", "tiny")  # an additive bias: flash cannot take it
    res = train(wl, Recipe(precision="bf16-mixed", attention="flash"), steps=1, warmup=0,
                device="cuda")
    assert "fell back to math" in res.applied["attention"]


@pytest.mark.gpu
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

