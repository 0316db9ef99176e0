"""Result rows: one JSON object a measured run, the thing every fasttrain command produces.

The kinds and the keys every tool and report relies on (DESIGN.md, "Result rows") are defined
here once; every command builds its rows with :func:`make_row` and writes them with
:func:`append_row`. More keys are welcome; these keep their names and units.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import DiskFullError
from .files import append_line

KINDS = ("train", "ladder", "peer", "ratio", "fast", "profile", "fit", "scaling", "kernel",
         "inference", "long")
"""``train``: one ``fasttrain train`` run; ``ladder``: one rung; ``peer``: PyTorch best practice
on the public code; ``ratio``: ours against the peer, confirmed by repeats; ``fast``: the fast
search's verdict; ``profile``: a profiled run with its breakdown; ``fit``: one batch-size trial;
``scaling``: one world size and sharding mode; ``kernel``: a kernel micro-benchmark;
``inference``: one inference rung; ``long``: one switch of a long-run parity check (``ladder
--long``), its loss curve against the bf16-mixed baseline's."""

IDENTITY_KEYS = ("kind", "workload", "size", "rung")
"""What a row is about; every row has them (``rung`` may be None)."""

MEASURED_KEYS = (
    "recipe", "batch", "steps", "step_time_s", "step_time_min_s", "step_time_max_s",
    "throughput", "throughput_unit", "peak_allocated_gib", "peak_reserved_gib", "model_flops",
    "tflops", "mfu", "warmup_s", "losses", "parity", "applied", "error", "step_times_s",
    "spread",
)
"""What a measured run reports: step time (median, min, max, every step), throughput and its
unit, peak memory (GiB), model FLOPs, TFLOP/s and MFU, warm-up seconds, the per-step losses,
the parity verdict, what each technique did, and the error (None when it ran)."""

ROW_KEYS = ("kind", "peer", "workload", "size", "rung", *MEASURED_KEYS)
"""The keys a peer row always carries (None where not measured)."""


class RowError(ValueError):
    """A row that breaks the schema: a programming error, never a user's."""


def make_row(kind: str, workload: str | None, size: str | None, rung: str | None = None,
             **fields: Any) -> dict[str, Any]:
    """A row of ``kind`` about ``workload`` at ``size`` (and ``rung``), with ``fields``.

    The identity keys come first so that rows read alike in any file."""
    if kind not in KINDS:
        raise RowError(f"unknown row kind {kind!r} (known: {', '.join(KINDS)})")
    return {"kind": kind, "workload": workload, "size": size, "rung": rung, **fields}


def blank_row(kind: str, workload: str | None, size: str | None, rung: str | None = None,
              **fields: Any) -> dict[str, Any]:
    """:func:`make_row` with every measured key present (None until measured): for rows whose
    run may fail before it measures anything (a peer that cannot import its package)."""
    blank = {k: None for k in MEASURED_KEYS if k not in fields}
    return make_row(kind, workload, size, rung, **fields, **blank)


def strict(value: Any) -> Any:
    """``value`` with every NaN or infinite float as None: strict JSON has no NaN or Infinity
    (Python writes them as bare words, which other parsers refuse). Where a loss became
    non-finite, the row's error or parity says so in words."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def append_row(path: str | Path, row: dict[str, Any]) -> None:
    """One strict-JSON line appended, flushed and fsynced: a crash later never loses a finished
    row. Non-finite numbers are written as null (:func:`strict`). A row that finds the disk full
    is not lost: it is printed on stdout, as its JSON line under a note, before the
    :class:`~fasttrain.errors.DiskFullError` goes on."""
    if row.get("kind") not in KINDS:
        raise RowError(f"row without a known kind: {str(row)[:80]}")
    line = json.dumps(strict(row), allow_nan=False)
    try:
        append_line(path, line)
    except DiskFullError as err:
        why = "the disk quota is exceeded" if err.quota else "the disk is full"
        print(f"fasttrain: this row was not saved to {err.path} ({why}); here it is, as one "
              "JSON line:", flush=True)
        print(line, flush=True)
        raise


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a JSONL file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """:func:`load_rows` of a file a user named: a missing file, a folder, a line that is not a
    JSON object, or a file without rows is a one-line :class:`FasttrainError`."""
    from ..errors import FasttrainError

    p = Path(path)
    if p.is_dir():
        raise FasttrainError(f"rows file {path} is a folder: give a .jsonl file of rows")
    if not p.is_file():
        raise FasttrainError(f"no such rows file: {path}")
    try:
        lines = p.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise FasttrainError(f"rows file {path} cannot be read as text ({err})") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise FasttrainError(f"rows file {path}, line {n}: not JSON ({err})") from None
        if not isinstance(row, dict):
            raise FasttrainError(f"rows file {path}, line {n}: not a row (a JSON object)")
        rows.append(row)
    if not rows:
        raise FasttrainError(f"rows file {path} holds no rows")
    return rows
