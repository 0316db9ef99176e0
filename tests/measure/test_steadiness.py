"""How steady a measurement is, and the peer ratio measured ours, peer, peer, ours."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from fasttrain.ladder import confirm, runner
from fasttrain.ladder.runner import LadderSpec, run_ladder
from fasttrain.recipe import Recipe
from fasttrain.report.table import markdown_table
from fasttrain.report.table import peer_summary as _peer_summary
from fasttrain.measure.steadiness import (PEER_HOST_BOUND, REPEAT_TOLERANCE, UNSTEADY_IQR,  # noqa: E501
                                         confirmed_ratio, needs_another, spread)

ROOT = Path(__file__).resolve().parents[2]


def peer_summary(rows: list[dict]) -> str | None:
    """The summary of these fake ladders (run on the CPU, standing for a GPU's timings) as a
    GPU's rows get it: a CPU's rows quote no ratio."""
    return _peer_summary([{**r, "device": "cuda"} if r.get("device") == "cpu" else r
                          for r in rows])


def test_spread_is_the_interquartile_range_over_the_median():
    times = [0.0231, 0.0230, 0.0232, 0.0231, 0.0229, 0.0230, 0.0231, 0.0233]
    s = spread(times)
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    assert s["iqr_rel"] == pytest.approx((q3 - q1) / statistics.median(times))
    assert s["range_rel"] == pytest.approx((0.0233 - 0.0229) / statistics.median(times))
    assert s["steady"] and s["iqr_rel"] < 0.01


def test_spread_marks_a_run_whose_steps_scatter_and_ignores_one_outlier():
    steady_but_one = [0.030] * 19 + [0.060]  # one slow step: the median and the IQR hold
    assert spread(steady_but_one)["steady"] and spread(steady_but_one)["range_rel"] == 1.0
    scattered = [0.044, 0.058, 0.047, 0.055, 0.050, 0.053, 0.045, 0.057]
    s = spread(scattered)
    assert not s["steady"] and s["iqr_rel"] > UNSTEADY_IQR
    assert spread([0.1, 0.2, 0.3]) is None and spread([]) is None  # too few steps to say


def _row(rung: str, throughput: float, kind: str = "ladder", iqr: float = 0.004) -> dict:
    return {"kind": kind, "rung": rung, "throughput": throughput, "throughput_unit": "img/s",
            "error": None, "spread": {"iqr_rel": iqr, "range_rel": iqr * 2,
                                      "steady": iqr <= UNSTEADY_IQR}}


def test_confirmed_ratio_quotes_best_against_best_and_checks_the_repeats():
    ours = [_row("fast", 2775.9), _row("fast (repeat)", 2780.2)]
    peer = [_row("peer", 1757.4, "peer"), _row("peer (repeat)", 1750.0, "peer")]
    r = confirmed_ratio(ours, peer)
    assert r["ratio"] == pytest.approx(2780.2 / 1757.4)
    assert r["ratio_mean"] == pytest.approx((2775.9 + 2780.2) / (1757.4 + 1750.0))
    assert r["steady"] and r["reason"] is None
    assert r["repeat_disagreement"]["peer"] == pytest.approx((1757.4 - 1750.0) / 1757.4)


def test_the_disturbed_peer_of_the_h200_run_is_caught():
    """ladder-swin-base-20261121-140645: the peer measured 1,216.8 img/s, then alone 1,728.5."""
    ours = [_row("swin-base-layernorm", 2775.9), _row("swin-base-layernorm (repeat)", 2779.0)]
    peer = [_row("peer", 1216.8, "peer", iqr=0.12), _row("peer (repeat)", 1728.5, "peer")]
    r = confirmed_ratio(ours, peer)
    assert not r["steady"] and r["repeat_disagreement"]["peer"] is None
    assert "the peer has 1 of 2 runs with steady steps, not two to compare" in r["reason"]
    assert "peer: step times spread 12.0%" in r["reason"]
    assert r["reason"].endswith(PEER_HOST_BOUND)  # why a peer's steps scatter
    assert r["ratio"] == pytest.approx(2779.0 / 1728.5)  # not 2.28x
    peer = [_row("peer", 1728.5, "peer"), _row("peer (repeat)", 1216.8, "peer")]
    r = confirmed_ratio(ours, peer)  # steady steps, a whole run off: the repeats disagree
    assert not r["steady"] and r["repeat_disagreement"]["peer"] > REPEAT_TOLERANCE
    assert PEER_HOST_BOUND not in r["reason"]  # its steps did not scatter
    assert "the peer's two fastest steady runs differ by 29.6% (1,728.5, 1,216.8)" in r["reason"]


def test_a_third_measurement_that_agrees_with_the_best_confirms_it():
    """The H200 run ladder-swin-base-20261121-152338: the peer measured 1,749.7 img/s (steady),
    then 1,331.5 with a 12.9% spread; a third measurement near the first settles it."""
    ours = [_row("fast", 2789.5), _row("fast (repeat)", 2789.4)]
    peer = [_row("peer", 1749.7, "peer", iqr=0.016), _row("peer (repeat)", 1331.5, "peer", 0.129),
            _row("peer (repeat 2)", 1741.0, "peer", iqr=0.012)]
    r = confirmed_ratio(ours, peer)
    assert r["steady"] and r["ratio"] == pytest.approx(2789.5 / 1749.7)
    assert r["peer_throughput"] == [1749.7, 1331.5, 1741.0]
    assert needs_another(peer[:2]) and not needs_another(peer)
    # three slow, scattered measurements agreeing with each other are still unsteady
    slow = [_row(f"peer {i}", t, "peer", iqr=0.15) for i, t in enumerate((1298.5, 1131.6, 1290))]
    r = confirmed_ratio(ours, slow)
    assert not r["steady"] and "peer 0: step times spread 15.0%" in r["reason"]
    assert "the peer has 0 of 3 runs with steady steps" in r["reason"]


def test_confirmed_ratio_needs_two_measurements_of_each_side():
    ok, failed = _row("a", 2.0), {**_row("b", 1.0), "error": "out of memory"}
    assert confirmed_ratio([ok, ok], [ok, failed]) is None
    assert confirmed_ratio([ok], [ok, ok]) is None
    assert confirmed_ratio([ok, ok], [ok, failed, ok])["steady"]


class _FakeChildren:
    """Stand-ins for the rung and peer processes: rows with throughputs, losses and step times
    (``(throughput, iqr)`` pairs give a row scattered steps)."""

    def __init__(self, peer: list, ours: dict[str, list]):
        self.peer = list(peer)
        self.ours = {k: list(v) for k, v in ours.items()}
        self.order: list[str] = []

    @staticmethod
    def _times(t):
        t, iqr = t if isinstance(t, tuple) else (t, 0.0)
        mid = 8 / t
        return t, [mid * (1 - iqr), mid * (1 - iqr / 3), mid, mid * (1 + iqr / 3),
                   mid * (1 + iqr)]

    def run_rung(self, spec, name, recipe, workdir):
        self.order.append(name)
        t = self.ours[name.split(" (repeat")[0]].pop(0)
        if t is None:
            return {"error": "out of memory: boom"}
        t, times = self._times(t)
        return {"batch": 8, "steps": 5, "step_time_s": 8 / t, "throughput": t,
                "throughput_unit": "img/s", "losses": [2.0, 1.9, 1.8, 1.7], "error": None,
                "spread": spread(times), "recipe": recipe.to_dict()}

    def run_in_child(self, spec, workdir, name, timeout=None, extra_env=None, nproc=1):
        assert spec.job == "fasttrain.peers:peer_job"
        self.order.append("peer")
        t = self.peer.pop(0)
        if t is None:
            return {"error": "process exited with 1: boom"}
        t, times = self._times(t)
        return {"kind": "peer", "peer": "timm:vit bf16+compile", "rung": "peer bf16+compile",
                "batch": 8, "step_time_s": 8 / t, "throughput": t, "throughput_unit": "img/s",
                "error": None, "spread": spread(times)}


def _ladder(monkeypatch, tmp_path, fake, rungs=("fp32", "bf16"), **kw):
    monkeypatch.setattr(runner, "run_rung", fake.run_rung)
    monkeypatch.setattr(confirm, "run_rung", fake.run_rung)
    monkeypatch.setattr(confirm, "run_in_child", fake.run_in_child)
    spec = LadderSpec(workload="vit", size="tiny", rungs=list(rungs), steps=4, warmup=1,
                      device="cpu", base=Recipe(), peer=True, out=tmp_path / "rows.jsonl", **kw)
    return run_ladder(spec)


def test_the_ladder_measures_ours_peer_peer_ours_after_its_rungs(monkeypatch, tmp_path):
    # the ladder's own bf16 run (330, the fastest of the rungs) is not one of the four
    fake = _FakeChildren([250.0, 252.0], {"fp32": [100.0], "bf16": [330.0, 300.0, 301.0]})
    rows = _ladder(monkeypatch, tmp_path, fake)
    assert fake.order == ["fp32", "bf16", "bf16 (repeat)", "peer", "peer", "bf16 (repeat 2)"]
    assert [(r["kind"], r["rung"]) for r in rows] == [
        ("ladder", "fp32"), ("ladder", "bf16"), ("ladder", "bf16 (repeat)"),
        ("peer", "peer bf16+compile"), ("peer", "peer bf16+compile (repeat)"),
        ("ladder", "bf16 (repeat 2)"), ("ratio", "bf16")]
    again, ratio = rows[5], rows[6]
    assert again["repeat_of"] == "bf16" and again["parity"]["against"] == "bf16"
    assert again["parity"]["passed"] and again["speedup"] == pytest.approx(3.01)
    assert ratio["ratio"] == pytest.approx(301.0 / 252.0) and ratio["steady"]
    assert ratio["ours_throughput"] == [300.0, 301.0] and ratio["peer_throughput"] == [250, 252]
    written = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["rung"] for r in written] == [r["rung"] for r in rows]
    summary = peer_summary(rows)
    assert "'bf16'" in summary and "1.19x" in summary and ": steady)" in summary
    assert "ours 300.0, 301.0, the peer's 250.0, 252.0" in summary
    table = markdown_table(rows)
    assert "| spread |" in table and "peer: timm:vit bf16+compile (repeat)" in table
    assert "| ratio" not in table  # the ratio row is the caption, not a table row


def test_a_disturbed_peer_is_measured_a_third_time(monkeypatch, tmp_path):
    fake = _FakeChildren([150.0, 250.0, 248.0], {"fp32": [100.0], "bf16": [300.0] * 3})
    rows = _ladder(monkeypatch, tmp_path, fake)
    assert fake.order[2:] == ["bf16 (repeat)", "peer", "peer", "bf16 (repeat 2)", "peer"]
    assert rows[-2]["rung"] == "peer bf16+compile (repeat 2)"
    assert "peer: timm:vit bf16+compile (repeat 2)" in markdown_table(rows)
    ratio = rows[-1]
    assert ratio["steady"] and ratio["ratio"] == pytest.approx(300.0 / 250.0)
    assert ratio["peer_throughput"] == [150.0, 250.0, 248.0]
    assert "the peer's 150.0, 250.0, 248.0: steady" in peer_summary(rows)


def test_scattered_steps_alone_also_get_a_third_run(monkeypatch, tmp_path):
    # the peer's two runs agree, but the faster one scattered (IQR 12%): a third run settles
    # it, and the best is the fastest steady run
    fake = _FakeChildren([(251.0, 0.12), 250.0, 249.0], {"fp32": [100.0], "bf16": [300.0] * 3})
    rows = _ladder(monkeypatch, tmp_path, fake)
    assert fake.order[-1] == "peer" and len(rows[-1]["peer_throughput"]) == 3
    assert rows[-1]["steady"] and rows[-1]["ratio"] == pytest.approx(300.0 / 250.0)


def test_sides_that_stay_apart_make_the_ratio_unsteady(monkeypatch, tmp_path):
    fake = _FakeChildren([150.0, 250.0, 200.0], {"fp32": [100.0],
                                                 "bf16": [300.0, 300.0, 240.0, 280.0]})
    rows = _ladder(monkeypatch, tmp_path, fake)
    assert fake.order[2:] == ["bf16 (repeat)", "peer", "peer", "bf16 (repeat 2)", "peer",
                              "bf16 (repeat 3)"]
    ratio = rows[-1]
    assert not ratio["steady"] and ratio["ratio"] == pytest.approx(300.0 / 250.0)
    assert "the peer's two fastest steady runs differ by 20.0%" in ratio["reason"]
    assert "fasttrain's two fastest steady runs differ by 6.7%" in ratio["reason"]
    assert "NOT STEADY" in peer_summary(rows) and "1.20x" in peer_summary(rows)


def test_no_confirmation_when_switched_off_or_when_the_peer_failed(monkeypatch, tmp_path):
    fake = _FakeChildren([250.0], {"fp32": [100.0], "bf16": [300.0]})
    rows = _ladder(monkeypatch, tmp_path, fake, confirm=False)
    assert [r["kind"] for r in rows] == ["ladder", "ladder", "peer"]
    assert "(same run)" in peer_summary(rows)
    fake = _FakeChildren([None], {"fp32": [100.0], "bf16": [300.0, 300.0]})
    rows = _ladder(monkeypatch, tmp_path / "b", fake)
    assert [r["kind"] for r in rows] == ["ladder", "ladder", "ladder", "peer"]
    assert rows[-1]["error"] and fake.order[-1] == "peer"


@pytest.mark.parametrize("peer, ours, failed", [
    ([250.0, None], [300.0] * 3, "peer (repeat) did not run (process exited with 1: boom)"),
    ([250.0, 250.0], [300.0, 300.0, None], "bf16 (repeat 2) did not run (out of memory: boom)"),
])
def test_a_failed_repeat_leaves_the_ratio_unconfirmed(monkeypatch, tmp_path, peer, ours, failed):
    fake = _FakeChildren(peer, {"fp32": [100.0], "bf16": ours})
    rows = _ladder(monkeypatch, tmp_path, fake)
    ratio = rows[-1]
    assert ratio["kind"] == "ratio" and ratio["ratio"] is None and not ratio["steady"]
    assert ratio["reason"].startswith(f"not confirmed: {failed}"), ratio["reason"]
    assert "1.20x the peer's 250.0 (same run; not confirmed" in peer_summary(rows)


def test_the_fast_search_keeps_its_candidate_and_the_repeats_are_not_candidates(monkeypatch,
                                                                                 tmp_path):
    """The search's kept rung is the one confirmed, even where a repeat measures faster."""
    from fasttrain.ladder.search import pick_fast

    fake = _FakeChildren([250.0, 250.0], {"fp32": [100.0], "fast: compile": [300.0, 303.0, 304.0]})
    monkeypatch.setattr(runner.FastSearch, "__init__", _one_candidate_search)
    rows = _ladder(monkeypatch, tmp_path, fake, rungs=["fast"])
    assert fake.order == ["fp32", "fast: compile", "fast: compile (repeat)", "peer", "peer",
                          "fast: compile (repeat 2)"]
    assert pick_fast(rows)["rung"] == "fast: compile" and not pick_fast(rows).get("repeat_of")
    assert rows[-1]["rung"] == "fast: compile" and rows[-1]["ratio"] == pytest.approx(304 / 250)


def _one_candidate_search(self, workload, base, processes=1):
    from fasttrain.ladder.search import fast_start

    self.start = fast_start(workload, base)
    self.recipe, self.parts, self._pending, self.axes, self.best = self.start[1], {}, {}, [], None
    self.skipped, self.idle = [], {}


def test_cli_has_the_switch():
    from fasttrain.cli import build_parser

    args = build_parser().parse_args(["ladder", "vit", "--peer", "--no-confirm"])
    assert args.peer and not args.confirm
    assert build_parser().parse_args(["ladder", "vit", "--peer"]).confirm


@pytest.mark.skipif(sys.platform != "linux", reason="subprocess rows")
def test_train_rows_carry_their_spread(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fasttrain", "train", "vit", "--device", "cpu",
                           "--steps", "4", "--warmup", "1", "--json", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    start = proc.stdout.index("{")
    row = json.loads(proc.stdout[start:proc.stdout.rindex("}") + 1])
    assert set(row["spread"]) == {"iqr_rel", "range_rel", "steady"}


def test_an_unsteady_ratio_still_states_the_floor_no_scatter_can_move():
    """ratio_floor: our slowest run against the peer at its fastest single step of any run
    (Swin-B's peer on an H200 jumped between 36 and 57 ms steps): printed beside an unsteady
    ratio as the bound that holds."""
    def timed(rung, kind, median_s, fastest_s, iqr):
        return {**_row(rung, 64 / median_s, kind, iqr), "step_time_s": median_s,
                "step_time_min_s": fastest_s}

    ours = [timed("fast", "ladder", 0.0201, 0.0196, 0.005),
            timed("fast (repeat)", "ladder", 0.0200, 0.0196, 0.007)]
    peer = [timed("peer", "peer", 0.0443, 0.0416, 0.07),
            timed("peer (repeat)", "peer", 0.0451, 0.0360, 0.22)]
    r = confirmed_ratio(ours, peer)
    assert not r["steady"]
    assert r["ratio_floor"] == pytest.approx((64 / 0.0201) / (64 / 0.0360))
    assert r["ratio_floor"] < r["ratio"]
    rows = [*ours, *peer, {"kind": "ratio", "rung": "fast", **r}]
    assert "at least 1.79x however the runs scatter" in peer_summary(rows)
