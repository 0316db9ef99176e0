"""Each chart of the HTML report: a Figure where the rows carry its data, None where they do
not; drawn without pyplot or any global matplotlib state."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fasttrain.measure.rows import load_rows
from fasttrain.report import plots

ROWS = load_rows(Path(__file__).with_name("rows.jsonl"))  # ladder, peer, profile, scaling, inference


def kinds(*names: str) -> list[dict]:
    return [r for r in ROWS if r["kind"] in names]


# chart → (the rows it draws, rows it has nothing to draw from)
CASES = {
    "ladder_chart": (kinds("ladder"), kinds("peer", "profile", "scaling", "inference")),
    "loss_chart": (kinds("ladder"), kinds("profile", "scaling", "inference")),
    "breakdown_chart": (kinds("profile"), kinds("peer", "scaling", "inference")),
    "memory_chart": (kinds("profile"), kinds("scaling")),
    "kernel_chart": (kinds("profile"), kinds("ladder", "peer", "scaling", "inference")),
    "scaling_chart": (kinds("scaling"), kinds("ladder", "peer", "profile", "inference")),
    "inference_throughput_chart": (kinds("inference"), kinds("ladder", "peer", "profile",
                                                             "scaling")),
    "inference_latency_chart": (kinds("inference"), kinds("ladder", "peer", "profile", "scaling")),
    "inference_accuracy_chart": (kinds("inference"), kinds("ladder", "peer", "profile",
                                                           "scaling")),
    "long_chart": (kinds("long"), kinds("ladder", "peer", "profile", "scaling", "inference")),
}


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    return buf.getvalue()


def test_every_chart_has_a_case():
    assert {c.draw.__name__ for c in plots.CHARTS} == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_chart_with_and_without_its_rows(name):
    draw = getattr(plots, name)
    with_rows, without = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a missing glyph, a bad layout: a failure
        fig = draw(with_rows)
        assert fig is not None and fig.axes
        assert _png(fig).startswith(b"\x89PNG")
        assert draw(ROWS) is not None  # everything at once
    assert draw(without) is None
    assert draw([]) is None


def test_failed_and_missing_rungs_are_drawn_as_such():
    ladder = plots.ladder_chart(kinds("ladder", "peer"))
    texts = [t.get_text() for t in ladder.axes[0].texts]
    assert "error" in texts and "skipped" in texts  # cuda-graphs crashed, fp8 was skipped
    assert any(t.startswith("✓") for t in texts)
    assert any("peer" in t.get_text() for t in ladder.axes[0].get_legend().get_texts())
    acc = plots.inference_accuracy_chart(kinds("inference"))
    assert "error" in [t.get_text() for t in acc.axes[0].texts]  # the fp8 rung
    assert any("gate 99%" in t.get_text() for t in acc.axes[0].get_legend().get_texts())


def test_ladder_of_errors_only_and_inference_without_measurements():
    broken = [{"kind": "ladder", "rung": "fp32", "error": "OOM", "env": {}}]
    assert plots.ladder_chart(broken) is not None
    assert plots.loss_chart(broken) is None  # no losses
    bare = [{**r, "latency_ms": None, "accuracy": None} for r in kinds("inference")]
    assert plots.inference_throughput_chart(bare) is not None
    assert plots.inference_latency_chart(bare) is None
    assert plots.inference_accuracy_chart(bare) is None


def test_loss_chart_compares_with_fp32():
    fig = plots.loss_chart(kinds("ladder"))
    losses, deviation = fig.axes[:2]
    assert len(losses.lines) == 7  # the measured rungs, fp32 among them
    curves = [ln for ln in deviation.lines if not ln.get_label().startswith("_")]
    assert len(curves) == 6  # every rung but fp32 itself (beside the tolerance lines)
    no_ref = [r for r in kinds("ladder") if r["rung"] != "fp32"]
    assert len(plots.loss_chart(no_ref).axes) == 1  # nothing to compare with


def test_no_global_matplotlib_state():
    """Importing the report imports no matplotlib; drawing uses no pyplot, sets no backend."""
    code = ("import sys\n"
            "import fasttrain.report.html\n"
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported at import'\n"
            "from fasttrain.report import plots\n"
            "from fasttrain.measure.rows import load_rows\n"
            f"rows = load_rows({str(Path(__file__).with_name('rows.jsonl'))!r})\n"
            "assert all(c.draw(rows) is not None for c in plots.CHARTS)\n"
            "import matplotlib\n"
            "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'\n"
            "assert matplotlib.rcParams._get_backend_or_none() is None, 'a backend was set'\n")
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
