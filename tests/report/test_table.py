"""The ladder table in a terminal: 80 columns without wrapped cells, numbered warnings and a
legend of the marks used under it, the CPU note, a live view whose seconds tick, plain lines
where stdout is not a terminal, and what Ctrl-C leaves on screen."""
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from fasttrain.report.live import Board, show_progress
from fasttrain.report.table import (COLUMNS, CPU_NOTE, NARROW, ladder_view, markdown_table,
                                    notes, numbered_warnings, plain_line, rich_table,
                                    row_cells)

GPU_ROWS = Path(__file__).with_name("rows.jsonl")

_ROW = {"kind": "ladder", "workload": "vit", "size": "tiny", "batch": 8, "error": None,
        "throughput_unit": "img/s", "comment": "a rung"}


def _rows(device="cpu"):
    return [
        {**_ROW, "rung": "fp32", "device": device, "step_time_s": 0.0354, "throughput": 225.9,
         "parity": None, "comment": "baseline: strict fp32, plain attention"},
        {**_ROW, "rung": "bf16", "device": device, "step_time_s": 0.0177, "throughput": 451.8,
         "speedup": 2.0, "parity": {"passed": True, "max_rel_dev": 3e-3},
         "warnings": ["dataloader: no workers on this machine", "compile: 2 graph breaks"],
         "spread": {"iqr_rel": 0.2, "steady": False}},
        {**_ROW, "rung": "fast: compile + graphs + kernels layernorm,gelu", "device": device,
         "step_time_s": 0.0101, "throughput": 12_345.6, "speedup": 3.5,
         "parity": {"passed": True, "max_rel_dev": 1e-2}},
        {**_ROW, "rung": "cuda-graphs", "device": device, "skipped": "cuda_graphs needs CUDA"},
    ]


