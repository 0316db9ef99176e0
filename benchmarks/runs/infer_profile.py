"""Where an inference rung's forward spends its GPU time: the kernels of one rung and one batch,
grouped by name, per call. For comparing fasttrain's rungs with the torch.compile peer kernel by
kernel (CUDA graphs hide the kernels from the profiler, so every rung is compiled here without
them, ``mode=None``; the kernels are the same ones the graphs replay).

usage (GPU machine, from the repository root):
  PYTHONPATH=src python3 benchmarks/runs/infer_profile.py timm:vit_base_patch16_224 \
      --rungs peer-compile,kernels,fp8 --batches 1,64 --out $OUT/profile.jsonl
Writes one JSON row per (rung, batch): the environment, the ms per call the kernels add up to,
and the kernels (name, calls per forward, ms per forward), largest first; prints the top of each.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fasttrain.inference.model import load_classifier, prepare
from fasttrain.inference.spec import PEERS, RUNGS
from fasttrain.measure.env import environment
from fasttrain.measure.files import append_line
from fasttrain.workloads import load_workload


def kernel_table(fwd, x: torch.Tensor, calls: int) -> list[dict]:
    """(name, calls per forward, ms per forward) of every CUDA kernel of ``calls`` forwards."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fwd(x)
        torch.cuda.synchronize()
    ms, n = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms[e.name] += e.device_time / 1e3 / calls
            n[e.name] += 1
    rows = [{"kernel": k, "per_call": n[k] / calls, "ms": ms[k]} for k in ms]
    return sorted(rows, key=lambda r: -r["ms"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--rungs", default="peer-compile,kernels")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    wl = load_workload(args.workload, "base", seed=0)
    out = Path(args.out)
    for name in args.rungs.split(","):
        rung = {**RUNGS, **PEERS}[name]
        rung = rung.without_graphs()
        with torch.inference_mode():
            fwd, applied = prepare(load_classifier(wl), rung, device)
            for b in [int(s) for s in args.batches.split(",")]:
                x = torch.randint(0, 256, (b, 224, 224, 3), dtype=torch.uint8, device=device)
                for _ in range(3):
                    fwd(x)
                torch.cuda.synchronize()
                table = kernel_table(fwd, x, args.calls)
                total = sum(r["ms"] for r in table)
                row = {"kind": "inference-profile", "workload": args.workload, "rung": name,
                       "batch": b, "env": environment(device),
                       "kernel_ms": total, "kernels": table, "applied": applied}
                append_line(out, json.dumps(row))
                print(f"== {name} b{b}: {total:.3f} ms of kernels per forward "
                      f"({sum(r['per_call'] for r in table):.0f} launches)")
                for r in table[:12]:
                    print(f"  {r['ms']:7.3f} ms  ×{r['per_call']:<4.0f} {r['kernel'][:110]}")
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
