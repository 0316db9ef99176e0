"""fp16-mixed's skipped steps: the GradScaler's skips are counted (no host sync inside the loop)
and reported; a non-finite loss at a skipped step of a run that recovered passes parity and
``train``; a run whose loss stays non-finite fails both and gets no speed-up."""
import json
import math

import pytest

from fasttrain.cli import main
from fasttrain.ladder.runner import LadderSpec, failures, run_ladder
from fasttrain.ladder.spec import finish_row
from fasttrain.measure.parity import compare, unrecovered
from fasttrain.recipe import Recipe
from fasttrain.report.table import row_cells
from fasttrain.run.loop import train
from tests.helpers import fp16_overflow_once, fp16_overflow_stays

FP16 = Recipe(precision="fp16-mixed")
NAN = float("nan")


def _row(res, ref=None):
    row = {**res.to_row(), "device": "cuda", "env": {"device_name": "test"}}
    return finish_row(row, ref, "fp16-mixed") if ref else row


def test_a_skipped_step_is_counted_and_the_run_recovers():
    ref = train(fp16_overflow_once(), Recipe(), steps=4, warmup=2, device="cpu")
    res = train(fp16_overflow_once(), FP16, steps=4, warmup=2, device="cpu")
    assert ref.skipped_steps is None and ref.scaler_skips == []  # no GradScaler, no count
    assert res.skipped_steps == 1 and res.scaler_skips == [3]  # warm-up and timed steps
    assert math.isnan(res.losses[2]) and all(math.isfinite(x) for x in res.losses[3:])
    assert res.first_nonfinite() == 3 and res.failed_step() is None
    assert any("skipped 1 of 6" in w for w in res.warnings)
    row = _row(res, _row(ref))
    assert row["parity"]["passed"] and row["parity"]["excused"] == 1, row["parity"]
    assert row["speedup"] is not None and row_cells(row)[8].endswith("×")


def test_a_loss_that_stays_non_finite_fails_and_gets_no_speedup():
    ref = train(fp16_overflow_once(), Recipe(), steps=4, warmup=2, device="cpu")
    res = train(fp16_overflow_stays(), FP16, steps=4, warmup=2, device="cpu")
    assert res.scaler_skips == [3, 4, 5, 6] and res.failed_step() == 3
    row = _row(res, _row(ref))
    assert row["parity"]["passed"] is False and "step 3" in row["parity"]["reason"]
    assert row["speedup"] is None and row_cells(row)[8] == "–"
    old = {**row, "speedup": 40.0, "losses": [1.0, None]}  # a row written before, from a file
    assert row_cells(old)[8] == "–"


@pytest.mark.parametrize("losses, skipped, precision, passed", [
    ([2.0, NAN, 1.9], [2], "fp16-mixed", True),  # skipped, then recovered
    ([2.0, NAN, 1.9], [], "fp16-mixed", False),  # NaN, but the step was not skipped
    ([2.0, NAN, 1.9], [2], "bf16-mixed", False),  # only fp16's GradScaler skips
    ([2.0, 1.9, NAN], [3], "fp16-mixed", False),  # ends non-finite: never recovered
    ([2.0, NAN, 2.5], [2], "fp16-mixed", False),  # recovered, but off the reference
])
def test_parity_excuses_only_skipped_steps_of_a_run_that_recovered(losses, skipped, precision,
                                                                   passed):
    got = compare(losses, [2.0, 1.95, 1.9], precision, skipped)
    assert got["passed"] is passed, got
    assert unrecovered([1.0, None, 2.0], [2]) is None  # rows read from files hold None


def _train_cli(tmp_path, workload, capsys) -> tuple[int, str, str]:
    rc = main(["train", f"tests.helpers:{workload}", "--device", "cpu", "--steps", "4",
               "--warmup", "2", "--set", "precision=fp16-mixed", "--out", str(tmp_path)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_train_passes_a_run_that_recovered_and_fails_one_that_did_not(tmp_path, capsys):
    rc, out, err = _train_cli(tmp_path / "once", "fp16_overflow_once", capsys)
    assert rc == 0, err
    assert "GradScaler skipped 1 of 6" in out and "Traceback" not in out + err
    row = json.loads(next((tmp_path / "once").glob("*.jsonl")).read_text())
    assert row["skipped_steps"] == 1 and row["scaler_skips"] == [3]
    rc, out, err = _train_cli(tmp_path / "stays", "fp16_overflow_stays", capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 1 and len(lines) == 1 and "the loss became nan at step 3 of 6" in lines[0], err


def test_ladder_passes_an_fp16_rung_that_recovered(tmp_path):
    spec = LadderSpec(workload="tests.helpers:fp16_overflow_once", size="tiny", steps=4,
                      warmup=2, device="cpu", base=Recipe(), rungs=["fp32"],
                      extra_rungs=[("fp16", FP16)])
    rows = run_ladder(spec)
    fp16 = rows[1]
    assert fp16["error"] is None, fp16["error"]
    assert fp16["skipped_steps"] == 1 and fp16["parity"]["passed"], fp16["parity"]
    assert fp16["speedup"] is not None and failures(rows) is None
