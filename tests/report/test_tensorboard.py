"""--tensorboard: a row's per-step curves as TensorBoard scalars, read back with TensorBoard's
own reader; rows that measured nothing are left out; a file where the folder goes is refused."""
from __future__ import annotations

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.report.tensorboard import run_name, write_scalars

pytest.importorskip("tensorboard")


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(folder))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


ROW = {"kind": "ladder", "rung": "bf16 + compile", "losses": [2.0, 1.5, 1.25, 1.0],
       "step_times_s": [0.02, 0.04], "step_time_s": 0.03, "throughput": 1000.0,
       "throughput_unit": "img/s", "lrs": [1e-3, 1e-3, 5e-4, 0.0], "peak_allocated_gib": 1.5,
       "tflops": None, "error": None}


def test_a_row_becomes_per_step_curves(tmp_path):
    (run,) = write_scalars([ROW], tmp_path)
    assert run.name == "bf16_+_compile" == run_name(ROW)
    got = _scalars(run)
    assert [v for _, v in got["loss"]] == [2.0, 1.5, 1.25, 1.0]
    assert [s for s, _ in got["step_time_ms"]] == [3, 4]  # the timed steps are the last two
    assert got["step_time_ms"][0][1] == pytest.approx(20.0)
    # 30 items a step (1000 img/s × 0.03 s median) over each step's time
    assert [v for _, v in got["throughput (img/s)"]] == pytest.approx([1500.0, 750.0])
    assert [v for _, v in got["lr"]] == pytest.approx([1e-3, 1e-3, 5e-4, 0.0])
    assert got["peak_allocated_gib"] == [(4, 1.5)] and "tflops" not in got


def test_rows_that_measured_nothing_are_left_out(tmp_path):
    rows = [{**ROW, "rung": "a", "error": "out of memory"}, {**ROW, "rung": "b", "skipped": "cpu"},
            {**ROW, "rung": "c"}, {"kind": "ratio", "rung": None}]
    assert [p.name for p in write_scalars(rows, tmp_path)] == ["c"]


def test_a_file_in_place_of_the_folder_is_refused(tmp_path):
    f = tmp_path / "tb"
    f.write_text("")
    with pytest.raises(FasttrainError, match="is a file"):
        write_scalars([ROW], f)


def test_train_writes_its_run(tmp_path, monkeypatch):
    from fasttrain.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "vit", "--device", "cpu", "--steps", "3", "--warmup", "1",
                 "--set", "schedule=cosine", "--set", "lr=1e-3", "--tensorboard", "tb",
                 "--json"]) == 0
    (run,) = list((tmp_path / "tb").iterdir())
    got = _scalars(run)
    assert len(got["loss"]) == 4 and len(got["step_time_ms"]) == 3
    lrs = [v for _, v in got["lr"]]
    assert lrs[0] == pytest.approx(1e-3) and lrs == sorted(lrs, reverse=True)
