"""The backward of ``kernels/seq_attention.py`` as ViT runs it (bf16, the qkv bias's gradient
summed in the kernels): dS kept in memory for the dq kernel (the dk/dv kernel runs first and
stores it; dq = dS k is one matmul a pair of blocks) against dS recomputed in a dq kernel that
runs first (three matmuls a pair), over a few launch settings. One JSONL row per (shape, way,
settings): the median ms of a CUDA-graph replay of the backward op alone, TFLOP/s of its five
useful matmuls over the real (unpadded) tokens, and the largest difference of dqkv and of the
bias gradient from the first row's.

    PYTHONPATH=src:benchmarks python3 benchmarks/seq_attention_tune.py --out $OUT/seq-attn.jsonl
"""
from __future__ import annotations

import argparse
import itertools

import torch

from fasttrain.env import environment
from fasttrain.kernels import seq_attention as module
from kernels_micro import append_rows, graph_ms  # benchmarks/, the script's own folder

# (name, batch, tokens, heads, head dim)
SHAPES = [("vit-b batch 128", 128, 197, 12, 64), ("vit-l batch 64", 64, 197, 16, 64),
          ("vit-b batch 32", 32, 197, 12, 64)]
WAYS = {"dS recomputed": 0, "dS kept": 256}
GRID = dict(bwd_warps=(4, 8), bwd_stages=(2, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = environment("cuda")
    default = dict(module.LAUNCH)
    for name, batch, tokens, heads, dim in SHAPES:
        torch.manual_seed(0)
        c = heads * dim
        qkv = torch.randn(batch, tokens, 3 * c, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn(batch, tokens, c, device="cuda", dtype=torch.bfloat16)
        scale = dim ** -0.5
        out, lse = torch.ops.fasttrain.seq_attention_fwd(qkv, None, heads, scale, False)
        flop = 5 * 2 * batch * heads * tokens * tokens * dim
        rows, want = [], None
        for (way, limit), values in itertools.product(WAYS.items(),
                                                      itertools.product(*GRID.values())):
            cfg = dict(zip(GRID, values))
            module.LAUNCH.update(default, ds_max_tokens=limit, **cfg)
            fn = lambda: torch.ops.fasttrain.seq_attention_bwd(dout, qkv, out, lse, heads,
                                                               scale, False, True)
            try:
                got = fn()
                want = want if want is not None else got
                diff = [(a.float() - b.float()).abs().max().item() for a, b in zip(got, want)]
                ms, error = graph_ms(fn), None
            except Exception as e:  # noqa: BLE001 - a failing setting is a row
                ms, diff, error = None, None, f"{type(e).__name__}: {str(e)[:200]}"
            r = {"kind": "seq-attention-bwd-tune", "shape": name, "batch": batch,
                 "tokens": tokens, "heads": heads, "head_dim": dim, "way": way, **cfg,
                 "ms": ms, "tflops": flop / ms / 1e9 if ms else None,
                 "max_diff_dqkv": diff and diff[0], "max_diff_dbias": diff and diff[1],
                 "error": error, "env": env}
            rows.append(r)
            print(f"{name} {way} {cfg} "
                  + (f"{ms * 1e3:.1f} us {r['tflops']:.0f} TFLOP/s diff {diff}" if ms
                     else str(error)), flush=True)
        module.LAUNCH.update(default)
        append_rows(args.out, rows)
        for way in WAYS:
            best = min((r for r in rows if r["way"] == way and r["ms"]), key=lambda r: r["ms"])
            print(f"== {name} {way}: best {best['ms'] * 1e3:.1f} us at "
                  + str({k: best[k] for k in GRID}), flush=True)


if __name__ == "__main__":
    main()
