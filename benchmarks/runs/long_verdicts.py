"""Merge the row files of one long_parity_x4.sh call, judging each switch against its own
GPU's baseline with the other GPUs' baselines of the same workload as the baseline's repeats.

The x4 script ran each Llama switch beside its own baseline on its own GPU, at the same time,
before ``ladder --long`` repeated the baseline itself; the three baselines of that call (same
recipe, seed and data, identical H200s) are repeats of one another, and
``fasttrain.measure.curves.compare_curves(..., repeats=...)`` is the rule ``ladder --long``
now applies. The verdict the run printed stays in each row as ``curve_alone``.

With ``--train`` it judges the ``fasttrain train`` rows of one long_split_x4.sh call instead:
gpu0 is the baseline, gpu1 its repeat, gpu2 bf16 weights, gpu3 the bf16 stream; the rows are
written as ``long`` rows (``rung`` named, ``from_row`` naming the train row file).

usage: python benchmarks/runs/long_verdicts.py [--train] OUT_FOLDER DEST.jsonl WORKLOAD
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fasttrain.ladder.long_run import BASELINE, REPEAT, repeat_curve
from fasttrain.measure.curves import compare_curves
from fasttrain.measure.files import write_atomic


def merge(folder: Path, workload: str) -> list[dict]:
    files = sorted(folder.glob(f"gpu*/long-{workload}-*.jsonl"))
    runs = {f.parent.name: [json.loads(x) for x in f.read_text().splitlines()] for f in files}
    baselines = {slot: next(r for r in rows if r["rung"] == BASELINE) for slot, rows in runs.items()}
    out = []
    for slot, rows in runs.items():
        ref = baselines[slot]
        others = [b["losses"] for s, b in baselines.items() if s != slot and b.get("losses")]
        for row in rows:
            row = {**row, "slot": slot}
            if row["rung"] != BASELINE and row.get("curve") and row.get("losses"):
                row["curve_alone"] = row["curve"]
                row["curve"] = compare_curves(row["losses"], ref["losses"], repeats=others)
                row["curve"]["repeats_from"] = sorted(s for s in baselines if s != slot)
            out.append(row)
    return out


SPLIT = {"gpu0": BASELINE, "gpu1": REPEAT, "gpu2": "bf16-weights", "gpu3": "bf16-stream"}


def merge_train(folder: Path, workload: str) -> list[dict]:
    rows = {}
    for slot, rung in SPLIT.items():
        f = next((folder / slot).glob(f"train-{workload}-*.jsonl"))
        rows[slot] = {**json.loads(f.read_text().splitlines()[-1]), "kind": "long", "rung": rung,
                      "slot": slot, "from_row": f"{slot}/{f.name}"}
    ref, repeat = rows["gpu0"]["losses"], rows["gpu1"]["losses"]
    rows["gpu1"]["curve"] = repeat_curve(repeat, ref)
    for slot in ("gpu2", "gpu3"):
        rows[slot]["curve"] = compare_curves(rows[slot]["losses"], ref, repeats=[repeat])
        rows[slot]["speedup"] = rows["gpu0"]["step_time_s"] / rows[slot]["step_time_s"]
    return list(rows.values())


if __name__ == "__main__":
    train = sys.argv[1] == "--train"
    args = sys.argv[2:] if train else sys.argv[1:]
    folder, dest, workload = Path(args[0]), Path(args[1]), args[2]
    rows = (merge_train if train else merge)(folder, workload)
    write_atomic(dest, "".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        c = r.get("curve") or {}
        print(f"{r['slot']} {r['rung']:14s} last {c.get('final_loss', float('nan')):.4f} "
              f"Δ {c.get('final_rel_dev', float('nan')):.2%} allowed "
              f"{(c.get('tolerance') or {}).get('final', float('nan')):.2%} passed {c.get('passed')}")
