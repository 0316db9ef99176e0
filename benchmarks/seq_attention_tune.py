"""Launch settings of ``kernels/seq_attention.py`` at ViT shapes (bf16; the backward with the
qkv bias's gradient summed in its kernels, as ViT runs it), above all ``*_pair``: whether a
sequence's partial last block (197 tokens: 16 rows) is a program of its own or goes to the
program of the last full block as a second tile against the same loads. One JSONL row per (shape, pass,
settings): the median ms of a CUDA-graph replay of the op alone, TFLOP/s of its useful matmuls
(forward two, backward five) over the real tokens, and the largest difference of its outputs
from the library's settings'.

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
GRIDS = {"fwd": dict(fwd_pair=(False, True), fwd_stages=(2, 3)),
         "bwd": dict(dq_pair=(False, True), dkv_pair=(False, True), bwd_stages=(2, 3))}


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
        calls = {"fwd": lambda: torch.ops.fasttrain.seq_attention_fwd(qkv, None, heads, scale,
                                                                      False),
                 "bwd": lambda: torch.ops.fasttrain.seq_attention_bwd(dout, qkv, out, lse,
                                                                      heads, scale, False,
                                                                      True)}
        matmuls = {"fwd": 2, "bwd": 5}
        rows = []
        for way, grid in GRIDS.items():
            want = calls[way]()
            for values in itertools.product(*grid.values()):
                cfg = dict(zip(grid, values))
                module.LAUNCH.update(default, **cfg)
                try:
                    got = calls[way]()
                    diff = max((a.float() - b.float()).abs().max().item()
                               for a, b in zip(got, want))
                    ms, error = graph_ms(calls[way]), None
                except Exception as e:  # noqa: BLE001 - a failing setting is a row
                    ms, diff, error = None, None, f"{type(e).__name__}: {str(e)[:200]}"
                flop = matmuls[way] * 2 * batch * heads * tokens * tokens * dim
                r = {"kind": "seq-attention-tune", "shape": name, "batch": batch,
                     "tokens": tokens, "heads": heads, "head_dim": dim, "pass": way, **cfg,
                     "ms": ms, "tflops": flop / ms / 1e9 if ms else None,
                     "max_diff": diff, "error": error, "env": env}
                rows.append(r)
                print(f"{name} {way} {cfg} "
                      + (f"{ms * 1e3:.1f} us {r['tflops']:.0f} TFLOP/s diff {diff:.2g}" if ms
                         else str(error)), flush=True)
            module.LAUNCH.update(default)
        append_rows(args.out, rows)


if __name__ == "__main__":
    main()
