"""Launch settings of the fused residual-add + LayerNorm backward (``kernels/norms.py``) as the
pre-norm blocks run it under bf16 autocast: dy bf16, the stream's gradient and h fp32, x's
bias summed, and — since x (the branch) is bf16 — x's gradient written a second time in bf16
(``x_dtype``), against the same kernel without that second store. One JSONL row per (shape,
second store, programs per SM, warps, pipelining stages, elements per tile): the median ms of
a CUDA-graph replay and GB/s of its minimal traffic (read dy, dh, h; write dx, and the bf16
copy where it is written).

    PYTHONPATH=src python3 benchmarks/kernels/ln_bwd_tune.py --out $OUT/ln-bwd-tune.jsonl
"""
from __future__ import annotations

import argparse
import itertools

import torch

from fasttrain.measure.env import environment
from fasttrain.kernels import norms
from kernels_micro import append_rows, graph_ms  # benchmarks/kernels/, the script's own folder

SHAPES = [("vit-b", 128 * 197, 768), ("swin-b stage 1", 64 * 3136, 128)]
GRID = dict(programs_per_sm=(1, 2), bwd_warps=(4, 8), bwd_stages=(2, 3),
            bwd_elements=(4096, 8192))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = environment("cuda")
    default = dict(norms.LAUNCH)
    for name, rows, d in SHAPES:
        dev = "cuda"
        dy = torch.randn(rows, d, device=dev, dtype=torch.bfloat16)
        dh = torch.randn(rows, d, device=dev)
        h = torch.randn(rows, d, device=dev)
        w = torch.randn(d, device=dev)
        mean, rstd = h.mean(1), h.var(1).add(1e-6).rsqrt()
        out = []
        for dx2 in (False, True):
            nbytes = rows * d * (2 + 4 + 4 + 4 + (2 if dx2 else 0))
            x_dtype = torch.bfloat16 if dx2 else None
            want = None
            for values in itertools.product(*GRID.values()):
                cfg = dict(zip(GRID, values))
                norms.LAUNCH.update(default, **cfg)
                fn = lambda: torch.ops.fasttrain.layer_norm_bwd(dy, dh, h, w, mean, rstd, True,
                                                                x_dtype)
                try:
                    got = fn()
                    want = want if want is not None else got
                    same = all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))
                    ms, error = graph_ms(fn), None
                except Exception as e:  # noqa: BLE001 - a failing setting is a row
                    ms, same, error = None, None, f"{type(e).__name__}: {str(e)[:200]}"
                r = {"kind": "ln-bwd-tune", "shape": name, "rows": rows, "dim": d,
                     "x_grad_copy": dx2, **cfg, "ms": ms,
                     "gb_per_s": nbytes / ms / 1e6 if ms else None,
                     "same_as_first": same, "error": error, "env": env}
                out.append(r)
                print(f"{name} copy={dx2} {cfg} "
                      + (f"{ms * 1e3:.1f} us {r['gb_per_s']:.0f} GB/s" if ms else str(error)),
                      flush=True)
        norms.LAUNCH.update(default)
        append_rows(args.out, out)
        for dx2 in (False, True):
            best = min((r for r in out if r["x_grad_copy"] == dx2 and r["ms"]),
                       key=lambda r: r["ms"])
            now = next(r for r in out if r["x_grad_copy"] == dx2 and r["ms"] and all(
                r[k] == default[k] for k in GRID))
            print(f"== {name} copy={dx2}: default {now['ms'] * 1e3:.1f} us, best "
                  f"{best['ms'] * 1e3:.1f} us at " + str({k: best[k] for k in GRID}))


if __name__ == "__main__":
    main()
