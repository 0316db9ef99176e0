"""fasttrain profile: the breakdown, the instruments, and each advisor rule (trigger vs clean)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fasttrain.profile.advisor import RULES, advise, suggest_recipe
from fasttrain.profile.kernels import _union_length, categorize
from fasttrain.profile.memory import growth_per_step
from fasttrain.profile.runner import run_profile
from fasttrain.recipe import Recipe, load_toml
from fasttrain.workloads import load_workload
from tests.helpers import slow_data_workload

ROOT = Path(__file__).resolve().parents[2]


def _rules(p, recipe):
    return {f.rule for f in advise(p, recipe)}


def test_sd_breakdown_has_the_source_table_parts_and_sums_to_the_step(tmp_path):
    p = run_profile(load_workload("sd", "tiny"), Recipe(), "cpu", steps=3, warmup=1, active=1,
                    trace_dir=tmp_path)
    parts = [r["part"] for r in p["breakdown"]]
    for want in ("vae_encoder fwd", "text_encoder fwd", "unet fwd", "unet bwd", "clip",
                 "optimizer", "ema"):
        assert want in parts, parts
    # small rests go into "other (unattributed)": the rows add up to the step they claim
    assert sum(r["share"] for r in p["breakdown"]) == pytest.approx(1.0, rel=1e-9)
    assert p["profiling_overhead"] >= 0
    trace = p["kernels"]["trace"]
    assert Path(trace["path"]).exists() and trace["mb"] < 5
    assert p["memory"]["persistent_mib"]["optimizer_state"] > 0


def test_compiled_runs_report_phases_and_say_why_modules_are_missing():
    p = run_profile(load_workload("vit", "tiny"), Recipe(compile="model", compile_backend="eager"),
                    "cpu", steps=2, warmup=1, active=1)
    assert "eager forward" in p["modules_note"] and p["profiling_overhead"] is None
    assert "not_compiled" not in {f["rule"] for f in p["findings"]}


def test_data_wait_rule_on_a_data_bound_workload_and_not_on_a_clean_one():
    slow = run_profile(slow_data_workload(), Recipe(), "cpu", steps=3, warmup=1, active=1)
    data = [f for f in slow["findings"] if f["rule"] == "data_wait"]
    assert data and data[0]["switch"]["workers"] >= 1 and "data wait" in data[0]["evidence"]
    assert "pin_memory" not in data[0]["switch"]  # a CUDA copies' switch: not on a CPU
    # token windows from a memmap cost far less than a step of the model
    clean = run_profile(load_workload("llama", "tiny"), Recipe(), "cpu", steps=3, warmup=1,
                        active=1)
    assert "data_wait" not in {f["rule"] for f in clean["findings"]}


def test_optimizer_rule_fires_for_the_for_loop_and_not_for_fused_or_one_launch():
    from fasttrain.profile.advisor import optimizer_unfused

    wl = load_workload("llama", "tiny")
    loop = run_profile(wl, Recipe(), "cpu", steps=3, warmup=1, active=1)
    fused = run_profile(wl, Recipe(optimizer_impl="fused"), "cpu", steps=3, warmup=1, active=1)
    assert "optimizer_unfused" in {f["rule"] for f in loop["findings"]}
    assert "optimizer_unfused" not in {f["rule"] for f in fused["findings"]}
    # the same profile, read as a one-launch AdamW's: switching to fused would be slower
    assert optimizer_unfused(loop, Recipe()) is not None
    assert optimizer_unfused(loop, Recipe(optimizer_impl="triton")) is None


# GPU-only measurements (kernel shares, idle time, allocator counters) as the profiler reports
# them; the rules read these fields, so each is checked against a triggering and a clean profile.
BASE = {"device": "cuda", "step_time_s": 0.1, "phases_s": {"forward": 0.04, "backward": 0.05,
        "optimizer": 0.001, "data": 0.0}, "applied": {}, "attention": "ran flash x24",
        "kernels": {"share": {"gemm": 0.7, "attention": 0.1, "elementwise": 0.05},
                    "idle_fraction": 0.02, "launches_per_step": 400},
        "memory": {"cuda_malloc_per_step": 0.0, "reserved_pattern": "flat",
                   "growth_mib_per_step": 0.0}}
FAST = Recipe(precision="bf16-mixed", optimizer_impl="fused", attention="auto", compile="model")


def _with(**changes):
    p = json.loads(json.dumps(BASE))
    for path, value in changes.items():
        node, keys = p, path.split("__")
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return p


@pytest.mark.parametrize("rule, triggering, recipe", [
    ("attention_math", _with(attention="ran math x24; fell back to math: attn_mask not supported"), FAST),
    ("precision", BASE, Recipe(precision="tf32")),
    ("ema_per_tensor", _with(phases_s__ema=0.01, applied__ema="EMA per-tensor over 686 tensors"), FAST),
    ("not_compiled", _with(kernels__share__elementwise=0.3), FAST.replace(compile="none")),
    ("launch_bound", _with(kernels__idle_fraction=0.3, kernels__launches_per_step=3000), FAST),
    ("allocator_churn", _with(memory__cuda_malloc_per_step=40.0, memory__reserved_pattern="saw-tooth"), FAST),
    ("memory_growth", _with(memory__growth_mib_per_step=12.0), FAST),
    ("dtype_casts", _with(kernels__casts={"per_step": 277, "ms_per_step": 0.65, "share": 0.029}),
     FAST),
    ("graph_memsets", _with(kernels__memsets_per_step=265), FAST.replace(cuda_graphs=True)),
    ("optimizer_moments", _with(kernels__share__optimizer=0.088),
     FAST.replace(optimizer_impl="triton")),
    ("graph_breaks", {**BASE, "compile": {"graph_breaks": 8, "unique_graphs": 10}}, FAST),
])
def test_gpu_rules_trigger_on_their_measurement_and_stay_quiet_on_a_clean_profile(rule, triggering, recipe):
    assert rule in _rules(triggering, recipe)
    assert _rules(BASE, FAST) == set()


def test_every_rule_is_covered_above():
    assert len(RULES) == 13


def test_graph_breaks_rule_cites_the_most_frequent_reason():
    p = {**BASE, "compile": {"graph_breaks": 8, "unique_graphs": 10, "break_reasons": {
        "torch.* op returned non-Tensor\n  Explanation: ...": 16, "other": 2}}}
    found = {f.rule: f for f in advise(p, FAST)}["graph_breaks"]
    assert found.evidence == ("8 graph breaks, 10 graphs under compile=model; the most "
                              "frequent (16x): torch.* op returned non-Tensor")
    assert found.switch == {} and found.gain == 0.0
    assert "graph_breaks" not in _rules(p, FAST.replace(compile="none"))
    assert "graph_breaks" not in _rules({**BASE, "compile": {"graph_breaks": 0}}, FAST)


def test_moments_rule_only_for_fp32_moments_of_the_one_launch_adamw():
    p = _with(kernels__share__optimizer=0.088, kernels__gpu_ms_per_step={"optimizer": 11.8})
    one_launch = FAST.replace(optimizer_impl="triton")
    found = {f.rule: f for f in advise(p, one_launch)}["optimizer_moments"]
    assert found.evidence.startswith("the one-launch AdamW 8.8% of GPU time (11.8 ms)")
    assert found.gain == pytest.approx(0.088 * 8 / 28)
    assert suggest_recipe(one_launch, [found]).optimizer_state == "bf16"
    for r in (FAST, one_launch.replace(optimizer_state="bf16")):  # PyTorch's AdamW; done
        assert "optimizer_moments" not in _rules(p, r)
    assert "optimizer_moments" not in _rules(_with(kernels__share__optimizer=0.02), one_launch)


def test_graph_memsets_rule_only_for_a_captured_step_without_the_switch():
    p = _with(kernels__memsets_per_step=265, step_time_s=0.08)
    graphed = FAST.replace(cuda_graphs=True)
    found = {f.rule: f for f in advise(p, graphed)}["graph_memsets"]
    assert found.evidence.startswith("265 memsets a step inside the captured graph")
    assert found.gain == pytest.approx(265 * 1.5e-6 / 0.08)
    assert suggest_recipe(graphed, [found]).graph_memset_kernels
    for r in (FAST, graphed.replace(graph_memset_kernels=True)):  # not captured; already on
        assert "graph_memsets" not in _rules(p, r)
    assert "graph_memsets" not in _rules(_with(kernels__memsets_per_step=20), graphed)


def test_dtype_casts_rule_suggests_master_weights_only_where_they_can_run():
    p = _with(kernels__casts={"per_step": 610, "ms_per_step": 3.9, "share": 0.042})
    found = {f.rule: f for f in advise(p, FAST)}["dtype_casts"]
    assert "610 dtype-cast kernels a step, 3.90 ms (4.2% of GPU time)" in found.evidence
    assert suggest_recipe(FAST, [found]).master_weights
    for r in (FAST.replace(precision="fp16-mixed"), FAST.replace(accumulation=2),
              FAST.replace(optimizer_impl="triton", master_weights=True),
              FAST.replace(sharding="zero2")):
        assert "dtype_casts" not in _rules(p, r)


def test_churn_with_expandable_segments_is_not_reported_again():
    p = _with(memory__cuda_malloc_per_step=40.0, memory__expandable_segments=True)
    assert "allocator_churn" not in _rules(p, FAST)


def test_findings_rank_by_gain_and_cite_numbers():
    p = _with(phases_s__data=0.03, kernels__idle_fraction=0.3, kernels__launches_per_step=3000)
    found = advise(p, FAST)
    assert [f.gain for f in found] == sorted((f.gain for f in found), reverse=True)
    assert all(any(ch.isdigit() for ch in f.evidence) for f in found)


def test_suggested_recipe_applies_switches_and_stays_valid():
    p = _with(phases_s__data=0.03, kernels__idle_fraction=0.3, kernels__launches_per_step=3000)
    r = suggest_recipe(Recipe(precision="tf32"), advise(p, Recipe(precision="tf32")))
    assert r.workers >= 1 and r.precision == "bf16-mixed" and r.cuda_graphs is True
    # GradScaler cannot be captured: fp16 keeps its precision and gets no CUDA graphs
    r = suggest_recipe(Recipe(precision="fp16-mixed"), advise(p, Recipe(precision="fp16-mixed")))
    assert r.workers >= 1 and r.precision == "fp16-mixed" and not r.cuda_graphs


def test_kernel_categories_and_busy_union():
    assert categorize("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert categorize("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert categorize("void at::native::(anonymous namespace)::multi_tensor_apply_kernel") == "optimizer"
    assert categorize("triton_poi_fused_add_mul_0") == "elementwise"
    assert categorize("triton_red_fused_native_layer_norm_1") == "norm/reduction"
    assert categorize("Memcpy HtoD (Pinned -> Device)") == "memcpy"
    assert categorize("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert _union_length([(0, 10), (5, 12), (20, 25)]) == 17


def test_growth_per_step_is_the_slope():
    assert growth_per_step([100, 110, 120, 130]) == pytest.approx(10)
    assert growth_per_step([100, 100, 100]) == 0


@pytest.mark.slow
def test_cli_profile_suggests_a_recipe_that_the_ladder_measures(tmp_path):
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"}
    import os
    env = {**os.environ, **env}
    toml = tmp_path / "suggested.toml"
    prof = subprocess.run([sys.executable, "-m", "fasttrain", "profile", "vit", "--device", "cpu",
                           "--steps", "3", "--warmup", "1", "--active", "1", "--out",
                           str(tmp_path), "--suggest-recipe", str(toml)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert prof.returncode == 0, prof.stderr[-2000:]
    assert "advisor" in prof.stdout and toml.exists()
    suggested = load_toml(toml)
    assert suggested.optimizer_impl == "fused"
    lad = subprocess.run([sys.executable, "-m", "fasttrain", "ladder", "vit", "--device", "cpu",
                          "--recipe", str(toml), "--set", "compile_backend=aot_eager",
                          "--steps", "3", "--warmup", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=400)
    assert lad.returncode == 0, lad.stderr[-2000:]
    rows = [json.loads(x) for f in tmp_path.glob("ladder-*.jsonl") for x in f.read_text().splitlines()]
    assert [r["rung"] for r in rows] == ["fp32", "suggested"] and rows[1]["parity"]["passed"]


def test_kernel_view_leaves_out_annotation_spans_and_counts_optimizer_spans(tmp_path):
    """A saved trace: annotations mirrored on the GPU are spans, not kernels; a plain
    elementwise kernel inside ``Optimizer.step`` is optimizer work (for-loop AdamW)."""
    import gzip

    from fasttrain.profile.kernels import summary_from_trace

    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [x("gpu_user_annotation", "phase:forward", 0, 100),
              x("kernel", "sm90_xmma_gemm_bf16", 0, 40),
              x("kernel", "vectorized_elementwise_kernel<add>", 50, 10),
              x("kernel", "triton_poi_fused__to_copy_27", 60, 5),
              x("kernel", "triton_poi_fused__to_copy_add_view_3", 65, 5),
              x("gpu_user_annotation", "Optimizer.step#AdamW.step", 100, 50),
              x("kernel", "vectorized_elementwise_kernel<mul>", 110, 20),
              x("cpu_op", "aten::mm", 0, 500), x("gpu_memcpy", "Memcpy HtoD", 140, 10),
              x("gpu_memset", "Memset (Unknown)", 35, 1)]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    view = summary_from_trace(path, active_steps=1)
    assert view["kernels"] == 7  # copies stay copies, inside the optimizer span too
    assert view["gpu_ms_per_step"] == {"gemm": 0.04, "optimizer": 0.02, "elementwise": 0.02,
                                       "memcpy": 0.011}
    # a pure dtype cast counts as one; a cast fused with other work does not
    assert view["casts"] == {"per_step": 1, "ms_per_step": 0.005, "share": pytest.approx(5 / 91)}
    assert view["memsets_per_step"] == 1
    assert view["idle_fraction"] == pytest.approx(1 - 90 / 150)  # the memset inside the gemm
    assert all(not name.startswith(("phase:", "Optimizer")) for name, _ in view["top_kernels"])


def test_the_kernel_window_is_synchronised_at_its_edges_only(monkeypatch):
    """The host runs ahead of the GPU: the profiler waits for the queued steps when its window
    opens and closes, so the window holds the kernels of its own steps, and only then."""
    from fasttrain.profile.kernels import KernelProfiler

    calls, synced = [], []

    class FakeProf:
        def step(self):
            calls.append(len(synced))

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(len(calls)))
    kp = KernelProfiler(start=4, active=3, trace_dir=None)
    kp.prof, kp.cuda = FakeProf(), True
    for step in range(9):
        kp.end(step)
    assert synced == [3, 6] and len(calls) == 9  # before the steps that open and close it
    kp.cuda, synced[:] = False, []
    for step in range(9):
        kp.end(step)
    assert synced == []  # no device to wait for on the CPU


@pytest.mark.gpu
def test_profile_on_cuda_has_kernels_memory_and_a_trace(tmp_path):
    from fasttrain.profile.runner import run_profile

    p = run_profile(load_workload("vit", "tiny"), Recipe(), "cuda", steps=3, warmup=2, active=2,
                    trace_dir=tmp_path, snapshot=tmp_path / "snap.pickle")
    k, m = p["kernels"], p["memory"]
    assert k["launches_per_step"] > 10 and abs(sum(k["share"].values()) - 1) < 1e-6
    assert m["peak_allocated_mib"] > 0 and m["device_used_mib"] >= m["peak_reserved_mib"]
    assert (tmp_path / "snap.pickle").exists() and k["trace"]["mb"] < 20
    assert "precision" in {f["rule"] for f in p["findings"]}


@pytest.mark.gpu
def test_memory_growth_rule_catches_a_leak_on_cuda():
    from fasttrain.profile.runner import run_profile
    from tests.helpers import leaky_workload

    p = run_profile(leaky_workload(), Recipe(), "cuda", steps=4, warmup=1, active=1)
    assert p["memory"]["growth_mib_per_step"] > 10
    assert "memory_growth" in {f["rule"] for f in p["findings"]}

