"""Does the layout a linear layer keeps its weight in change cuBLAS's speed? ViT-B's four
projections (batch 128 × 197 tokens, bf16) timed each way a training step runs them — forward
Y = X Wᵀ, input gradient dX = dY W, weight gradient dW = dYᵀ X — with the weight stored as
nn.Linear stores it, (out, in), against stored transposed, (in, out) (forward X W', input
gradient dY W'ᵀ, weight gradient Xᵀ dY). Also the forward with the bias in cuBLAS's epilogue
(``addmm``), as F.linear runs it. One JSONL row per (layer, pass, layout): the median ms of a
CUDA-graph replay and TFLOP/s.

    PYTHONPATH=src:benchmarks python3 benchmarks/gemm_layout_micro.py --out $OUT/gemm-layout.jsonl
"""
from __future__ import annotations

import argparse

import torch

from fasttrain.env import environment
from kernels_micro import append_rows, graph_ms  # benchmarks/, the script's own folder

TOKENS = 128 * 197
LAYERS = [("qkv", 768, 2304), ("proj", 768, 768), ("fc1", 768, 3072), ("fc2", 3072, 768)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = environment("cuda")
    rows = []
    for name, k, n in LAYERS:
        torch.manual_seed(0)
        bf = dict(device="cuda", dtype=torch.bfloat16)
        x, dy = torch.randn(TOKENS, k, **bf), torch.randn(TOKENS, n, **bf)
        w = torch.randn(n, k, **bf) / k ** 0.5
        wt = w.t().contiguous()
        b = torch.randn(n, **bf)
        calls = {
            ("fwd", "(out, in)"): lambda: x @ w.t(),
            ("fwd", "(in, out)"): lambda: x @ wt,
            ("fwd+bias", "(out, in)"): lambda: torch.addmm(b, x, w.t()),
            ("fwd+bias", "(in, out)"): lambda: torch.addmm(b, x, wt),
            ("dgrad", "(out, in)"): lambda: dy @ w,
            ("dgrad", "(in, out)"): lambda: dy @ wt.t(),
            ("wgrad", "(out, in)"): lambda: dy.t() @ x,
            ("wgrad", "(in, out)"): lambda: x.t() @ dy,
        }
        flop = 2 * TOKENS * k * n
        for (way, layout), fn in calls.items():
            ms = graph_ms(fn)
            r = {"kind": "gemm-layout-micro", "layer": name, "tokens": TOKENS, "in": k,
                 "out": n, "pass": way, "weight_layout": layout, "ms": ms,
                 "tflops": flop / ms / 1e9, "env": env}
            rows.append(r)
            print(f"{name} {way:9s} {layout} {ms * 1e3:7.1f} us {r['tflops']:5.0f} TFLOP/s",
                  flush=True)
    append_rows(args.out, rows)


if __name__ == "__main__":
    main()
