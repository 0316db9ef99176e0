"""One forward of an inference rung, kernel by kernel in launch order, and what sustained load
does to its time: for finding where a rung's time goes beyond the kernels' own sum.

usage (GPU machine, from the repository root):
  PYTHONPATH=src python3 benchmarks/runs/infer_timeline.py timm:vit_base_patch16_224 \
      --rungs peer-compile,captured --batch 64 --out $OUT/timeline.jsonl

Per rung, two rows:
- ``timeline``: the rung compiled without CUDA graphs (``mode=None``, the kernels its graphs
  replay), one forward's kernels in order with their start (µs from the first) and duration,
  and the idle time between them (the host runs ahead: a call is issued long before the GPU
  gets to it, so the idle time is the GPU's own);
- ``sustained``: the rung as it is (graphs included): ms per call over short bursts from an
  idle GPU and over a long back-to-back run, with the SM clock and power nvidia-smi reports
  while each runs (the bursts' samples are mostly of the idle pauses between them).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fasttrain.inference.model import load_classifier, prepare
from fasttrain.inference.spec import PEERS, RUNGS
from fasttrain.measure.env import environment
from fasttrain.measure.files import append_line
from fasttrain.workloads import load_workload


def one_forward(fwd, x: torch.Tensor, calls: int = 5) -> list[dict]:
    """The kernels of the middle one of ``calls`` forwards, in start order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fwd(x)
        torch.cuda.synchronize()
    ks = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    if len(ks) % calls:  # the forwards launch the same kernels, or the split below is wrong
        raise SystemExit(f"{len(ks)} kernels in {calls} forwards: not the same kernels each")
    per = len(ks) // calls
    mid = ks[per * (calls // 2): per * (calls // 2 + 1)]
    t0 = mid[0][0]
    rows, prev_end = [], t0
    for s, e, name in mid:
        rows.append({"kernel": name[:90], "start_us": round(s - t0, 2),
                     "us": round(e - s, 2), "idle_before_us": round(max(0.0, s - prev_end), 2)})
        prev_end = max(prev_end, e)
    return rows


class Sampler:
    """nvidia-smi's SM clock (MHz) and power (W) every 100 ms while in a ``with`` block."""

    def __init__(self, index: int):
        self.index = str(index)  # nvidia-smi's numbering (CUDA_VISIBLE_DEVICES unset)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                                  "--format=csv,noheader,nounits", "-i", self.index],
                                 capture_output=True, text=True).stdout.split(",")
            try:
                self.samples.append((float(out[0]), float(out[1])))
            except (ValueError, IndexError):
                pass
            time.sleep(0.1)

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clk, pw = zip(*self.samples)
        return {"sm_mhz_median": statistics.median(clk), "sm_mhz_min": min(clk),
                "power_w_median": statistics.median(pw), "samples": len(clk)}


def timed(fwd, x: torch.Tensor, calls: int) -> float:
    """ms per call of ``calls`` back-to-back calls (CUDA events around the whole)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fwd(x)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / calls


def sustained(fwd, x: torch.Tensor, long_s: float) -> dict:
    for _ in range(5):
        fwd(x)
    torch.cuda.synchronize()
    bursts = []
    index = x.device.index or 0
    with Sampler(index) as idle_clock:
        for _ in range(10):
            time.sleep(0.3)
            bursts.append(timed(fwd, x, 5))
    per = timed(fwd, x, 20)
    n = max(50, int(long_s * 1e3 / per))
    with Sampler(index) as load_clock:
        long_ms = timed(fwd, x, n)
    return {"burst_ms": statistics.median(bursts), "long_ms": long_ms, "long_calls": n,
            "clock_bursts": idle_clock.summary(), "clock_long": load_clock.summary()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--rungs", default="peer-compile,captured")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--long-s", type=float, default=8.0)
    ap.add_argument("--image", type=int, default=224, help="the model's image size")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    wl = load_workload(args.workload, "base", seed=0)
    out = Path(args.out)
    x = torch.randint(0, 256, (args.batch, args.image, args.image, 3), dtype=torch.uint8,
                      device=device)
    for name in args.rungs.split(","):
        rung = {**RUNGS, **PEERS}[name]
        base = {"workload": args.workload, "rung": name, "batch": args.batch,
                "env": environment(device)}
        with torch.inference_mode():
            fwd, applied = prepare(load_classifier(wl), rung.without_graphs(), device)
            for _ in range(3):
                fwd(x)
            torch.cuda.synchronize()
            ks = one_forward(fwd, x)
            busy = sum(k["us"] for k in ks)
            span = ks[-1]["start_us"] + ks[-1]["us"]
            append_line(out, json.dumps({"kind": "inference-timeline", **base, "kernels": ks,
                                         "busy_us": busy, "span_us": span, "applied": applied}))
            print(f"== {name} b{args.batch}: {len(ks)} kernels, busy {busy:.0f} us, "
                  f"span {span:.0f} us")
            gaps = sorted(ks, key=lambda k: -k["idle_before_us"])[:8]
            for k in gaps:
                print(f"   idle {k['idle_before_us']:6.1f} us before {k['kernel'][:70]}")
            del fwd
            torch._dynamo.reset()
            fwd, applied = prepare(load_classifier(wl), rung, device)
            s = sustained(fwd, x, args.long_s)
            append_line(out, json.dumps({"kind": "inference-sustained", **base, **s}))
            print(f"   {name} as is: burst {s['burst_ms']:.3f} ms, long {s['long_ms']:.3f} ms "
                  f"({s['long_calls']} calls); clocks {s['clock_bursts']} / {s['clock_long']}")
            del fwd
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
