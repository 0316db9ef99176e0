"""Microbenchmarks of fasttrain's kernels against eager PyTorch and torch.compile of the
reference, forward + backward, on one CUDA device. One JSONL row per (kernel, shape, variant)
with the time (median of triton.testing.do_bench, forward + backward; the norms' loss sums y and
h, so the sums' own kernels are in every variant), the achieved TFLOP/s or GB/s against the
device's ceilings (H200: ~800 TFLOP/s bf16 matmul, 4.2 TB/s copy) and the peak memory.

    PYTHONPATH=src python3 benchmarks/kernels_micro.py --out $OUT/kernels-micro.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fasttrain.env import environment


def _bench(fn, args) -> tuple[float, float]:
    """(ms per forward+backward, peak GiB above the inputs)."""
    from triton.testing import do_bench

    def step():
        for a in args:
            if a.requires_grad:
                a.grad = None
        fn(*args).backward()

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return do_bench(step, warmup=5, rep=50, return_mode="median"), peak


def _row(env: dict, kernel: str, variant: str, shape: dict, dtype: str, ms: float, peak: float,
         rate: tuple[str, float]) -> dict:
    """One result row, printed as it is made; ``rate`` is ("tflops" | "gb_per_s", value)."""
    unit = "TFLOP/s" if rate[0] == "tflops" else "GB/s"
    print(f"{kernel} {' x '.join(str(v) for v in shape.values())} {variant:24s} {ms:8.3f} ms "
          f"{rate[1]:7.1f} {unit}  peak {peak:6.2f} GiB", flush=True)
    return {"kind": "kernel-micro", "kernel": kernel, "variant": variant, "shape": shape,
            "dtype": dtype, "ms": ms, rate[0]: rate[1], "peak_gib": peak, "env": env}


def linear_ce_rows(env: dict) -> list[dict]:
    from fasttrain.kernels.linear_cross_entropy import (linear_cross_entropy,
                                                        linear_cross_entropy_reference)

    rows = []
    for tokens, dim, vocab in [(8192, 2048, 128256), (4096, 3072, 128256), (8192, 768, 50257)]:
        h = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(vocab, dim, device="cuda") * 0.02).requires_grad_()
        y = torch.randint(0, vocab, (tokens,), device="cuda")
        flops = 3 * 2 * tokens * dim * vocab  # logits, grad hidden, grad weight

        def autocast(f):
            def run(h, w):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return f(h, w, y)
            return run

        torch._dynamo.reset()
        variants = {"eager reference": autocast(linear_cross_entropy_reference),
                    "compiled reference": torch.compile(autocast(linear_cross_entropy_reference)),
                    "fused (chunks of 2048)": autocast(linear_cross_entropy)}
        for name, fn in variants.items():
            ms, peak = _bench(fn, (h, w))
            rows.append(_row(env, "linear_cross_entropy", name,
                             {"tokens": tokens, "dim": dim, "vocab": vocab},
                             "bf16 autocast, fp32 weight", ms, peak, ("tflops", flops / ms / 1e9)))
    return rows


def norm_rows(env: dict) -> list[dict]:
    """Residual add + RMSNorm / LayerNorm, bf16 activations, fp32 weights."""
    from fasttrain.kernels import norms

    rows = []
    cases = [("rms_norm", "llama-1B", 8192, 2048), ("layer_norm", "vit-B", 128 * 197, 768),
             ("layer_norm", "swin-B stage 1", 64 * 56 * 56, 128)]
    for kernel, where, n, d in cases:
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        r = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(d, device="cuda", requires_grad=True)
        b = torch.zeros(d, device="cuda", requires_grad=True)
        moved = 8 * n * d * 2  # fwd: read x, r; write y, h — bwd: read dy, dh, h; write dx

        def call(f, *extra):
            def run(x, r, w, b):
                y, h = f(x, w, *extra, 1e-6, residual=r) if kernel == "rms_norm" else \
                    f(x, w, b, 1e-6, residual=r)
                return (y.float().sum() + h.float().sum())
            return run

        ref = getattr(norms, f"{kernel}_reference")
        torch._dynamo.reset()
        variants = {"eager reference": call(ref), "compiled reference": torch.compile(call(ref)),
                    "triton fused": call(getattr(norms, kernel))}
        for name, fn in variants.items():
            ms, peak = _bench(fn, (x, r, w, b))
            rows.append(_row(env, f"add+{kernel}", name, {"rows": n, "dim": d, "model": where},
                             "bf16 activations, fp32 weight", ms, peak,
                             ("gb_per_s", moved / ms / 1e6)))
    return rows


def fp8_rows(env: dict) -> list[dict]:
    """One linear layer, forward + backward (dx, dw, db), bf16 autocast against fp8."""
    from torch import nn

    from fasttrain.kernels.fp8_linear import Float8Linear

    rows = []
    cases = [("llama-1B q/o", 8192, 2048, 2048), ("llama-1B k/v", 8192, 2048, 512),
             ("llama-1B gate/up", 8192, 2048, 8192), ("llama-1B down", 8192, 8192, 2048),
             ("vit-B qkv", 128 * 197, 768, 2304), ("vit-B fc1", 128 * 197, 768, 3072),
             ("vit-B fc2", 128 * 197, 3072, 768), ("swin-B s1 fc1", 64 * 3136, 128, 512),
             ("swin-B s3 fc1", 64 * 196, 512, 2048), ("sd ff 64x64", 8 * 4096, 320, 2560)]
    for where, m, k, n in cases:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        plain = nn.Linear(k, n, device="cuda")
        fp8 = nn.Linear(k, n, device="cuda")
        fp8.load_state_dict(plain.state_dict())
        fp8.__class__ = Float8Linear
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        flops = 3 * 2 * m * k * n

        def call(layer):
            def run(x):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return (layer(x).float() * g).sum()
            return run

        torch._dynamo.reset()
        variants = {"bf16 compiled": torch.compile(call(plain)),
                    "fp8 compiled": torch.compile(call(fp8)), "fp8 eager": call(fp8)}
        for name, fn in variants.items():
            ms, peak = _bench(fn, (x,))
            rows.append(_row(env, "linear", name, {"tokens": m, "in": k, "out": n, "model": where},
                             "bf16 autocast, fp32 weight", ms, peak, ("tflops", flops / ms / 1e9)))
    return rows


GROUPS = {"linear_ce": linear_ce_rows, "norms": norm_rows, "fp8": fp8_rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=",".join(GROUPS), help=f"of {', '.join(GROUPS)}")
    args = ap.parse_args()
    env = environment("cuda")
    rows = [row for name in args.only.split(",") for row in GROUPS[name](env)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
