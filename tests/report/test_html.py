"""The HTML report (``fasttrain report ROWS --html FILE``): one self-contained page, written
atomically, bad input in one line; and the page opened in headless Chromium, where it must load
without console errors and draw every chart. The screenshot is kept (FASTTRAIN_ARTIFACTS, else
pytest's tmp folder)."""
from __future__ import annotations

import base64
import html
import json
import os
import re
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from fasttrain.cli import main
from fasttrain.measure.rows import load_rows
from fasttrain.report import html as report_html
from fasttrain.report import plots
from fasttrain.report.table import COLUMNS

ROWS_FILE = Path(__file__).with_name("rows.jsonl")  # ladder, peer, profile, scaling, inference
ROWS = load_rows(ROWS_FILE)
ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0
CHROMIUM = Path("/usr/bin/chromium")
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
chromium = pytest.mark.skipif(
    not CHROMIUM.exists() and not IN_CI,
    reason="needs /usr/bin/chromium (apt-get install chromium; .ci/run installs it); "
           "with CI=true this test fails instead of skipping")


def _report(tmp_path, rows: list[dict] | None = None, name: str = "report.html") -> str:
    """The page rendered through the CLI from ``rows`` (default: the fixture file)."""
    src = ROWS_FILE
    if rows is not None:
        src = tmp_path / "rows.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / name
    assert main(["report", str(src), "--html", str(out)]) == 0
    return out.read_text()


def _one_line(capsys, argv: list[str], needle: str) -> None:
    rc = main(argv)
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert rc == 2, cap.err
    assert "Traceback" not in cap.err + cap.out
    assert len(lines) == 1 and needle in lines[0], cap.err
    assert lines[0].startswith("fasttrain: error: ")


def _charts(page: str) -> list[str]:
    return re.findall(r'<figure class="chart" data-chart="([^"]+)"', page)


# the page itself

def test_page_is_self_contained(tmp_path):
    page = _report(tmp_path)
    assert not re.search(r"""(?:src|href|action|poster|srcset)\s*=\s*["']?\s*(?:https?:)?//""",
                         page, re.I), "the page loads something from the network"
    assert not re.search(r"<script|<link|<iframe|<object|@import|url\(", page, re.I)
    images = re.findall(r'<img [^>]*src="([^"]+)"', page)
    assert len(images) == len(plots.CHARTS) == len(_charts(page))  # every chart, one image each
    for src in images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(b"\x89PNG")
    assert "No rows for" not in page
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_ladder_rows_only_show_the_ladder_charts(tmp_path):
    page = _report(tmp_path, [r for r in ROWS if r["kind"] in ("ladder", "peer")])
    assert _charts(page) == ["ladder", "loss curves", "step breakdown", "memory"]
    missing = re.search(r'<p class="missing">No rows for: ([^<]+)\.</p>', page).group(1)
    for title in ("kernel categories", "scaling", "inference throughput", "inference latency",
                  "inference accuracy"):
        assert title in missing


def test_ladders_of_two_workloads_get_a_panel_each_in_their_own_unit():
    """img/s and tok/s never share an axis; CPU rows carry no speed-up on their bars."""
    vit = [r for r in ROWS if r["kind"] in ("ladder", "peer")]
    llama = [{**r, "workload": "llama", "size": "tiny", "throughput_unit": "tok/s",
              "device": "cpu"} for r in vit if r["kind"] == "ladder"]
    fig = plots.ladder_chart(vit + llama)
    axes = fig.get_axes()
    assert [ax.get_ylabel() for ax in axes] == [f"throughput ({vit[0]['throughput_unit']})",
                                                "throughput (tok/s)"]
    assert axes[0].get_title().startswith("vit base: ")
    assert axes[1].get_title().startswith("llama tiny: ")
    assert axes[0].get_legend() is not None and axes[1].get_legend() is None  # vit's peer only
    cpu_notes = [t.get_text() for t in axes[1].texts]
    assert cpu_notes and not any("×" in t for t in cpu_notes)
    assert any("×" in t.get_text() for t in axes[0].texts)


def test_header_and_table(tmp_path):
    page = _report(tmp_path)
    head = page[:page.index("<figure")]
    assert "NVIDIA H200" in head and "2.11.0+cu130" in head  # env.device_name, env.torch
    assert re.findall(r"<th[^>]*>([^<]+)</th>", page) == [html.escape(c) for c in COLUMNS]
    rows = re.findall(r'<tr class="([a-z]*)">', page)
    assert len(rows) == len([r for r in ROWS if r["kind"] not in ("fast", "ratio")])
    assert rows.count("error") == 2 and rows.count("skipped") == 1 and rows.count("failed") == 1
    assert "best fasttrain rung" in page  # the table's peer summary


def test_several_row_files_make_one_page(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in ROWS if r["kind"] == "ladder"))
    b.write_text("".join(json.dumps(r) + "\n" for r in ROWS if r["kind"] == "scaling"))
    out = tmp_path / "both.html"
    assert main(["report", str(a), str(b), "--html", str(out)]) == 0
    page = out.read_text()
    assert page.count("<table>") == 2 and "scaling" in _charts(page) and "ladder" in _charts(page)


