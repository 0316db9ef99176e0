"""The training loop on CUDA (marker ``gpu``; skipped without a GPU): the graphed step, fp16
with its GradScaler and peak memory, and the device prefetchers of fasttrain.run.data."""
import pytest
import torch

from fasttrain.recipe import Recipe
from fasttrain.run.loop import train
from fasttrain.workloads import load_workload


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_fp16_gradscaler_and_peak_memory_on_cuda():
    res = train(load_workload("vit", "tiny"), Recipe(precision="fp16-mixed"), steps=3, warmup=1,
                device="cuda")
    assert res.peak_allocated_gib > 0 and res.peak_reserved_gib >= res.peak_allocated_gib
    assert all(torch.isfinite(torch.tensor(res.losses)))
    assert res.skipped_steps is not None and len(res.scaler_skips) == res.skipped_steps


@pytest.mark.gpu
def test_device_prefetch_gives_the_same_batches():
    wl = load_workload("vit", "tiny")
    base = Recipe(workers=2, pin_memory=True, non_blocking=True, batch=8, accumulation=2)
    plain = train(wl, base, steps=5, warmup=1, device="cuda")
    pre = train(wl, base.replace(device_prefetch=True), steps=5, warmup=1, device="cuda")
    assert "side stream" in pre.applied["dataloader"]
    assert pre.losses == plain.losses


@pytest.mark.gpu
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

