"""Memory techniques, the batch-size finder and the memory ladder (CPU)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fasttrain.errors import FasttrainError
from fasttrain.fit.search import FitSpec, fit, persistent_estimate
from fasttrain.ladder.rungs import build_ladder
from fasttrain.profile.memory import persistent_split
from fasttrain.recipe import Recipe
from fasttrain.run.loop import prepare, train
from fasttrain.workloads import load_workload

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.mark.parametrize("workload", ["vit", "swin", "llama", "sd"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_keeps_the_loss_bit_for_bit(workload, mode):
    wl = load_workload(workload, "tiny")
    ref = train(wl, Recipe(), steps=3, warmup=0)
    ck = train(wl, Recipe(checkpointing=mode), steps=3, warmup=0)
    assert ck.losses == ref.losses and "checkpointing" in ck.applied


def _retained_bytes(recipe: Recipe) -> int:
    """Bytes still allocated after one forward: what the backward will need (CPU profiler)."""
    from torch.profiler import ProfilerActivity, profile

    wl = load_workload("vit", "tiny")
    state, ds, _ = prepare(wl, recipe, CPU)
    batch = wl.collate([ds[i] for i in range(8)])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with state.step_context():
            loss = wl.loss(state.model, batch)
    del loss
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None)


def test_checkpointing_saves_fewer_activations():
    none, sel, full = (_retained_bytes(Recipe(checkpointing=m)) for m in ("none", "selective", "full"))
    assert full < sel < none


def test_init_on_device_keeps_the_loss_bit_for_bit_on_cpu():
    wl = load_workload("llama", "tiny")
    host = train(wl, Recipe(init="host"), steps=3, warmup=0)
    dev = train(wl, Recipe(init="device"), steps=3, warmup=0)
    assert host.losses == dev.losses and "directly" in dev.applied["init"]


def test_bf16_true_built_directly_in_bf16():
    state, _, _ = prepare(load_workload("vit", "tiny"), Recipe(precision="bf16-true"), CPU)
    assert {p.dtype for p in state.model.parameters()} == {torch.bfloat16}


def test_offload_equals_the_on_device_optimizer():
    wl = load_workload("vit", "tiny")
    ref = train(wl, Recipe(), steps=4, warmup=0)
    off = train(wl, Recipe(offload="optimizer"), steps=4, warmup=0)
    torch.testing.assert_close(torch.tensor(off.losses), torch.tensor(ref.losses), rtol=1e-6, atol=0)


def test_master_weights_keep_updates_that_bf16_rounds_away():
    wl = load_workload("vit", "tiny")
    r = Recipe(precision="bf16-true", lr=1e-6, weight_decay=0.0)
    plain, _, _ = prepare(wl, r, CPU)
    master, _, _ = prepare(wl, r.replace(master_weights=True), CPU)
    for state in (plain, master):
        w = state.model.head.weight
        before = w.detach().clone()
        for _ in range(3):
            w.grad = torch.ones_like(w)
            state.optimizer.step()
        state.moved = (w.detach() != before).float().mean().item()
    shadow = master.optimizer.shadow
    assert plain.moved < 0.05  # lr·1 is far below bf16's spacing near these weights
    assert any((s - s.detach().to(torch.bfloat16).float()).abs().max() > 0 for s in shadow)


def test_sgd_keeps_half_the_optimizer_state_of_adamw():
    def state_bytes(recipe):
        wl = load_workload("llama", "tiny")
        res = train(wl, recipe, steps=1, warmup=0)
        state, _, _ = prepare(wl, recipe, CPU)
        for p in state.trainable.parameters():
            p.grad = torch.zeros_like(p)
        state.optimizer.step()
        return persistent_split(state)["optimizer_state"], res
    adam, _ = state_bytes(Recipe())
    sgd, _ = state_bytes(Recipe(optimizer="sgd"))
    assert sgd <= adam / 2 + 1024


def test_cosine_schedule_reaches_zero_at_the_last_step():
    wl = load_workload("vit", "tiny")
    state, _, _ = prepare(wl, Recipe(schedule="cosine"), CPU, total_steps=5)
    for _ in range(5):
        state.optimizer.step()
        state.scheduler.step()
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_expandable_segments_go_into_the_child_environment():
    from fasttrain.techniques.allocator import child_env

    assert child_env(Recipe(allocator="expandable")) == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert child_env(Recipe()) == {}


def test_persistent_estimate_counts_optimizer_state_by_recipe():
    adam = persistent_estimate(FitSpec("llama", "tiny", Recipe()))
    sgd = persistent_estimate(FitSpec("llama", "tiny", Recipe(optimizer="sgd")))
    off = persistent_estimate(FitSpec("llama", "tiny", Recipe(offload="optimizer")))
    bf16 = persistent_estimate(FitSpec("llama", "tiny", Recipe(optimizer_impl="triton",
                                                               optimizer_state="bf16")))
    assert adam["optimizer_state"] == pytest.approx(2 * sgd["optimizer_state"])
    assert bf16["optimizer_state"] == pytest.approx(sgd["optimizer_state"])  # 2 x 2 bytes
    assert off["optimizer_state"] == 0 and adam["parameters"] > 0


@pytest.mark.slow
def test_fit_answer_survives_the_full_step_in_a_fresh_process():
    from fasttrain.fit.search import Search

    # On CPU the budget is the process's resident set, which depends on the environment: set it
    # a little above what this machine's smallest trial measures.
    base = Search(FitSpec("vit", "tiny", Recipe(), "cpu", max_batch=64), Recipe(), None).trial(1)
    trials = []
    spec = FitSpec("vit", "tiny", Recipe(), "cpu", budget_gib=(base["peak_gib"] + 0.15) / 0.95,
                   max_batch=64)
    ans = fit(spec, on_trial=trials.append)
    assert ans["verified"] and ans["passed"] and ans["eval_and_save"]
    assert ans["eval_and_save_step_s"] > 0  # timed apart from the training steps
    assert ans["batch"] == max(t["batch"] for t in trials if t["passed"])
    assert all(not t["passed"] for t in trials if t["batch"] > ans["batch"])


def test_an_impossible_budget_is_one_clear_line():
    with pytest.raises(FasttrainError, match="even batch 1 does not fit"):
        fit(FitSpec("vit", "tiny", Recipe(), "cpu", budget_gib=0.05, max_batch=8))
    proc = subprocess.run([sys.executable, "-m", "fasttrain", "fit", "vit", "--device", "cpu",
                           "--memory-budget", "0.05"], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin",
                               "HOME": str(Path.home())}, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("USDT")]
    assert proc.returncode == 2 and len(lines) == 1 and "does not fit" in lines[0]


def test_memory_ladder_rungs_and_parity_references():
    ladder = build_ladder(load_workload("vit", "tiny"), ["memory"], Recipe())
    names = [r.name for r, _ in ladder]
    assert names == ["fp32", "bf16-mixed", "bf16-true", "micro-batches", "sgd", "init-device",
                     "checkpointing", "offload"]
    last = ladder[-1][1]
    assert (last.precision, last.accumulation, last.optimizer, last.init, last.checkpointing,
            last.offload) == ("bf16-true", 4, "sgd", "device", "full", "optimizer")
    assert {r.name: r.parity for r, _ in ladder}["checkpointing"] == "previous"


@pytest.mark.slow
def test_memory_ladder_end_to_end(tmp_path):
    from fasttrain.ladder.runner import LadderSpec, run_ladder

    rows = run_ladder(LadderSpec(workload="vit", size="tiny", rungs=["memory"], steps=2, warmup=1,
                                 device="cpu", out=tmp_path / "rows.jsonl"))
    by = {r["rung"]: r for r in rows}
    assert all(r["error"] is None for r in rows)
    assert by["sgd"]["parity"]["passed"] is None and "different optimizer" in by["sgd"]["parity"]["reason"]
    assert by["checkpointing"]["parity"] == {**by["checkpointing"]["parity"], "passed": True,
                                             "against": "init-device"}


class _FakeSearch:
    """Search.largest with trials answered by a rule instead of processes."""

    def __init__(self, k, max_batch, fits):
        from fasttrain.fit.search import Search

        self.s = Search.__new__(Search)
        self.s.spec = FitSpec("vit", "tiny", Recipe(), "cpu", budget_gib=1.0, max_batch=max_batch)
        self.s.recipe = Recipe(accumulation=k, batch=k)
        self.s.trials = []
        self.s.trial = lambda b: self.s.trials.append(b) or {"batch": b, "passed": fits(b)}


@pytest.mark.parametrize("k, max_batch, limit, start, want", [
    (3, 10, 10**9, 3, 9),        # everything fits, max_batch not a multiple of k: stops at 9
    (1, 4096, 10**9, 1, 4096),
    (1, 4096, 37, 1000, 37),     # the estimate was too high: shrink, then bisect
    (4, 4096, 50, 4, 48),
    (2, 64, 1, 2, None),         # nothing fits
])
def test_search_brackets_and_bisects_without_looping(k, max_batch, limit, start, want):
    fake = _FakeSearch(k, max_batch, lambda b: b <= limit)
    found = fake.s.largest(start)
    assert (found["batch"] if found else None) == want
    assert len(fake.s.trials) < 30 and all(b % k == 0 for b in fake.s.trials)


def test_ema_of_bf16_weights_is_kept_in_fp32():
    from fasttrain.techniques.ema import Ema

    p = torch.full((4,), 0.02, dtype=torch.bfloat16)
    ema = Ema([p], 0.9999, "foreach")
    p.fill_(0.03)
    for _ in range(1000):
        ema.update()
    assert ema.shadow[0].dtype == torch.float32 and ema.shadow[0][0].item() > 0.0209


def test_search_respects_multiple_of():
    fake = _FakeSearch(1, 4096, lambda b: b <= 1000)
    fake.s.spec.multiple_of = 8
    found = fake.s.largest(600)
    assert found["batch"] == 1000 and all(b % 8 == 0 for b in fake.s.trials)
    assert len(fake.s.trials) <= 10