# bad input: one line, exit 2

def test_bad_rows_files(capsys, tmp_path):
    out = str(tmp_path / "r.html")
    _one_line(capsys, ["report", str(tmp_path / "missing.jsonl"), "--html", out],
              "no such rows file")
    (tmp_path / "empty.jsonl").write_text("\n")
    _one_line(capsys, ["report", str(tmp_path / "empty.jsonl"), "--html", out], "no rows")
    assert not Path(out).exists()


def test_bad_html_paths(capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    rows = str(ROWS_FILE)
    _one_line(capsys, ["report", rows, "--html", str(tmp_path / "nope" / "r.html")],
              "no such folder")
    _one_line(capsys, ["report", rows, "--html", str(tmp_path / "a-file" / "r.html")],
              "no such folder")
    _one_line(capsys, ["report", rows, "--html", str(tmp_path)], "is a folder")


def test_html_folder_not_writable(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(report_html.os, "access", lambda path, mode: False)
    _one_line(capsys, ["report", str(ROWS_FILE), "--html", str(tmp_path / "r.html")],
              "is not writable")


@pytest.mark.skipif(ROOT_USER, reason="root writes into read-only folders")
def test_html_read_only_folder(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    _one_line(capsys, ["report", str(ROWS_FILE), "--html", str(ro / "r.html")], "not writable")


def test_html_write_fails(capsys, tmp_path, monkeypatch):
    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_html, "write_atomic", full_disk)
    _one_line(capsys, ["report", str(ROWS_FILE), "--html", str(tmp_path / "r.html")],
              "cannot write it (No space left on device)")


# in a browser

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]

# Collects load and script errors (capture phase: a broken <img> reports there too) ...
CATCH = ("<script>window.__errors=[];addEventListener('error',function(e){__errors.push(String("
         "e.message||('failed to load '+((e.target&&(e.target.src||e.target.href))||'?')"
         ".slice(0,80))))},true);</script>")
# ... and once the page has loaded, counts the charts whose image is decoded and has a size.
COUNT = ("<script>addEventListener('load',function(){"
         "var c=[].slice.call(document.querySelectorAll('figure.chart'));"
         "var d=c.filter(function(f){var el=f.querySelector('img,svg');if(!el)return false;"
         "var r=el.getBoundingClientRect();return r.width>0&&r.height>0&&"
         "(el.tagName!=='IMG'||(el.complete&&el.naturalWidth>0));});"
         "document.body.setAttribute('data-check',JSON.stringify({charts:c.length,"
         "drawn:d.map(function(f){return f.dataset.chart}),errors:__errors}));});</script>")


def _chromium(args: list[str], profile: Path, timeout: float = 120) -> tuple[str, str]:
    """Run headless Chromium (its own process group, killed whole on a timeout)."""
    assert CHROMIUM.exists(), ("CI=true but /usr/bin/chromium is missing: install it "
                               "(apt-get install chromium; .ci/run does)")
    proc = subprocess.Popen([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish in {timeout:.0f} s: {' '.join(args)}")
    assert proc.returncode == 0, err[-2000:]
    return out, err


@pytest.fixture
def artifacts(tmp_path) -> Path:
    """Where the page and its screenshot are kept: $FASTTRAIN_ARTIFACTS/report, else tmp."""
    root = os.environ.get("FASTTRAIN_ARTIFACTS")
    folder = Path(root) / "report" if root else tmp_path / "artifacts"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@chromium
def test_page_in_headless_chromium(tmp_path, artifacts):
    page = _report(artifacts, name="report.html")
    checked = tmp_path / "checked.html"  # the same page with the two checking scripts added
    checked.write_text(page.replace("<head>", "<head>" + CATCH, 1)
                       .replace("</body>", COUNT + "</body>", 1))
    dom, log = _chromium(["--dump-dom", checked.as_uri()], tmp_path / "profile")
    found = re.search(r'data-check="([^"]*)"', dom)
    assert found, f"the page did not finish loading: {log[-2000:]}"
    check = json.loads(html.unescape(found.group(1)))
    assert check["errors"] == []
    assert [ln for ln in log.splitlines() if ":CONSOLE" in ln] == []  # console messages
    assert check["charts"] == len(plots.CHARTS)
    assert check["drawn"] == [c.title for c in plots.CHARTS]

    shot = artifacts / "report.png"
    shot.unlink(missing_ok=True)
    _chromium([f"--screenshot={shot}", "--window-size=1280,8000", "--hide-scrollbars",
               (artifacts / "report.html").as_uri()], tmp_path / "profile")
    from PIL import Image

    with Image.open(shot) as im:
        assert im.size == (1280, 8000)
        assert len(im.convert("L").getcolors(256) or []) > 10  # drawn, not a blank page
    print(f"screenshot: {shot}")
