"""``fasttrain train`` in a terminal: a short summary, its row in a JSONL file under --out, and
the row as JSON on stdout with --json (for scripts)."""
import io
import json

from rich.console import Console

from fasttrain.cli import main
from fasttrain.report.train import train_summary

FAST = ["--size", "tiny", "--steps", "2", "--warmup", "1", "--device", "cpu"]


def _text(renderable) -> str:
    console = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def test_the_summary_names_what_ran_and_what_it_measured():
    row = {"kind": "train", "workload": "vit", "size": "base", "device": "cuda",
           "recipe_name": "fast-vit-base", "recipe": {"precision": "bf16-mixed", "lr": 1e-4},
           "batch": 128, "steps": 20, "warmup_s": 41.5, "step_time_s": 0.0401,
           "step_time_min_s": 0.0399, "step_time_max_s": 0.0410, "throughput": 3192.0,
           "throughput_unit": "img/s", "peak_allocated_gib": 9.51, "peak_reserved_gib": 10.2,
           "tflops": 335.2, "mfu": 0.339, "losses": [6.9] * 5 + [6.1] * 19 + [5.8],
           "spread": {"iqr_rel": 0.004, "steady": True},
           "applied": {"precision": "bf16 autocast, fp32 weights"},
           "warnings": ["dataloader: device_prefetch is off under cuda_graphs"],
           "env": {"device_name": "NVIDIA H200"}}
    text = _text(train_summary(row, "out/train-vit-base.jsonl",
                               {"precision": "fp32", "lr": 1e-4}))
    for needle in ("vit base · NVIDIA H200", "fast-vit-base: precision=bf16-mixed",
                   "128 · 20 timed steps after 5 warm-up steps (41.5 s)", "40.1 ms median",
                   "3,192.0 img/s", "335.2 TFLOP/s, MFU 33.9%", "9.51 GiB allocated",
                   "6.9 → 5.8 over 25 steps", "bf16 autocast, fp32 weights",
                   "⚠ 1. dataloader: device_prefetch is off", "row: out/train-vit-base.jsonl"):
        assert needle in text, (needle, text)
    assert "CPU" not in text and "lr=" not in text  # only the switches it changed
    assert len(text.splitlines()) < 20


def test_cli_train_prints_a_summary_and_writes_its_row(capsys, tmp_path):
    assert main(["train", "vit", *FAST, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (path,) = tmp_path.glob("train-vit-tiny-*.jsonl")
    (row,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert row["kind"] == "train" and row["device"] == "cpu" and len(row["losses"]) == 3
    assert "{" not in out and len(out.splitlines()) < 30
    assert "fasttrain train · vit tiny" in out and "ms median" in out and "img/s" in out
    assert "CPU timings check the plumbing" in out and f"row: {path}" in out


def test_cli_train_json_prints_the_row_for_scripts(capsys, tmp_path):
    assert main(["train", "vit", *FAST, "--out", str(tmp_path), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    (path,) = tmp_path.glob("train-vit-tiny-*.jsonl")
    assert json.loads(path.read_text()) == row and row["recipe_name"] == "default"
