"""Register caps (Triton's ``maxnreg``) for the bias + GELU kernels of ``kernels/activations.py``
at ViT-B's fc1 (25,216 × 3,072, bf16), as ``benchmarks/seq_attention_maxnreg.py`` found them
worth 21% for the attention's dk/dv kernel: the backward at 2, 3 and 4 persistent programs an
SM, the forward at 4, 6 and 8, each uncapped and capped. The ops' launches are replaced by
plain launches with the cap (this process only). One JSONL row per setting, the median ms of a
CUDA-graph replay, in ``$OUT/gelu-regs.jsonl``.

    OUT=/tmp/x PYTHONPATH=src:benchmarks python3 benchmarks/gelu_maxnreg.py
"""
from __future__ import annotations

import os

import torch

from fasttrain.env import environment
from fasttrain.kernels import activations as act
from kernels_micro import append_rows, time_or_error  # benchmarks/, the script's own folder

CAP = {"maxnreg": None}


def capped_launch(kernel, grid, *args, **meta):
    cap = CAP["maxnreg"]
    kernel[grid](*args, **meta, **({"maxnreg": cap} if cap else {}))


def main() -> None:
    env = environment("cuda")
    act.launch = capped_launch
    x = torch.randn(128 * 197, 3072, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    b = torch.randn(3072, device="cuda")
    default = dict(act.LAUNCH)
    grid = [("bias_gelu_bwd", "programs_per_sm", (2, 3, 4), (None, 128, 96, 80),
             lambda: torch.ops.fasttrain.bias_gelu_bwd(dy, x, b, "none")),
            ("bias_gelu_fwd", "fwd_programs_per_sm", (4, 6, 8), (None, 80, 64),
             lambda: torch.ops.fasttrain.bias_gelu_fwd(x, b, "none"))]
    rows = []
    for kernel, key, per_sm, caps, fn in grid:
        for programs in per_sm:
            for cap in caps:
                act.LAUNCH.update(default, **{key: programs})
                CAP["maxnreg"] = cap
                ms, error = time_or_error(fn)
                rows.append({"kind": "regs-probe", "kernel": kernel, "programs_per_sm": programs,
                             "maxnreg": cap, "ms": ms, "error": error, "env": env})
                print(kernel, programs, cap, f"{ms * 1e3:.1f} us" if ms else error, flush=True)
    act.LAUNCH.update(default)
    append_rows(os.path.join(os.environ["OUT"], "gelu-regs.jsonl"), rows)


if __name__ == "__main__":
    main()
