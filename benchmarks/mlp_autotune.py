"""Swin-B's and ViT-B's MLP (fc1 → exact GELU → fc2, bf16 weights as under ``master_weights``)
forward + backward on one CUDA device, three ways: torch.compile's default (cuBLAS GEMMs,
bias + GELU in Inductor's pointwise kernels), the same with fasttrain's bias + GELU kernel
(``kernels=gelu``, the fast presets), and ``max-autotune-no-cudagraphs`` without the kernel,
where Inductor may pick its Triton GEMM templates and fuse bias + GELU (forward) and GELU's
derivative (backward) into their epilogues. One JSONL row per (model, stage, variant): the
median ms of a CUDA-graph replay of one step, its TFLOP/s, and the step time a model would
spend on its MLPs (the stage's blocks times the ms). Autotuning benchmarks each choice with
``--autotune-warmup``/``--autotune-rep`` ms (Inductor's defaults, 25/100, take ~20 s a GEMM
shape).

    PYTHONPATH=src python3 benchmarks/mlp_autotune.py --out $OUT/mlp-autotune.jsonl
"""
from __future__ import annotations

import argparse
import time

import torch

from fasttrain.env import environment
from kernels_micro import append_rows, graph_ms  # benchmarks/, the script's own folder

# model, stage, tokens (batch × tokens per image), channels, blocks
SHAPES = [("swin-b", 1, 64 * 3136, 128, 2), ("swin-b", 2, 64 * 784, 256, 2),
          ("swin-b", 3, 64 * 196, 512, 18), ("swin-b", 4, 64 * 49, 1024, 2),
          ("vit-b", 1, 128 * 197, 768, 12)]
VARIANTS = ("compile", "compile+gelu-kernel", "max-autotune")


def run(model: str, stage: int, tokens: int, dim: int, variant: str) -> float:
    from fasttrain.layers.mlp import Mlp

    torch._dynamo.reset()
    mlp = Mlp(dim, 4 * dim).cuda().to(torch.bfloat16)
    if variant == "compile+gelu-kernel":
        mlp.use_fused(True)
        mlp.fc1.bias.data = mlp.fc1.bias.data.float()  # as master_weights leaves it
    mode = "max-autotune-no-cudagraphs" if variant == "max-autotune" else "default"
    fn = torch.compile(mlp, mode=mode)
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)

    def step():
        for t in (x, *mlp.parameters()):
            t.grad = None
        with torch.autocast("cuda", torch.bfloat16):
            y = fn(x)
        y.backward(g)

    step()
    torch.cuda.synchronize()
    return graph_ms(step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="models, comma-separated (swin-b, vit-b)")
    ap.add_argument("--autotune-warmup", type=int, default=5)
    ap.add_argument("--autotune-rep", type=int, default=25)
    args = ap.parse_args()
    import torch._inductor.config as cfg

    cfg.inductor_default_autotune_warmup = args.autotune_warmup
    cfg.inductor_default_autotune_rep = args.autotune_rep
    env = environment("cuda")
    models = set(filter(None, args.only.split(","))) or {s[0] for s in SHAPES}
    for model, stage, tokens, dim, blocks in SHAPES:
        if model not in models:
            continue
        flops = 3 * 2 * 2 * tokens * dim * 4 * dim  # two GEMMs, forward + two backward
        for variant in VARIANTS:
            t0 = time.perf_counter()
            try:
                ms, error = run(model, stage, tokens, dim, variant), None
            except Exception as err:  # noqa: BLE001 - a failed variant is a row
                ms, error = None, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            row = {"kind": "mlp-autotune", "model": model, "stage": stage, "tokens": tokens,
                   "dim": dim, "blocks": blocks, "variant": variant, "ms": ms,
                   "tflops": flops / ms / 1e9 if ms else None,
                   "model_ms": ms * blocks if ms else None, "error": error,
                   "compile_s": round(time.perf_counter() - t0, 1),
                   "autotune_warmup_ms": args.autotune_warmup,
                   "autotune_rep_ms": args.autotune_rep, "env": env}
            print(f"{model} stage {stage} {variant:22s} "
                  + (f"{ms:.3f} ms ×{blocks} = {ms * blocks:.2f} ms" if ms else error)
                  + f"  ({row['compile_s']} s)", flush=True)
            append_rows(args.out, [row])


if __name__ == "__main__":
    main()