def _render(renderable, width):
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def _gpu_rows():
    return [json.loads(x) for x in GPU_ROWS.read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("rows", [_rows("cuda"), _rows("cpu"), _gpu_rows()],
                         ids=["made-up", "cpu", "committed"])
def test_the_table_fits_80_columns_without_wrapping_a_number(rows):
    text = _render(ladder_view(rows, "fasttrain ladder · vit tiny · cpu", width=80), 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    head = next(line for line in text.splitlines() if "rung" in line and "batch" in line)
    assert "spread" not in head and "MFU" not in head and "comment" not in head
    for row in rows:
        if row.get("kind") == "ladder" and row.get("throughput") and row.get("rung"):
            cell = row_cells(row)[COLUMNS.index("throughput")].removesuffix(" img/s")
            assert cell in text  # whole, on one line
    if rows[0].get("comment"):  # the comments moved under the table
        assert f"fp32: {rows[0]['comment']}" in text


def test_a_wide_terminal_gets_every_column():
    text = _render(rich_table(_rows("cuda"), width=160), 160)
    head = next(line for line in text.splitlines() if "rung" in line)
    assert all(col in head for col in COLUMNS)
    narrow = _render(rich_table(_rows("cuda"), width=100), 100)
    assert all(col in narrow for col in NARROW if col != "throughput") and "img/s" in narrow


def test_warnings_are_numbered_notes_and_every_mark_used_has_a_legend():
    rows = _rows("cuda")
    for width in (80, 160):
        text = _render(ladder_view(rows, width=width), width)
        assert "⚠1. bf16: dataloader: no workers on this machine" in text
        assert "⚠2. bf16: compile: 2 graph breaks" in text
        assert "⚠1,2" in text  # the row points at its notes
        assert "no workers on this machine]" not in text  # not in the cell any more
    legend = next(n for n in notes(rows) if n.startswith("marks: "))
    for mark in ("✓", "⚠", "ref", "–"):
        assert f"{mark} = " in legend
    assert "✗ = " not in legend and "n/a = " not in legend and "no effect = " not in legend
    failed = [*rows, {**_ROW, "rung": "x", "device": "cuda", "error": "OOM"},
              {**_ROW, "rung": "sgd", "device": "cuda", "step_time_s": 0.1, "throughput": 1.0,
               "parity": {"passed": None, "reason": "not checked: another optimizer"}}]
    legend = next(n for n in notes(failed) if n.startswith("marks: "))
    assert "✗ = " in legend and "n/a = " in legend


def test_on_a_cpu_the_speed_up_is_a_dash_and_the_table_says_why():
    speed = COLUMNS.index("speed-up")
    cpu, gpu = _rows("cpu"), _rows("cuda")
    assert row_cells(cpu[1])[speed] == "–" and row_cells(gpu[1])[speed] == "2.00×"
    assert CPU_NOTE in notes(cpu) and CPU_NOTE not in notes(gpu)
    assert "CPU: these timings check the plumbing" in _render(ladder_view(cpu, width=80), 80)
    # rows written before rows named their device: a CPU is named by its processor
    old = {k: v for k, v in cpu[1].items() if k != "device"}
    assert row_cells({**old, "env": {"device_name": "x86_64"}})[speed] == "–"
    assert row_cells({**old, "env": {"device_name": "NVIDIA H100 80GB HBM3"}})[speed] == "2.00×"
    assert "CPU: " in markdown_table(cpu) and "⚠1. bf16" in markdown_table(cpu)


def test_plain_lines_name_each_cell():
    fp32, bf16, _, skipped = _rows("cuda")
    assert plain_line(fp32).startswith("fp32: 35.4 ms/step, 225.9 img/s, peak –, speed-up –")
    assert "speed-up 2.00×, parity ✓ 3.0e-03" in plain_line(bf16)
    assert plain_line(skipped) == "cuda-graphs: skipped: cuda_graphs needs CUDA"


def test_the_live_view_ticks_between_rows():
    board = Board("ladder", Console(width=80, file=io.StringIO()))
    board.start("rung 1/3: fp32")
    first = _render(board, 80)
    board.t0 -= 7  # seven seconds later, no row arrived
    later = _render(board, 80)
    assert "(0 s)" in first and "(7 s)" in later


def _runner(rows, seen, interrupt=False):
    def run(on_row, on_start):
        for i, row in enumerate(rows):
            on_start(row["rung"], i, len(rows))
            on_row(row, i, len(rows))
            seen.append(None)
        if interrupt:
            raise KeyboardInterrupt
        return rows
    return run


def test_a_pipe_gets_one_line_per_row_as_it_arrives_then_the_table(capsys):
    rows, seen = _rows("cpu"), []
    console = Console(file=io.StringIO(), width=200)  # not a terminal

    def run(on_row, on_start):
        for i, row in enumerate(rows):
            on_row(row, i, len(rows))
            seen.append(capsys.readouterr().out)  # what was printed by then
        return rows

    assert show_progress(run, "fasttrain ladder · vit tiny · cpu", console) == rows
    assert seen[0] == f"fasttrain ladder · vit tiny · cpu\n{plain_line(rows[0])}\n"
    assert seen[1] == f"{plain_line(rows[1])}\n"
    table = console.file.getvalue()
    assert "speed-up" in table and "⚠1. bf16" in table and "CPU: " in table


def test_a_terminal_gets_the_live_table_then_the_table_with_its_notes():
    console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    rows = show_progress(_runner(_rows("cuda"), []), "ladder", console)
    out = console.file.getvalue()
    assert len(rows) == 4 and "⚠1. bf16" in out and "marks: " in out


def test_ctrl_c_shows_the_rows_so_far_and_goes_on():
    console = Console(file=io.StringIO(), width=200)
    with pytest.raises(KeyboardInterrupt):
        show_progress(_runner(_rows("cuda")[:2], [], interrupt=True), "ladder", console)
    assert "bf16" in console.file.getvalue()


def test_a_warning_repeated_by_later_rungs_keeps_its_first_number():
    """Cumulative rungs repeat their switches' warnings: one note, pointed at by each; a text
    that starts with its rung's name is not prefixed twice."""
    rows = [{**_ROW, "rung": "dataloader", "device": "cuda",
             "warnings": ["dataloader: pin_memory needs CUDA; ignored"]},
            {**_ROW, "rung": "compile", "device": "cuda",
             "warnings": ["dataloader: pin_memory needs CUDA; ignored", "compile: 2 breaks"]}]
    refs, texts = numbered_warnings(rows)
    assert texts == ["dataloader: pin_memory needs CUDA; ignored", "compile: 2 breaks"]
    assert refs == [[1], [1, 2]]


def test_a_cpu_fast_preset_line_has_no_ratio_and_no_steadiness():
    from fasttrain.report.table import fast_summary

    fast = {"kind": "fast", "rung": "bf16", "throughput": 100.0, "throughput_unit": "img/s",
            "vs_peer": 1.3, "vs_peer_steady": False, "recipe_file": "f.toml", "device": "cpu"}
    assert fast_summary([fast]) == "fast preset: 'bf16' at 100.0 img/s → f.toml"
    assert "1.30x the peer (not steady)" in fast_summary([{**fast, "device": "cuda"}])
