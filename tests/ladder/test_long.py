"""Long-run parity (``ladder --long``): the curve verdict, the plan of variants, and a run end to
end on the CPU."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.ladder.long_run import BASELINE, REPEAT, failures, long_plan, long_table
from fasttrain.measure.curves import (FINAL_TOLERANCE, WINDOW_TOLERANCE, compare_curves,
                                      window_means)
from fasttrain.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2]


def _curve(n=400, scale=1.0, noise=0.0):
    return [scale * (1.0 + 4.0 * math.exp(-i / 60)) + noise * math.sin(i * 1.7) for i in range(n)]


def test_window_means_cover_every_step():
    assert window_means(list(range(10)), 5) == [0.5, 2.5, 4.5, 6.5, 8.5]
    assert window_means(list(range(11)), 5)[-1] == 9.0  # the last window takes the remainder
    with pytest.raises(ValueError):
        window_means([1.0] * 3, 5)


def test_curves_that_wiggle_step_by_step_but_agree_on_average_pass():
    ref, mine = _curve(), _curve(noise=0.3)  # per step up to 30% apart: a short gate fails this
    v = compare_curves(mine, ref)
    assert v["passed"] and v["final_rel_dev"] < FINAL_TOLERANCE and v["window_steps"] == 20
    assert v["reference_drop"] > 0.5 and v["tolerance"] == {"final": FINAL_TOLERANCE,
                                                            "window": WINDOW_TOLERANCE}


def test_a_curve_that_ends_higher_fails_and_says_by_how_much():
    v = compare_curves(_curve(scale=1.03), _curve())
    assert not v["passed"] and v["final_rel_dev"] == pytest.approx(0.03)
    assert "3.00% from the baseline" in failures([{"rung": "fp8", "curve": v}])


def test_a_middle_window_far_off_fails_though_the_end_agrees():
    ref = _curve()
    mine = [x * (1.2 if 100 <= i < 140 else 1.0) for i, x in enumerate(ref)]
    v = compare_curves(mine, ref)
    assert v["final_rel_dev"] == 0 and v["max_window_rel_dev"] > WINDOW_TOLERANCE
    assert not v["passed"]


def test_the_baselines_own_repeat_widens_the_tolerance():
    """A baseline 3% from its own repeat: a switch 5% off is within twice the noise, one 7% off
    is not."""
    ref, again, mine = _curve(), _curve(scale=1.03), _curve(scale=1.05)
    assert not compare_curves(mine, ref)["passed"]
    v = compare_curves(mine, ref, repeats=[again])
    assert v["passed"] and v["noise"]["window"] == pytest.approx(0.03)
    assert v["tolerance"] == pytest.approx({"final": 0.06, "window": 0.06})
    v = compare_curves(_curve(scale=1.07), ref, repeats=[again])
    assert not v["passed"]
    assert "the baseline's repeat strayed 3.00%" in failures([{"rung": "fp8", "curve": v}])


def test_a_loss_learned_to_zero_is_compared_above_the_floor():
    """Both runs learned their data by heart: 0.0008 against 0.0005 is not a 60% deviation."""
    ref = [10.0 * math.exp(-i / 20) + 5e-4 for i in range(400)]
    mine = [10.0 * math.exp(-i / 20) + 8e-4 for i in range(400)]
    v = compare_curves(mine, ref)
    assert v["passed"] and v["final_rel_dev"] < 0.01
    # a repeat that cannot be compared (NaN, another length) adds no noise
    nan = _curve()[:5] + [float("nan")] + _curve()[6:]
    assert compare_curves(mine, ref, repeats=[nan, _curve(100)])["noise"]["repeats"] == 0


@pytest.mark.parametrize("mine,ref,reason", [
    (_curve()[:-1], _curve(), "399 losses against 400"),
    (_curve(30), _curve(30), "too few for a curve"),
    (_curve()[:7] + [float("nan")] + _curve()[8:], _curve(), "NaN/inf loss at step 8"),
    (_curve(), _curve()[:4] + [float("inf")] + _curve()[5:], "baseline NaN/inf loss at step 5"),
])
def test_what_cannot_be_compared_fails_with_the_reason(mine, ref, reason):
    v = compare_curves(mine, ref)
    assert v["passed"] is False and reason in v["reason"]


def test_the_plan_is_the_bf16_baseline_then_one_switch_each():
    base = Recipe().replace(precision="bf16-true", fp8="linear", compile="model")
    plan = long_plan(base, None)
    assert [p[0] for p in plan] == [BASELINE, REPEAT, "fp8", "bf16-stream", "bf16-weights"]
    baseline = plan[0][1]
    assert baseline.precision == "bf16-mixed" and baseline.fp8 == "none"
    assert baseline.compile == "model"  # the rest of the recipe is kept
    assert plan[1][1] == baseline and plan[2][1].fp8 == "linear"
    assert plan[2][1].stream_dtype == "auto"
    assert plan[4][1].master_weights and plan[4][1].optimizer_impl == "triton"
    with pytest.raises(FasttrainError, match="unknown variant 'fp16'"):
        long_plan(base, ["fp16"])


def test_a_variant_the_recipe_cannot_take_is_planned_with_the_reason():
    plan = long_plan(Recipe().replace(accumulation=2, batch=8), ["bf16-weights"])
    assert plan[2][1] is None and "accumulation" in plan[2][2]


@pytest.mark.slow
def test_long_run_end_to_end_on_the_cpu(tmp_path):
    """The baseline and the bf16 stream on the tiny Llama for 40 steps: rows of kind ``long``
    with the verdict, a table, exit 0; the one-launch optimizer's variant is skipped on CPU."""
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin",
           "FASTTRAIN_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "fasttrain", "ladder", "llama", "--device", "cpu",
                           "--long", "40", "--warmup", "0", "--rungs", "bf16-stream,bf16-weights",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for f in (tmp_path / "out").glob("long-llama-tiny-*.jsonl")
            for x in f.read_text().splitlines()]
    assert [r["rung"] for r in rows] == [BASELINE, REPEAT, "bf16-stream", "bf16-weights"]
    assert all(r["kind"] == "long" and r["env"] for r in rows)
    assert rows[1]["curve"]["passed"] is None  # the repeat is the noise, not a verdict
    assert rows[1]["curve"]["final_rel_dev"] == 0  # the CPU repeats itself exactly
    assert len(rows[0]["losses"]) == 40 and rows[2]["curve"]["passed"] is True
    assert rows[2]["curve"]["noise"] == {"final": 0.0, "window": 0.0, "repeats": 1}
    assert "stream_dtype" in rows[2]["applied"]
    assert "needs CUDA" in rows[3]["skipped"]
    assert "bf16-stream" in proc.stdout and "✓" in proc.stdout
    assert long_table(rows)[0].startswith("variant")
