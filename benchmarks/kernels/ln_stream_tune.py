"""Launch settings of the fused residual add + LayerNorm (``kernels/norms.py``) on a 16-bit
stream (its ``_16`` settings), forward and backward, as pre-norm blocks run it with
``stream_dtype=bf16`` (ViT-B) or where the stream is bf16 anyway (Swin-B after its first
stage, SD's transformer blocks): the branch x, the residual stream and h all bf16, the branch's
bias added in fp32, y bf16 for the next matmul; backward dy, the stream's gradient and h bf16,
x's bias summed, no second copy of x's gradient. One JSONL row per (shape, direction,
setting): the median ms of a CUDA-graph replay and GB/s of the minimal traffic (8 bytes an
element each way: forward reads x and the residual and writes h and y; backward reads dy, dh
and h and writes dx). ``default`` marks the settings in LAUNCH.

    PYTHONPATH=src python3 benchmarks/kernels/ln_stream_tune.py --out $OUT/ln-stream-tune.jsonl
"""
from __future__ import annotations

import argparse
import itertools

import torch

from fasttrain.measure.env import environment
from fasttrain.kernels import norms
from kernels_micro import append_rows, time_or_error  # benchmarks/kernels/, the script's own folder

SHAPES = [("vit-b", 128 * 197, 768), ("swin-b stage 2", 64 * 784, 256),
          ("swin-b stage 3", 64 * 196, 512), ("sd 64x64", 8 * 4096, 320),
          ("sd 32x32", 8 * 1024, 640), ("sd 16x16", 8 * 256, 1280)]
FWD = dict(fwd_elements_16=(4096, 8192), fwd_warps_16=(4, 8))
BWD = dict(programs_per_sm_16=(1, 2), bwd_warps=(4, 8))


def _sweep(shape: tuple, direction: str, grid: dict, fn, env: dict) -> list[dict]:
    name, n, d = shape
    default, rows = dict(norms.LAUNCH), []
    for values in itertools.product(*grid.values()):
        cfg = dict(zip(grid, values))
        norms.LAUNCH.update(default, **cfg)
        ms, error = time_or_error(fn)
        rows.append({"kind": "ln-stream-tune", "shape": name, "direction": direction, "rows": n,
                     "dim": d, "stream": "bf16", **cfg,
                     "default": all(default[k] == v for k, v in cfg.items()),
                     "ms": ms, "gb_per_s": n * d * 8 / ms / 1e6 if ms else None,
                     "error": error, "env": env})
    norms.LAUNCH.update(default)
    ok = [r for r in rows if r["ms"]]
    best, now = min(ok, key=lambda r: r["ms"]), next(r for r in ok if r["default"])
    print(f"== {name} {direction}: default {now['ms'] * 1e3:.1f} us "
          f"({now['gb_per_s']:.0f} GB/s), best {best['ms'] * 1e3:.1f} us at "
          f"{({k: best[k] for k in grid})}; " + ", ".join(
              f"{r['ms'] * 1e3:.1f}" for r in ok), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env, bf16 = environment("cuda"), dict(device="cuda", dtype=torch.bfloat16)
    for shape in SHAPES:
        _, n, d = shape
        x, res = torch.randn(n, d, **bf16), torch.randn(n, d, **bf16)
        w, b, xb = (torch.randn(d, device="cuda") for _ in range(3))
        fwd = lambda: torch.ops.fasttrain.layer_norm_fwd(x, xb, res, w, b, 1e-6, torch.bfloat16)
        _, h, mean, rstd = fwd()
        dy, dh = torch.randn(n, d, **bf16), torch.randn(n, d, **bf16)
        bwd = lambda: torch.ops.fasttrain.layer_norm_bwd(dy, dh, h, w, mean, rstd, True,
                                                         torch.bfloat16)
        append_rows(args.out, _sweep(shape, "forward", FWD, fwd, env)
                    + _sweep(shape, "backward", BWD, bwd, env))


if __name__ == "__main__":
    main()
