"""The measurement floor's files and rows: writes that are whole or absent, rows of known kinds."""
import json
import os

import pytest

from fasttrain.measure.files import (COMPLETE, append_line, write_atomic,
                                     write_folder_atomic)
from fasttrain.measure.rows import (KINDS, MEASURED_KEYS, RowError, append_row, blank_row,
                                    load_rows, make_row)


def test_write_atomic_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "recipe.toml"
    write_atomic(path, "old")
    write_atomic(path, b"new bytes")
    assert path.read_bytes() == b"new bytes"
    write_atomic(path, lambda tmp: tmp.write_text("from a writer"))
    assert path.read_text() == "from a writer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.toml"]


def test_a_failed_write_keeps_the_old_file_whole(tmp_path):
    path = tmp_path / "meta.json"
    write_atomic(path, "old")

    def half_then_crash(tmp):
        tmp.write_text("ha")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, half_then_crash)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json"]


def test_a_folder_is_written_whole_or_not_at_all_and_then_reused(tmp_path):
    folder, calls = tmp_path / "images", []

    def crash(tmp):
        (tmp / "0.jpg").write_text("x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_folder_atomic(folder, crash)
    assert not folder.exists() and not list(tmp_path.iterdir())

    def fill(tmp):
        calls.append(tmp)
        (tmp / "0.jpg").write_text("x")

    assert write_folder_atomic(folder, fill) == folder
    assert (folder / "0.jpg").read_text() == "x" and (folder / COMPLETE).exists()
    write_folder_atomic(folder, fill)  # complete already: not written again
    assert len(calls) == 1


def test_append_line_adds_one_line_at_a_time(tmp_path):
    path = tmp_path / "sub" / "rows.jsonl"
    append_line(path, "a")
    append_line(path, "b\n")
    assert path.read_text() == "a\nb\n"


def test_rows_have_a_known_kind_and_their_identity_first(tmp_path):
    row = make_row("ladder", "vit", "tiny", "bf16", throughput=1.0)
    assert list(row)[:4] == ["kind", "workload", "size", "rung"]
    blank = blank_row("peer", "vit", "tiny", "peer bf16", peer="timm")
    assert all(k in blank for k in MEASURED_KEYS) and blank["error"] is None
    path = tmp_path / "rows.jsonl"
    append_row(path, row)
    append_row(path, blank)
    assert load_rows(path) == [json.loads(json.dumps(r)) for r in (row, blank)]
    assert "train" in KINDS and "inference" in KINDS


def test_a_row_of_an_unknown_kind_is_refused(tmp_path):
    with pytest.raises(RowError, match="unknown row kind 'ladders'"):
        make_row("ladders", "vit", "tiny")
    with pytest.raises(RowError, match="without a known kind"):
        append_row(tmp_path / "rows.jsonl", {"workload": "vit"})
    assert not os.path.exists(tmp_path / "rows.jsonl")


def test_rows_are_strict_json_with_non_finite_numbers_as_null(tmp_path):
    path = tmp_path / "rows.jsonl"
    row = make_row("train", "vit", "tiny", losses=[1.0, float("nan"), float("inf")],
                   parity={"max_rel_dev": float("-inf"), "passed": False}, step_time_s=0.5)
    append_row(path, row)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    back = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in a row"))
    assert back["losses"] == [1.0, None, None] and back["parity"]["max_rel_dev"] is None
    assert back["step_time_s"] == 0.5 and row["losses"][1] != row["losses"][1]  # caller's row kept
