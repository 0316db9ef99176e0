"""The inference ladder's table: rung, batch, throughput, ms a batch, batch-1 latency (p50/p90),
peak memory, TFLOP/s, against the peer (throughput ×, latency ×), top-1 agreement with fp32
and the top-1 change, and what the rung did — rendered from rows only, within 80 columns."""
from __future__ import annotations

from rich import box
from rich.table import Table

COLUMNS = ("rung", "img/s", "ms", "b1 p50/p90", "GiB", "TFLOP/s", "× peer", "b1 ×", "agree",
           "Δtop1")


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _agree(row: dict) -> str:
    acc = row.get("accuracy") or {}
    if acc.get("agreement") is None:
        return "–"
    return f"{'✓' if acc.get('passed') else '✗'} {acc['agreement'] * 100:.1f}%"


def _top1(row: dict) -> str:
    acc = row.get("accuracy") or {}
    if acc.get("top1") is None or acc.get("top1_ref") is None:
        return "–"
    return f"{(acc['top1'] - acc['top1_ref']) * 100:+.2f}"


def note(row: dict) -> str | None:
    """Why a row has no figures, or what it changed, for under the table: what the rung adds to
    fasttrain's layers (quantized linears, the GELU epilogue, the last block on the class token,
    its own CUDA graphs), or else what converting them did."""
    if row.get("error"):
        return f"error: {row['error']}"
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    applied = row.get("applied") or {}
    heads = applied.get("head_tokens") or {}
    added = [(applied.get("quant") or {}).get("line"), applied.get("epilogue"),
             heads.get("blocks") and heads.get("line"),
             applied.get("capture") and f"CUDA graphs: {applied['capture']}"]
    return "; ".join(a for a in added if a) or applied.get("convert") or None


def row_cells(row: dict) -> list[str]:
    lat = row.get("latency_ms") or {}
    lat_s = f"{lat['p50']:.2f}/{lat['p90']:.2f}" if lat else "–"
    step = row.get("step_time_s")
    thr = row.get("throughput")
    return [row.get("rung") or "?", "–" if thr is None else f"{thr:,.0f}",
            _f(step and step * 1e3, ".2f"), lat_s, _f(row.get("peak_allocated_gib"), ".1f"),
            _f(row.get("tflops"), ".0f" if (row.get("tflops") or 0) >= 10 else ".2g"),
            _f(row.get("x_peer"), ".2f"), _f(row.get("latency_x_peer"), ".2f"), _agree(row),
            _top1(row)]


NARROW_DROPS = ("ms", "GiB", "TFLOP/s")
"""Left out below 100 columns (the rows keep them; ``fasttrain report`` shows them again)."""


def inference_table(rows: list[dict], title: str | None = None,
                    width: int | None = None) -> Table:
    """The rows of one inference ladder as a table: columns no row has a value in are left
    out, and below 100 columns of ``width`` the ones in ``NARROW_DROPS`` too, so that it fits
    80. Notes (errors, skips, quantized layers) go under it via :func:`notes`."""
    cells = [row_cells(row) for row in rows]
    keep = [i for i, col in enumerate(COLUMNS)
            if (i == 0 or any(c[i] != "–" for c in cells))
            and not (width is not None and width < 100 and col in NARROW_DROPS)]
    t = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
              padding=(0, 1))
    for i in keep:
        t.add_column(COLUMNS[i], justify="left" if i == 0 else "right", no_wrap=True)
    for c in cells:
        t.add_row(*(c[i] for i in keep))
    return t


def notes(rows: list[dict]) -> list[str]:
    batch = next((r.get("batch") for r in rows if r.get("batch")), None)
    out = [f"img/s and ms at {f'batch {batch}' if batch else 'the batch'}; b1: batch-1 "
           "latency in ms (p50/p90); × peer: "
           "throughput over the torch.compile peer; b1 ×: latency over the peer's (below 1 is "
           "faster); agree: top-1 agreement with fp32 (✓ ≥ 99%); Δtop1: points against fp32 "
           "on labelled data"]
    out += [f"{r.get('rung')}: {n}" for r in rows if (n := note(r))]
    return out


def line(row: dict) -> str:
    """One plain line of a finished rung, for streaming output."""
    cells = dict(zip(COLUMNS, row_cells(row)))
    tail = note(row)
    return "  ".join(f"{k} {v}" for k, v in cells.items() if v != "–") + (
        f"  ({tail})" if tail else "")
