"""The ladder end to end (one fresh process per rung) on every tiny workload, and its gate."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fasttrain.ladder.rungs import build_ladder
from fasttrain.ladder.runner import LadderSpec, finish_row, run_ladder
from fasttrain.errors import FasttrainError
from fasttrain.recipe import Recipe
from fasttrain.report.table import markdown_table
from fasttrain.workloads import REGISTRY, load_workload

ROOT = Path(__file__).resolve().parents[2]
FAST = Recipe(compile_backend="aot_eager")  # inductor's C++ build is minutes on CI's CPU


def _env():
    import os

    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def test_default_rungs_follow_the_source_and_are_cumulative():
    ladder = build_ladder(load_workload("sd", "tiny"), None, Recipe())
    names = [r.name for r, _ in ladder]
    assert names == ["fp32", "tf32", "bf16", "dataloader", "fused-optim", "flash-attn",
                     "ema-stream", "channels-last", "compile", "cuda-graphs"]
    last = ladder[-1][1]
    assert last.precision == "bf16-mixed" and last.optimizer_impl == "fused"
    assert last.ema == "side-stream" and last.compile == "regional" and last.cuda_graphs
    vit = [r.name for r, _ in build_ladder(load_workload("vit", "tiny"), None, Recipe())]
    assert "ema-stream" not in vit  # only where the workload keeps an EMA


@pytest.mark.slow
@pytest.mark.parametrize("workload", sorted(REGISTRY))
def test_ladder_end_to_end_on_every_tiny_workload(workload, tmp_path):
    out = tmp_path / "rows.jsonl"
    rungs = ["fp32", "bf16", "fused-optim", "cuda-graphs"]
    if workload == "vit":  # compile once (aot_eager): the inductor build is minutes on CI's CPU
        rungs.insert(3, "compile")
    spec = LadderSpec(workload=workload, size="tiny", steps=3, warmup=1, device="cpu", out=out,
                      base=FAST, rungs=rungs)
    rows = run_ladder(spec)
    assert [r["rung"] for r in rows] == rungs
    assert rows[-1]["skipped"] == "cuda_graphs needs CUDA"
    for row in rows[:-1]:
        assert row["error"] is None, row["error"]
        assert row["parity"]["passed"], (row["rung"], row["parity"])
        assert row["env"]["torch"] and row["kind"] == "ladder" and len(row["losses"]) == 4
    assert [json.loads(x)["rung"] for x in out.read_text().splitlines()] == [r["rung"] for r in rows]
    assert "✓" in markdown_table(rows)


@pytest.mark.slow
def test_parity_gate_fails_a_deliberately_wrong_rung(tmp_path):
    """A rung that changes the maths (a 10,000x learning rate) must fail the gate."""
    wrong = FAST.replace(lr=1.0)
    spec = LadderSpec(workload="vit", size="tiny", steps=4, warmup=1, device="cpu",
                      base=FAST, rungs=["fp32"], extra_rungs=[("wrong-lr", wrong)])
    rows = run_ladder(spec)
    assert rows[0]["parity"]["passed"]
    assert rows[1]["parity"]["passed"] is False and rows[1]["parity"]["max_rel_dev"] > 0.02


def test_parity_rejects_nan_and_counts_speedup():
    ref = {"losses": [2.0, 1.9], "step_time_s": 1.0, "batch": 8, "model_flops": 8e9}
    ok = finish_row({"losses": [2.0, 1.9001], "step_time_s": 0.5, "batch": 8}, ref, "fp32")
    assert ok["parity"]["passed"] and ok["speedup"] == 2.0 and ok["tflops"] == 8e9 / 0.5 / 1e12
    bad = finish_row({"losses": [2.0, float("nan")], "step_time_s": 0.5, "batch": 8}, ref, "bf16-mixed")
    assert bad["parity"]["passed"] is False


def test_a_crashing_rung_is_a_row_not_an_abort(tmp_path):
    spec = LadderSpec(workload="tests.helpers:broken_workload", size="tiny", steps=2, warmup=0,
                      device="cpu", base=FAST, rungs=["fp32", "bf16"])
    rows = run_ladder(spec)
    assert len(rows) == 2 and all("RuntimeError: boom" in r["error"] for r in rows)


@pytest.mark.slow
def test_cli_ladder_on_a_user_workload(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fasttrain", "ladder", "examples.my_workload:make_workload",
         "--rungs", "fp32,fused-optim", "--steps", "3", "--warmup", "1", "--out", str(tmp_path),
         "--device", "cpu"], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fused-optim" in proc.stdout and "✓" in proc.stdout
    rows = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.read_text().splitlines()]
    assert [r["rung"] for r in rows] == ["fp32", "fused-optim"] and rows[1]["parity"]["passed"]


@pytest.mark.parametrize("argv, needle", [
    (["ladder", "nosuch"], "unknown workload 'nosuch'"),
    (["ladder", "vit", "--set", "precision=fp7"], "precision='fp7'"),
    (["ladder", "vit", "--rungs", "warp"], "unknown rung 'warp'"),
    (["train", "vit", "--size", "huge"], "unknown size 'huge'"),
    (["train", "nosuch.module:make"], "cannot import 'nosuch.module'"),
    (["report", "missing.jsonl"], "no such rows file"),
    (["fit", "vit", "--nproc", "2"], "fit searches the batch of one process"),
    (["scaling", "vit", "--nproc", "2"], "use --worlds"),
])
def test_cli_user_mistakes_are_one_line(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "fasttrain", *argv, "--device", "cpu"]
                          if argv[0] != "report" else [sys.executable, "-m", "fasttrain", *argv],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("USDT")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_cli_train_row_names_the_workload_options(capsys, tmp_path):
    from fasttrain.cli import main

    argv = ["train", "llama", "--size", "tiny", "--steps", "2", "--warmup", "0", "--device",
            "cpu", "--opt", "vocab=509", "--set", "gemm_pad=64", "--json", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = json.loads(out[out.rfind('{\n "kind": "train"'):])
    assert row["options"] == {"vocab": 509} and row["recipe"]["gemm_pad"] == 64
    assert len(row["losses"]) == 2 and all(x == x for x in row["losses"])


def test_previous_parity_is_not_checked_when_the_rung_before_failed():
    from fasttrain.ladder.rungs import Rung
    from fasttrain.ladder.runner import _check

    ref = {"rung": "fp32", "losses": [2.0, 1.9], "step_time_s": 1.0, "batch": 8}
    row = {"rung": "ckpt", "losses": [2.0, 1.9], "step_time_s": 1.0, "batch": 8, "error": None}
    out = _check(row, Rung("ckpt", {}, "", parity="previous"), ref, None, Recipe())
    assert out["parity"]["passed"] is None and "did not run" in out["parity"]["reason"]


def test_peer_summary_compares_the_best_passing_rung_with_the_peer():
    from fasttrain.report.table import peer_summary

    rows = [{"kind": "ladder", "rung": "fp32", "throughput": 100.0, "throughput_unit": "img/s",
             "parity": {"passed": True}},
            {"kind": "ladder", "rung": "bad", "throughput": 900.0, "throughput_unit": "img/s",
             "parity": {"passed": False}},
            {"kind": "ladder", "rung": "graphs", "throughput": 300.0, "throughput_unit": "img/s",
             "parity": {"passed": True}},
            {"kind": "peer", "rung": "peer", "throughput": 250.0}]
    assert "'graphs'" in peer_summary(rows) and "1.20x" in peer_summary(rows)
    assert peer_summary(rows[:3]) is None
    on_cpu = [{**r, "device": "cpu"} for r in rows]  # CPU timings quote no ratio, as the table
    assert "x the peer" not in peer_summary(on_cpu) and "no ratio quoted" in peer_summary(on_cpu)


def test_from_runs_the_base_then_the_later_rungs_with_cumulative_recipes():
    from fasttrain.ladder.runner import LadderSpec, _plan

    _, plan, _ = _plan(LadderSpec(workload="vit", size="tiny", rungs=["default"], start_at="compile"))
    assert [r.name for r, _ in plan] == ["fp32", "compile", "cuda-graphs"]
    # the first rung after the base adds the skipped rungs' switches too (a rung's effect)
    assert {"precision", "optimizer_impl", "compile"} <= plan[1][0].changes.keys()
    compiled = plan[1][1]
    assert (compiled.precision, compiled.optimizer_impl, compiled.compile) == (
        "bf16-mixed", "fused", "model")
    _, mem, _ = _plan(LadderSpec(workload="vit", size="tiny", rungs=["memory"],
                              start_at="checkpointing"))
    assert mem[1][0].parity == "none" and "--from" in mem[1][0].parity_note
    with pytest.raises(FasttrainError, match="--from 'nope' is not a rung"):
        _plan(LadderSpec(workload="vit", size="tiny", rungs=["default"], start_at="nope"))


def test_fast_search_tries_what_depends_on_the_model_greedily():
    from fasttrain.ladder.search import FastSearch, pick_fast

    axes = {w: [label for label, _, _ in FastSearch(load_workload(w, "tiny"), Recipe()).axes]
            for w in ("vit", "sd", "llama", "swin")}
    assert axes["vit"] == ["graphs", "one-launch optimizer", "bf16 master weights",
                           "bf16 moments",  # both on the one-launch AdamW
                           "kernels attention",  # self-attention from the qkv projection
                           "kernels patch", "kernels gelu",  # GEMM patches, MLP
                           "kernels layernorm",
                           "bf16 stream",  # the residual stream, where the model carries one
                           "autotuned reductions",  # LayerNorm backwards
                           "dependent launch", "combo kernels",  # how Inductor launches
                           "memsets as kernels"]  # and the captured graph's nodes
    launches = ["dependent launch", "combo kernels", "memsets as kernels"]
    assert axes["sd"] == ["graphs", "one-launch optimizer", "bf16 master weights",
                          "bf16 moments", "kernels gelu", "kernels layernorm", "kernels groupnorm",
                          "kernels conv",  # the frozen VAE's input convolution
                          "no NHWC", *launches]  # conv + GEGLU + transformer norms
    assert axes["swin"] == ["graphs", "one-launch optimizer", "bf16 master weights",
                            "bf16 moments", "math attention",
                            "kernels window", "kernels patch", "kernels gelu", "kernels layernorm",
                            "bf16 stream", "autotuned reductions", *launches]
    # tiny llama has no layer of 2^24 weights, so fp8 is not tried; base has (the MLPs)
    assert axes["llama"] == ["graphs", "one-launch optimizer", "bf16 master weights",
                             "bf16 moments", "kernels rmsnorm", "kernels rope", "kernels loss",  # fused layers
                             "bf16 stream", "autotuned reductions", *launches]
    # several processes: master weights would be refused at run time, so they are not tried
    ddp = FastSearch(load_workload("vit", "tiny"), Recipe(), processes=2)
    assert "bf16 master weights" not in [label for label, _, _ in ddp.axes]
    assert ddp.drain_skipped() == [("bf16 master weights", "master_weights with bf16-mixed runs "
                                    "on one process, this ladder on 2")]
    big = [label for label, _, _ in FastSearch(load_workload("llama", "base"), Recipe()).axes]
    assert big == ["graphs", "one-launch optimizer", "bf16 master weights", "bf16 moments",
                   "fp8 large", "fp8",
                   "kernels rmsnorm", "kernels rope", "kernels loss", "bf16 stream",
                   "autotuned reductions", *launches]
    # an odd vocabulary (off a multiple of 8): the padded GEMM widths are tried
    odd = [label for label, _, _ in FastSearch(load_workload("llama", "tiny", vocab=509),
                                               Recipe()).axes]
    assert odd == axes["llama"][:8] + ["GEMM widths padded"] + axes["llama"][8:]
    search = FastSearch(load_workload("sd", "tiny"), Recipe())
    search.axes.insert(1, ("fp8", "fp8", "linear"))
    search.axes.insert(2, ("fp8 large", "fp8", "large"))
    rung, rec = search.first()
    assert (rung.name, rec.compile, rec.cuda_graphs, rec.channels_last, rec.ema,
            rec.precision) == ("fast: compile", "regional", False, True, "side-stream",
                               "bf16-mixed")
    ok = {"parity": {"passed": True}, "error": None}
    rung, rec = search.next({**ok, "rung": "fast: compile", "throughput": 10.0}, rec)
    assert rung.name == "fast: compile + graphs" and rec.cuda_graphs
    # graphs won: fp8 is tried on top of it
    rung, rec = search.next({**ok, "rung": rung.name, "throughput": 12.0}, rec)
    assert rung.name == "fast: compile + graphs + fp8" and rec.cuda_graphs and rec.fp8 == "linear"
    # fp8 won: fp8=large replaces it in the name and the recipe
    rung, rec = search.next({**ok, "rung": rung.name, "throughput": 13.0}, rec)
    assert rung.name == "fast: compile + graphs + fp8 large" and rec.fp8 == "large"
    # fp8=large failed parity: the one-launch optimizer is tried on the graphs + fp8 recipe
    rung, rec = search.next({"rung": rung.name, "throughput": 20.0,
                             "parity": {"passed": False}}, rec)
    assert rung.name == "fast: compile + graphs + fp8 + one-launch optimizer"
    assert (rec.cuda_graphs, rec.fp8, rec.optimizer_impl) == (True, "linear", "triton")
    # it gained 0.4 %, under the margin: master weights and bf16 moments (which need it) are
    # not tried, the GEGLU kernels (family gelu) are, without it
    assert search.axes[0][1] == "master_weights"
    rung, rec = search.next({**ok, "rung": rung.name, "throughput": 13.05}, rec)
    assert rung.name == "fast: compile + graphs + fp8 + kernels gelu"
    assert (rec.kernels, rec.optimizer_impl) == ("gelu", "fused")
    (label, why), (label2, why2) = search.drain_skipped()
    assert label == "bf16 master weights" and "set optimizer_impl=triton" in why
    assert label2 == "bf16 moments" and "set optimizer_impl=triton" in why2
    assert search.drain_skipped() == []
    # they lost: the LayerNorm kernels are tried without them, then GroupNorm's
    rung, rec = search.next({**ok, "rung": rung.name, "throughput": 12.9}, rec)
    assert rung.name == "fast: compile + graphs + fp8 + kernels layernorm"
    assert (rec.kernels, rec.optimizer_impl) == ("layernorm", "fused")
    rung, rec = search.next({**ok, "rung": rung.name, "throughput": 12.9}, rec)
    assert rung.name == "fast: compile + graphs + fp8 + kernels groupnorm"
    assert (rec.kernels, rec.optimizer_impl) == ("groupnorm", "fused")
    rung, rec = search.next({**ok, "rung": rung.name, "throughput": 12.5}, rec)
    assert rung.name == "fast: compile + graphs + fp8 + kernels conv"  # the VAE's input
    assert (rec.kernels, rec.optimizer_impl) == ("conv", "fused")
    # they lost: NHWC off is tried without them
    rung, rec = search.next({**ok, "rung": rung.name, "throughput": 12.5}, rec)
    assert rung.name == "fast: compile + graphs + fp8 + no NHWC"
    assert (rec.cuda_graphs, rec.fp8, rec.channels_last, rec.optimizer_impl, rec.kernels) == (
        True, "linear", False, "fused", "none")
    # it lost too: Inductor's launch switches last, on the best recipe so far
    rung, rec = search.next({**ok, "rung": rung.name, "throughput": 11.0}, rec)
    assert rung.name == "fast: compile + graphs + fp8 + dependent launch"
    assert (rec.pdl, rec.channels_last, rec.fp8) == (True, True, "linear")
    rung, rec = search.next({**ok, "rung": rung.name, "throughput": 13.2}, rec)  # +1.5%: kept
    assert rung.name == "fast: compile + graphs + fp8 + dependent launch + combo kernels"
    assert (rec.pdl, rec.combo_kernels) == (True, True)
    rung, rec = search.next({**ok, "rung": rung.name, "throughput": 13.25}, rec)  # a tie
    assert rung.name == "fast: compile + graphs + fp8 + dependent launch + memsets as kernels"
    assert (rec.pdl, rec.combo_kernels, rec.graph_memset_kernels) == (True, False, True)
    assert search.next({**ok, "rung": rung.name, "throughput": 13.0}, rec) is None
    assert search.best["rung"] == "fast: compile + graphs + fp8 + dependent launch"
    # kernel families add up: the second one tried keeps the first that won
    swin = FastSearch(load_workload("swin", "tiny"), Recipe())
    swin.axes = [a for a in swin.axes if a[1] == "kernels"]
    rung, rec = swin.first()
    rung, rec = swin.next({**ok, "rung": rung.name, "throughput": 10.0}, rec)
    assert (rung.name, rec.kernels) == ("fast: compile + kernels window", "window")
    rung, rec = swin.next({**ok, "rung": rung.name, "throughput": 11.0}, rec)
    assert (rung.name, rec.kernels) == ("fast: compile + kernels patch,window", "patch,window")
    rung, rec = swin.next({**ok, "rung": rung.name, "throughput": 10.5}, rec)  # patch lost
    assert (rung.name, rec.kernels) == ("fast: compile + kernels gelu,window", "gelu,window")
    rung, rec = swin.next({**ok, "rung": rung.name, "throughput": 10.9}, rec)  # gelu lost
    assert (rung.name, rec.kernels) == ("fast: compile + kernels layernorm,window",
                                        "layernorm,window")
    assert swin.next({**ok, "rung": rung.name, "throughput": 10.8}, rec) is None
    assert swin.best["rung"] == "fast: compile + kernels window"
    rows = [{"rung": "fast: a", "throughput": 9.0, "parity": {"passed": False}},
            {"rung": "fast: b", "throughput": 5.0, "parity": {"passed": True}},
            {"rung": "fast: c", "skipped": "needs CUDA", "parity": None},
            {"rung": "fp32", "throughput": 99.0, "parity": {"passed": True}}]
    assert pick_fast(rows)["rung"] == "fast: b"  # fastest that ran and kept the loss
    # a switch must gain MIN_GAIN (0.5 %) to be kept: a measured tie keeps the simpler recipe
    passed = {"parity": {"passed": True}}
    tie = [{"rung": "fast: b", "throughput": 10.0, **passed},
           {"rung": "fast: b + x", "throughput": 10.04, **passed}]
    assert pick_fast(tie)["rung"] == "fast: b"
    assert pick_fast([*tie, {"rung": "fast: b + y", "throughput": 10.06, **passed}])["rung"] \
        == "fast: b + y"  # 0.6 % over b, the recipe kept before it
    llama = FastSearch(load_workload("llama", "tiny"), Recipe())
    rung, rec = llama.first()
    rung, rec = llama.next({**ok, "rung": rung.name, "throughput": 100.0}, rec)  # compile
    rung, rec = llama.next({**ok, "rung": rung.name, "throughput": 110.0}, rec)  # graphs: kept
    assert rung.name == "fast: compile + graphs + one-launch optimizer"
    rung, rec = llama.next({**ok, "rung": rung.name, "throughput": 112.0}, rec)  # kept
    assert rung.name == "fast: compile + graphs + one-launch optimizer + bf16 master weights"
    assert (rec.master_weights, rec.optimizer_impl, rec.cuda_graphs) == (True, "triton", True)
    rung, rec = llama.next({**ok, "rung": rung.name, "throughput": 111.0}, rec)  # slower
    assert (rung.name, rec.master_weights, rec.optimizer_state) == (
        "fast: compile + graphs + one-launch optimizer + bf16 moments", False, "bf16")
    rung, rec = llama.next({**ok, "rung": rung.name, "throughput": 110.2}, rec)  # slower
    assert (rung.name, rec.master_weights, rec.optimizer_state) == (
        "fast: compile + graphs + one-launch optimizer + kernels rmsnorm", False, "fp32")
    llama = FastSearch(load_workload("llama", "tiny"), Recipe())
    rung, rec = llama.first()
    rung, rec = llama.next({**ok, "rung": rung.name, "throughput": 100.0}, rec)  # compile
    rung, rec = llama.next({**ok, "rung": rung.name, "throughput": 110.0}, rec)  # graphs: kept
    rung, rec = llama.next({**ok, "rung": rung.name, "throughput": 109.0}, rec)  # slower
    assert (rung.name, rec.optimizer_impl) == ("fast: compile + graphs + kernels rmsnorm",
                                               "fused")
    rung, rec = llama.next({**ok, "rung": rung.name, "throughput": 110.3}, rec)  # a tie
    assert (rung.name, rec.kernels, rec.cuda_graphs) == (
        "fast: compile + graphs + kernels rope", "rope", True)


@pytest.mark.slow
def test_fast_preset_end_to_end_writes_the_winning_recipe(tmp_path):
    from fasttrain.recipe import load_toml

    proc = subprocess.run([sys.executable, "-m", "fasttrain", "ladder", "vit", "--device", "cpu",
                           "--rungs", "fast", "--set", "compile_backend=aot_eager", "--steps", "2",
                           "--warmup", "1", "--out", str(tmp_path)], capture_output=True,
                          text=True, env=_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for f in tmp_path.glob("ladder-*.jsonl") for x in f.read_text().splitlines()]
    verdict = [r for r in rows if r["kind"] == "fast"]
    names = [r["rung"] for r in rows if r["kind"] == "ladder"]
    # one rung per switch, each on top of the best so far; graphs need CUDA (skipped)
    assert names[:4] == ["fp32", "fast: compile", "fast: compile + graphs",
                         "fast: compile + one-launch optimizer"]  # interpreted on the CPU
    # what follows builds on whichever of compile / compile + optimizer measured faster (with
    # the optimizer, master weights and bf16 moments are tried next; without it, their rungs
    # say they were not tried)
    kept = [n.removeprefix("fast: ") for n in names[4:9]
            if "master weights" not in n and "moments" not in n][:3]
    for opt in ("", " + one-launch optimizer"):
        if kept[0] == f"compile{opt} + kernels attention":
            assert kept[1] in (f"compile{opt} + kernels patch",
                               f"compile{opt} + kernels attention,patch")
            assert kept[2].startswith(f"compile{opt} + kernels ") and "gelu" in kept[2]
            break
    else:
        raise AssertionError(names)
    assert next(r for r in rows if r["rung"] == "fast: compile + graphs")["skipped"]
    assert len(verdict) == 1 and verdict[0]["rung"] in names[1:]
    took = verdict[0]["search_s"]  # how long it took: more than its rungs' timed steps
    assert took > sum(r["step_time_s"] * 2 for r in rows if r.get("step_time_s"))
    assert re.search(r", found in [0-9.]+ (s|min)\) → ", proc.stdout)
    chosen = next(r for r in rows if r["rung"] == verdict[0]["rung"] and r["kind"] == "ladder")
    assert load_toml(tmp_path / "fast-vit-tiny.toml").to_dict() == chosen["recipe"]
    assert f"fast preset: '{verdict[0]['rung']}'" in markdown_table(rows)


def test_a_rung_whose_switch_matched_nothing_shows_no_effect():
    """A CNN has no attention: its flash-attn rung ran but changed nothing, so the row says
    ``effect: none`` with the reason and the table says "no effect" where the speed-up goes;
    the rung after it is still measured against fp32."""
    from fasttrain.report.table import COLUMNS, row_cells

    spec = LadderSpec(workload="tests.helpers:tiny_cnn_workload", size="tiny", steps=2,
                      warmup=0, device="cpu", base=FAST,
                      rungs=["fp32", "flash-attn", "fused-optim"])
    base, flash, fused = run_ladder(spec)
    assert flash["error"] is None and flash["parity"]["passed"]
    assert flash["effect"] == "none" and flash["speedup"] is None
    assert list(flash["effect_reasons"]) == ["attention"]
    assert "no scaled_dot_product_attention call seen" in flash["effect_reasons"]["attention"]
    speed = COLUMNS.index("speed-up")
    assert row_cells(flash)[speed] == "no effect"
    assert "effect" not in fused and fused["speedup"] > 0
    assert row_cells(fused)[speed] == "–"  # CPU timings: no speed-up to quote
    assert row_cells({**fused, "device": "cuda"})[speed].endswith("×")
    assert "effect" not in base and "no effect" in markdown_table([base, flash, fused])


def test_a_rung_has_no_effect_only_where_all_its_switches_idled():
    from fasttrain.ladder.spec import mark_effect

    tf32 = "tf32 has no effect on CPU (plain fp32 math)"
    row = {"speedup": 1.01, "error": None, "no_effect": {"precision": tf32, "attention": "x"}}
    none = mark_effect(dict(row), {"precision": "tf32"})
    assert (none["effect"], none["effect_reasons"], none["speedup"]) == (
        "none", {"precision": tf32}, None)
    both = mark_effect(dict(row), {"precision": "tf32", "compile": "model"})  # compile acted
    assert "effect" not in both and both["speedup"] == 1.01
    loader = mark_effect({"speedup": 1.0, "no_effect": {"dataloader": "CUDA only"}},
                         {"pin_memory": True, "non_blocking": True})  # fields of a technique
    assert loader["effect"] == "none" and loader["effect_reasons"] == {"dataloader": "CUDA only"}
    assert "effect" not in mark_effect(dict(row), {})  # a user's recipe rung: nothing to map
    assert "effect" not in mark_effect({**row, "skipped": "needs CUDA"}, {"precision": "tf32"})


def test_fast_search_skips_a_switch_that_idled_and_keeps_no_idle_gain():
    from fasttrain.ladder.search import FastSearch, pick_fast

    ok = {"parity": {"passed": True}, "error": None}
    search = FastSearch(load_workload("swin", "tiny"), Recipe())
    search.axes = [("math attention", "attention", "math"), ("kernels window", "kernels", "window"),
                   ("kernels patch", "kernels", "patch"), ("no NHWC", "channels_last", False)]
    rung, rec = search.first()
    no_sdpa = "no scaled_dot_product_attention call seen; attention=auto changes nothing"
    first = {**ok, "rung": rung.name, "throughput": 10.0, "no_effect": {"attention": no_sdpa}}
    rung, rec = search.next(first, rec)  # SDPA was never called: math attention is not tried
    assert rung.name == "fast: compile + kernels window"
    assert search.drain_skipped() == [("math attention", "attention had no effect in an earlier "
                                       f"trial: {no_sdpa}")]
    # its kernels idled: a "gain" is noise, not kept; the next family is still tried (a family
    # idles where its Triton kernel cannot run, the next may not need Triton)
    idle = {**ok, "rung": rung.name, "throughput": 20.0, "effect": "none",
            "no_effect": {"kernels": "no fused path switched on (kernels=window)",
                          "channels_last": "the model has no Conv2d; nothing converted"}}
    rung, rec = search.next(idle, rec)
    assert (rung.name, rec.kernels) == ("fast: compile + kernels patch", "patch")
    assert search.best is first
    assert search.next({**ok, "rung": rung.name, "throughput": 9.0}, rec) is None
    assert [label for label, _ in search.drain_skipped()] == ["no NHWC"]
    assert pick_fast([first, idle])["rung"] == "fast: compile"


def test_a_rung_of_no_effect_is_not_the_best_rung():
    from fasttrain.ladder.confirm import best_rung
    from fasttrain.report.table import peer_summary

    passed = {"kind": "ladder", "throughput_unit": "img/s", "parity": {"passed": True}}
    rows = [{**passed, "rung": "fused-optim", "throughput": 100.0},
            {**passed, "rung": "flash-attn", "throughput": 101.0, "effect": "none"},
            {"kind": "peer", "rung": "peer", "throughput": 50.0}]
    assert best_rung(rows, None)["rung"] == "fused-optim"
    assert "'fused-optim'" in peer_summary(rows)


def test_a_base_out_of_memory_runs_again_checkpointed_and_stays_the_reference(monkeypatch):
    """The fp32 base that runs out of memory is run again with every block checkpointed (the
    same maths): it becomes the parity reference, its name and comment say why, its row keeps
    the first error, and the ladder does not fail. A second failure gives one row with both."""
    from fasttrain.ladder import runner
    from fasttrain.ladder.runner import failures

    real, calls = runner.run_rung, []
    oom = "out of memory: CUDA out of memory. Tried to allocate 3.91 GiB."

    def run_rung(spec, name, recipe, workdir):
        calls.append((name, recipe.checkpointing))
        if recipe.precision == "fp32" and recipe.checkpointing == "none":
            return {"error": oom}
        return real(spec, name, recipe, workdir)

    monkeypatch.setattr(runner, "run_rung", run_rung)
    spec = LadderSpec(workload="vit", size="tiny", steps=3, warmup=1, device="cpu", base=FAST,
                      rungs=["fp32"], extra_rungs=[("bf16", FAST.replace(precision="bf16-mixed"))])
    rows = run_ladder(spec)
    assert calls == [("fp32", "none"), ("fp32", "full"), ("bf16", "none")]
    base, bf16 = rows
    assert base["rung"] == "fp32 (checkpointed)" and not base.get("error")
    assert base["base_out_of_memory"] == oom and base["recipe"]["checkpointing"] == "full"
    assert "plain fp32 ran out of memory" in base["comment"]
    assert base["parity"]["passed"] and bf16["parity"]["passed"]
    assert failures(rows) is None

    def always_oom(spec, name, recipe, workdir):
        return {"error": oom}

    monkeypatch.setattr(runner, "run_rung", always_oom)
    (row,) = run_ladder(LadderSpec(workload="vit", size="tiny", steps=3, warmup=1, device="cpu",
                                   base=FAST, rungs=["fp32"]))
    assert row["rung"] == "fp32" and row["error"].count("Tried to allocate") == 2
    assert "again with full activation checkpointing" in row["error"]
    assert failures([row]) == "fp32 (error)"
