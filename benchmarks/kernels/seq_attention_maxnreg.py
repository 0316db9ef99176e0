"""Register caps (Triton's ``maxnreg``) for the kernels of ``kernels/seq_attention.py`` at ViT-B
batch 128 (bf16, the backward with the qkv bias's gradient sums): each kernel launched alone,
uncapped and capped at 168, 160, 128 and 96 registers a thread, with 2 and 3 pipelining stages.
At 181 registers only two dk/dv programs of 4 warps fit an SM (65,536 registers); at 168, three.
One JSONL row per (kernel, cap, stages): the median ms of a CUDA-graph replay, in
``$OUT/regs.jsonl``. Registers and spills of a setting: compile it for sm_90 (``cuobjdump
-res-usage``), as ``erf_tune.py --sass`` did
(commit 4cf847d, ``benchmarks/reports/2026-11-history.md``).

    OUT=/tmp/x PYTHONPATH=src python3 benchmarks/kernels/seq_attention_maxnreg.py
"""
from __future__ import annotations

import os

import torch

from fasttrain.measure.env import environment
from fasttrain.kernels import seq_attention as module
from fasttrain.kernels._seq_attention_kernels import _dkv_kernel, _dq_kernel, _fwd_kernel
from kernels_micro import append_rows, time_or_error  # benchmarks/kernels/, the script's own folder

CAPS = (None, 168, 160, 128, 96)
STAGES = (2, 3)


def main() -> None:
    env = environment("cuda")
    batch, tokens, heads, dim = 128, 197, 12, 64
    bf = dict(device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(batch, tokens, 3 * heads * dim, **bf)
    dout = torch.randn(batch, tokens, heads * dim, **bf)
    scale = dim ** -0.5
    out, lse = torch.ops.fasttrain.seq_attention_fwd(qkv, None, heads, scale, False)
    dqkv = torch.empty_like(qkv)
    delta = torch.empty_like(lse)
    sh, nblk, meta = module._meta(qkv, heads, False, "bwd")
    parts = torch.empty((batch * nblk, 3 * heads * dim), device="cuda", dtype=torch.float32)
    fsh, fnblk, fmeta = module._meta(qkv, heads, False, "fwd")
    launches = {  # kernel: (kernel, grid, args, its settings)
        "dkv": (_dkv_kernel, (sh * nblk,), (qkv, dout, lse, delta, dqkv, parts, scale),
                dict(meta, SUMS=True)),
        "dq": (_dq_kernel, (sh * nblk,), (qkv, dout, out, lse, dqkv, delta, parts, scale),
               dict(meta, SUMS=True)),
        "fwd": (_fwd_kernel, (fsh * fnblk,), (qkv, out, lse, scale), fmeta)}
    kernel, grid, args, settings = launches["dq"]
    kernel[grid](*args, **settings)  # delta for the dk/dv kernel
    rows = []
    for name, (kernel, grid, args, settings) in launches.items():
        for cap in CAPS:
            for stages in STAGES:
                extra = {"maxnreg": cap} if cap else {}
                fn = lambda: kernel[grid](*args, **dict(settings, STAGES=stages), **extra)
                ms, error = time_or_error(fn)
                rows.append({"kind": "seq-attention-maxnreg", "kernel": name, "maxnreg": cap,
                             "stages": stages, "ms": ms, "error": error, "env": env})
                print(name, cap, stages, f"{ms * 1e3:.1f} us" if ms else error, flush=True)
    append_rows(os.path.join(os.environ["OUT"], "regs.jsonl"), rows)


if __name__ == "__main__":
    main()
