"""The HTML report: one self-contained page from result rows (``fasttrain report ROWS --html``).

The page holds a header (the environment the rows were measured in), every chart of
:mod:`.plots` the rows carry data for (PNG images embedded as base64, so the page loads
nothing), a line naming the charts that had no rows, and each file's rows as the terminal's
table (same columns, same cells: :func:`.table.row_cells`). No script, no network.
"""
from __future__ import annotations

import base64
import html
import io
import os
from pathlib import Path

from ..errors import FasttrainError
from ..measure.files import write_atomic
from . import plots
from .table import COLUMNS, fast_summary, peer_summary, ratio_warning, row_cells

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1250px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
.env { color: #555; font-size: 0.9em; }
.env span { margin-right: 1.5em; }
figure.chart { margin: 1.2em 0; }
figure.chart img { max-width: 100%; height: auto; border: 1px solid #ddd; }
figcaption { color: #555; font-size: 0.9em; }
p.missing { color: #777; font-style: italic; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0 1.5em; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; }
td.left, th.left { text-align: left; }
td { white-space: nowrap; } td:last-child { white-space: normal; }
tr.error td, tr.failed td { color: #b22; }
tr.skipped td { color: #999; }
p.summary { margin: 0.2em 0; }
"""

LEFT = ("rung", "comment", "parity")  # the terminal table's left-justified columns


def _png(fig) -> str:
    """A figure as a base64 PNG data URI."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _distinct(rows: list[dict], key: str) -> list[str]:
    return sorted({str(v) for r in rows if (v := (r.get("env") or {}).get(key))})


def header(files: dict[str, list[dict]]) -> str:
    """Title, the row files, and the environment: devices, torch (and the rest of ``env``)."""
    rows = [r for rs in files.values() for r in rs]
    workloads = sorted({f"{r.get('workload')} {r.get('size')}" for r in rows if r.get("workload")})
    env = [("device", _distinct(rows, "device_name")), ("torch", _distinct(rows, "torch")),
           ("CUDA", _distinct(rows, "cuda")), ("Triton", _distinct(rows, "triton")),
           ("git", _distinct(rows, "git_sha"))]
    stamps = _distinct(rows, "timestamp")
    if stamps:
        env.append(("measured", [stamps[0] + (f" … {stamps[-1]}" if len(stamps) > 1 else "")]))
    spans = "".join(f"<span><b>{k}</b> {html.escape(', '.join(v))}</span>" for k, v in env if v)
    return (f"<h1>fasttrain report: {html.escape(', '.join(workloads) or 'rows')}</h1>\n"
            f"<p class=\"env\">{spans or '<span>no environment in the rows</span>'}</p>\n"
            f"<p class=\"env\"><b>rows</b> {html.escape(', '.join(files))}</p>")


def charts(rows: list[dict]) -> str:
    """Every chart the rows carry data for, and one line naming those that had none."""
    parts, missing = [], []
    for chart in plots.CHARTS:
        fig = chart.draw(rows)
        if fig is None:
            missing.append(f"{chart.title} (needs {chart.needs})")
            continue
        doc = html.escape((chart.draw.__doc__ or "").split("\n\n")[0].replace("\n", " "))
        parts.append(f"<figure class=\"chart\" data-chart=\"{html.escape(chart.title)}\">"
                     f"<img alt=\"{html.escape(chart.title)}\" src=\"{_png(fig)}\">"
                     f"<figcaption><b>{html.escape(chart.title)}</b>: {doc}</figcaption></figure>")
    if missing:
        parts.append(f"<p class=\"missing\">No rows for: {html.escape('; '.join(missing))}.</p>")
    return "\n".join(parts)


def _display(row: dict) -> dict:
    """A profile row names its workload where the table expects a rung."""
    if row.get("kind") == "profile" and not row.get("rung"):
        return {**row, "rung": f"profile: {row.get('workload')} {row.get('size')}"}
    return row


def rows_table(rows: list[dict], title: str) -> str:
    """The terminal table's columns and cells as HTML, with its summaries under it."""
    head = "".join(f"<th class=\"{'left' if c in LEFT else ''}\">{html.escape(c)}</th>"
                   for c in COLUMNS)
    body = []
    for row in rows:
        if row.get("kind") in ("fast", "ratio"):  # summaries, not rows (as in the terminal)
            continue
        state = ("error" if row.get("error") else "skipped" if row.get("skipped") else
                 "failed" if (row.get("parity") or {}).get("passed") is False else "")
        cells = "".join(f"<td class=\"{'left' if c in LEFT else ''}\">{html.escape(v)}</td>"
                        for c, v in zip(COLUMNS, row_cells(_display(row))))
        body.append(f"<tr class=\"{state}\">{cells}</tr>")
    notes = "".join(f"<p class=\"summary\">{html.escape(s)}.</p>" for s in (
        peer_summary(rows), fast_summary(rows), ratio_warning(rows)) if s)
    return (f"<h2>{html.escape(title)}</h2>\n<table><thead><tr>{head}</tr></thead><tbody>"
            + "\n".join(body) + f"</tbody></table>\n{notes}")


def render_html(files: dict[str, list[dict]]) -> str:
    """The whole page for the rows of each file (file name → rows)."""
    rows = [r for rs in files.values() for r in rs]
    tables = "\n".join(rows_table(rs, name) for name, rs in files.items())
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>fasttrain report</title>"
            f"<style>{STYLE}</style></head>\n<body>\n{header(files)}\n{charts(rows)}\n"
            f"<h2>Rows</h2>\n{tables}\n</body></html>\n")


def check_target(path: str | Path) -> Path:
    """The page's path, once it is known that it can be written there (one-line errors)."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise FasttrainError(f"--html {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise FasttrainError(f"--html {path}: no such folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise FasttrainError(f"--html {path}: the folder {folder} is not writable")
    return path


def write_html(files: dict[str, list[dict]], path: str | Path) -> Path:
    """Render the page and write it atomically to ``path``; returns ``path``."""
    path = check_target(path)
    if not any(files.values()):
        raise FasttrainError(f"no rows in {', '.join(files)}")
    page = render_html(files)
    try:
        return write_atomic(path, page)
    except OSError as err:
        raise FasttrainError(f"--html {path}: cannot write it ({err.strerror or err})") from None
