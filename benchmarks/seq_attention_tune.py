"""The backward of ``kernels/seq_attention.py`` as ViT runs it (bf16, the qkv bias's gradient
summed in the kernels): the two-kernel backward (dq; dk and dv) at its launch settings against
the one-kernel backward (one program a sequence and head, ``_seq_attention_fused_bwd``) over a
grid of its launch settings. One JSONL row per (shape, backward, settings): the median ms of a
CUDA-graph replay of the backward op alone, TFLOP/s of its five useful matmuls over the real
(unpadded) tokens, and the largest difference of dqkv and of the bias gradient from the
two-kernel backward's.

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
SHAPES = [("vit-b batch 128", 128, 197, 12, 64), ("vit-b batch 32", 32, 197, 12, 64)]
GRID = dict(one_block=(64, 32), one_warps=(4, 8), one_stages=(1, 2, 3))


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
        settings = [("bwd", {})] + [("one", dict(zip(GRID, v)))
                                    for v in itertools.product(*GRID.values())]
        rows, want = [], None
        for way, cfg in settings:
            module.LAUNCH.update(default, backward=way, **cfg)
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
                 "tokens": tokens, "heads": heads, "head_dim": dim, "backward": way, **cfg,
                 "ms": ms, "tflops": flop / ms / 1e9 if ms else None,
                 "max_diff_dqkv": diff and diff[0], "max_diff_dbias": diff and diff[1],
                 "error": error, "env": env}
            rows.append(r)
            print(f"{name} {way} {cfg} "
                  + (f"{ms * 1e3:.1f} us {r['tflops']:.0f} TFLOP/s diff {diff}" if ms
                     else str(error)), flush=True)
        module.LAUNCH.update(default)
        append_rows(args.out, rows)
        two = rows[0]
        best = min((r for r in rows[1:] if r["ms"]), key=lambda r: r["ms"])
        print(f"== {name}: two kernels {two['ms'] * 1e3:.1f} us, one kernel best "
              f"{best['ms'] * 1e3:.1f} us at " + str({k: best[k] for k in GRID}), flush=True)


if __name__ == "__main__":
    main()
