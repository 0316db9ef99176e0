"""The one-kernel narrow MLP (``kernels/fused_mlp.py``) against the path it replaces on the
inference rungs — fc1 with its bias and GELU in cuBLASLt's epilogue, then fc2 without its bias
(the next norm adds it) — at Swin-B's stage shapes (batch 64, fp16), for several launch
settings; one JSONL row each, timed by CUDA-graph replay, with the largest deviation from the
fp32 reference.

    PYTHONPATH=src python3 benchmarks/kernels/mlp_kernel_micro.py --out $OUT/mlp-kernel.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from fasttrain.kernels import fused_mlp
from fasttrain.kernels.gemm_epilogue import linear_gelu
from fasttrain.measure.env import environment
from kernels_micro import append_rows, graph_ms  # benchmarks/kernels/, the script's own folder

STAGES = [(1, 64 * 56 * 56, 128), (2, 64 * 28 * 28, 256)]  # stage, tokens, channels


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env, rows = environment("cuda"), []
    default = dict(fused_mlp.LAUNCH)
    settings = [dict(block_m=m, block_m_wide=m, block_h=h, warps=w, stages=s)
                for m, h, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3))]
    torch.manual_seed(0)
    with torch.inference_mode():
        for stage, tokens, c in STAGES:
            dt = torch.float16
            x = torch.randn(tokens, c, device="cuda", dtype=dt)
            w1 = torch.randn(4 * c, c, device="cuda", dtype=dt) / c ** 0.5
            b1 = 0.1 * torch.randn(4 * c, device="cuda", dtype=dt)
            w2 = torch.randn(c, 4 * c, device="cuda", dtype=dt) / (2 * c ** 0.5)
            ref = fused_mlp.mlp_reference(x, w1, b1, w2, None, "none").float()
            base = graph_ms(lambda: F.linear(linear_gelu(x, w1, b1), w2))
            dev = (F.linear(linear_gelu(x, w1, b1), w2).float() - ref).abs().max().item()
            row = {"kind": "mlp-kernel-micro", "stage": stage, "tokens": tokens, "channels": c,
                   "path": "cublas gelu epilogue + fc2", "ms": base, "max_dev": dev, "env": env}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "env"}), flush=True)
            for setting in settings:
                fused_mlp.LAUNCH.update(default, **setting)
                try:
                    ms = graph_ms(lambda: fused_mlp.mlp(x, w1, b1, w2, None, "none"))
                    out = fused_mlp.mlp(x, w1, b1, w2, None, "none").float()
                    dev, err = (out - ref).abs().max().item(), None
                except Exception as e:  # noqa: BLE001 - a setting that fails is a result
                    ms, dev, err = None, None, str(e).splitlines()[0][:200]
                row = {"kind": "mlp-kernel-micro", "stage": stage, "tokens": tokens,
                       "channels": c, "path": "fused", **setting, "ms": ms, "max_dev": dev,
                       "x_base": base / ms if ms else None, "error": err, "env": env}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "env"}), flush=True)
    fused_mlp.LAUNCH.update(default)
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
