"""Launch settings of the window-attention kernel on one CUDA device: forward + backward time
of Swin-B's stage 1 and stage 3 windows (batch 64) for each setting of
``kernels.window_attention.LAUNCH`` tried, one JSONL row each. Also compiles the op with
Inductor in-process and records its traceback if that fails.

    PYTHONPATH=src python3 benchmarks/window_tune.py --out $OUT/window-tune.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json
import traceback
from pathlib import Path

import torch

from fasttrain.env import environment


def compiled_check() -> str | None:
    """None if Inductor compiles the op (fwd + bwd) and matches eager, else the traceback."""
    import torch._inductor.config as cfg

    from fasttrain.kernels.window_attention import window_attention
    from fasttrain.workloads.swin import shift_mask

    cfg.compile_threads = 1  # the compile error in this process, not in a worker's
    qkv = torch.randn(64, 49, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(4, 49, 49, device="cuda", requires_grad=True)
    mask = shift_mask(28, 7, 3).cuda()
    try:
        out = torch.compile(lambda q, b: window_attention(q, b, mask, 4) * 2)(qkv, bias)
        out.float().sum().backward()
        return None
    except Exception:  # noqa: BLE001 - the point is to record it
        return traceback.format_exc()


def main() -> int:
    from triton.testing import do_bench

    from fasttrain.kernels import window_attention as wa
    from fasttrain.workloads.swin import shift_mask

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = environment("cuda")
    rows = [{"kind": "window-compile-check", "traceback": compiled_check(), "env": env}]
    print("inductor:", rows[0]["traceback"] or "compiled", flush=True)
    for stage, windows, heads, dim, res in [(1, 4096, 4, 128, 56), (3, 256, 16, 512, 14)]:
        qkv = torch.randn(windows, 49, 3 * dim, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True)
        bias = torch.randn(heads, 49, 49, device="cuda", requires_grad=True)
        mask = shift_mask(res, 7, 3).cuda()
        dy = torch.randn(windows, 49, dim, device="cuda", dtype=torch.bfloat16)
        for fw, stages in itertools.product((2, 4, 8), (1, 2, 3)):  # the forward's settings
            wa.LAUNCH.update(fwd_warps=fw, stages=stages)
            ms = do_bench(lambda: wa.window_attention(qkv, bias, mask, heads), warmup=5, rep=30)
            rows.append({"kind": "window-tune", "pass": "forward", "stage": stage,
                         "fwd_warps": fw, "stages": stages, "ms": ms, "env": env})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "env"}), flush=True)
        for bw, per_sm, stages in itertools.product((4, 8), (4, 8, 16), (1, 2, 3)):
            wa.LAUNCH.update(bwd_warps=bw, programs_per_sm=per_sm, stages=stages)
            out = wa.window_attention(qkv, bias, mask, heads)
            ms = do_bench(lambda: torch.autograd.grad(out, (qkv, bias), dy, retain_graph=True),
                          warmup=5, rep=30)
            rows.append({"kind": "window-tune", "pass": "backward", "stage": stage,
                         "bwd_warps": bw, "programs_per_sm": per_sm, "stages": stages,
                         "ms": ms, "env": env})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "env"}), flush=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
