"""One linear layer's forward at ViT-B's shapes (64 images × 197 tokens = 12,608 rows; qkv
768→2304, proj 768→768, fc1 768→3072, fc2 3072→768), under torch.inference_mode: ``nn.Linear``
in fp16 (the baseline) against ``Fp8Linear`` (e4m3, ``torch._scaled_mm`` row-wise) and
``Int8Linear`` (``torch._int_mm``) of inference/quant.py, each eager and compiled
(``--compile-mode``, default max-autotune without CUDA graphs, fullgraph). The quantized
layers' time includes the per-token quantization of the input and the dequantization of the
output, as the model runs them. One JSONL row per (shape, variant, mode): the median ms of
CUDA-event-timed calls (``ms``), TFLOP/s of the layer's 2·M·K·N, the speed-up over fp16 in the
same mode, the largest error against the fp32 layer relative to its largest output, and the
backend the layer ran (a variant that fails is a row with its ``error``).

    OUT=/tmp/x PYTHONPATH=src python3 benchmarks/kernels/quant_linear_micro.py
    PYTHONPATH=src python3 benchmarks/kernels/quant_linear_micro.py --check   # CPU, small M
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch import nn

from fasttrain.inference.quant import Fp8Linear, Int8Linear
from fasttrain.measure.env import environment
from fasttrain.measure.rows import append_row

ROWS = 64 * 197  # ViT-B/16 at 224 px, batch 64
SHAPES = {"qkv": (768, 2304), "proj": (768, 768), "fc1": (768, 3072), "fc2": (3072, 768)}
VARIANTS = {"fp16": lambda lin: lin, "fp8": Fp8Linear.from_linear, "int8": Int8Linear.from_linear}


def cuda_ms(fn, warmup: int = 10, reps: int = 50) -> float:
    """Median ms of ``reps`` calls, each between two CUDA events (no synchronisation between
    calls; one at the end)."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def cpu_ms(fn, warmup: int = 2, reps: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def case_rows(env: dict, name: str, K: int, N: int, M: int, dtype: torch.dtype,
              modes: tuple[str, ...], compile_mode: str, device: str) -> list[dict]:
    torch.manual_seed(0)
    lin = nn.Linear(K, N, device=device, dtype=dtype).eval()
    x = torch.randn(M, K, device=device, dtype=dtype)
    with torch.inference_mode():
        exact = nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
    timer = cuda_ms if device == "cuda" else cpu_ms
    rows, base = [], {}
    for variant, build in VARIANTS.items():
        for mode in modes:
            row = {"kind": "kernel", "kernel": "quant-linear-micro", "layer": name, "M": M,
                   "K": K, "N": N, "dtype": str(dtype).removeprefix("torch."),
                   "variant": variant, "mode": mode, "compile_mode": compile_mode
                   if mode == "compiled" else None, "ms": None, "tflops": None,
                   "speedup_vs_fp16": None, "max_rel_err_vs_fp32": None, "backend": None,
                   "error": None}
            try:
                layer = build(lin)
                row["backend"] = getattr(layer, "backend", "cublas")
                torch._dynamo.reset()
                fn = (torch.compile(layer, mode=compile_mode, fullgraph=True)
                      if mode == "compiled" else layer)
                with torch.inference_mode():
                    y = fn(x)
                    ms = timer(lambda: fn(x))
                row["ms"] = ms
                row["tflops"] = 2 * M * K * N / (ms * 1e-3) / 1e12
                err = (y.float() - exact).abs().max() / exact.abs().max()
                row["max_rel_err_vs_fp32"] = float(err)
                if variant == "fp16":
                    base[mode] = ms
                if base.get(mode):
                    row["speedup_vs_fp16"] = base[mode] / ms
            except Exception as e:  # noqa: BLE001 — a failing variant is a row
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            row["device"] = env.get("device_name")
            row["env"] = env
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="CPU, 256 rows, eager: does it run")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    args = p.parse_args()
    device = "cpu" if args.check else "cuda"
    M, modes = (256, ("eager",)) if args.check else (ROWS, ("eager", "compiled"))
    env, dtype = environment(device), getattr(torch, args.dtype)
    rows = []
    for name, (K, N) in SHAPES.items():
        rows += case_rows(env, name, K, N, M, dtype, modes, args.compile_mode, device)
    out = os.environ.get("OUT")
    if out:
        for r in rows:
            append_row(os.path.join(out, "quant_linear_micro.jsonl"), r)
    print(f"{'layer':<6} {'mode':<9} " + " ".join(f"{v:>14}" for v in VARIANTS))
    for name in SHAPES:
        for mode in modes:
            got = {r["variant"]: r for r in rows if r["layer"] == name and r["mode"] == mode}
            cells = [f"{got[v]['ms']:8.3f} ms ×{got[v]['speedup_vs_fp16'] or 0:.2f}"
                     if got[v]["ms"] else f"{'failed':>14}" for v in VARIANTS]
            print(f"{name:<6} {mode:<9} " + " ".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
