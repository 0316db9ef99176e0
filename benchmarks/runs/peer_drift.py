"""Why the timm Swin-B peer's step times drift upward within a run: its loop as the ladder
times it (no sync between steps, CUDA events around each step), with the host's time in each
``step()`` call recorded beside the events' GPU time; then the same with Python's garbage
collector off, then with a sync after every step. One JSON row per phase on stdout and in
``$OUT/peer-drift.jsonl``, with the SM clock before and after.
  PYTHONPATH=src python3 benchmarks/runs/peer_drift.py [timm:NAME] [STEPS]
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import torch

from fasttrain.measure.env import environment
from fasttrain.peers import _builder
from fasttrain.peers.loop import RECIPES, make_step, precision_flags


def sm_clock() -> str:
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()


def phase(step, steps: int, sync_each: bool) -> dict:
    host, events = [], []
    torch.cuda.synchronize()
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        step()
        end.record()
        if sync_each:
            torch.cuda.synchronize()
        host.append((time.perf_counter() - t) * 1e3)
        events.append((start, end))
    torch.cuda.synchronize()
    gpu = [s.elapsed_time(e) for s, e in events]
    return {"host_ms": [round(x, 2) for x in host], "event_ms": [round(x, 2) for x in gpu]}


def main() -> None:
    workload = sys.argv[1] if len(sys.argv) > 1 else "timm:swin_base_patch4_window7_224"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    recipe, dev = RECIPES["bf16+compile"], torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    with precision_flags(recipe):
        spec = _builder(workload)(workload, "base", None, dev, False, recipe, options={})
        mods = {k: torch.compile(m) for k, m in spec.modules.items()}
        step = make_step(spec, mods, recipe, dev)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        for name, sync_each, gc_off in (("as-timed", False, False), ("gc-off", False, True),
                                        ("sync-each", True, False), ("as-timed-again", False,
                                                                     False)):
            before = sm_clock()
            if gc_off:
                gc.collect()
                gc.disable()
            out = phase(step, steps, sync_each)
            gc.enable()
            rows.append({"kind": "peer-drift", "workload": workload, "phase": name,
                         "clock_before": before, "clock_after": sm_clock(), **out,
                         "env": environment()})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "env"}), flush=True)
    path = os.path.join(os.environ.get("OUT", "out"), "peer-drift.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
