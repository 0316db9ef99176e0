"""One SD UNet spatial transformer (GroupNorm, 1×1 conv in, self-attention, cross-attention,
GEGLU feed-forward, 1×1 conv out) forward + backward at SD v1's three widths, batch 8, compiled
and replayed in a CUDA graph, with its projections stacked or not (``Attention.stacked``) and its
LayerNorms plain or fused (``kernels=layernorm``). GroupNorm and GEGLU run fasttrain's kernels in
every variant, as the SD preset does; linear and conv weights are bf16 (the preset's master
weights) under bf16 autocast. One JSONL row per (width, variant), with the largest gradient
difference against the first variant relative to that gradient's largest value, and whose.

    PYTHONPATH=src python3 benchmarks/kernels/sd_block_micro.py --out $OUT/sd-block-micro.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from kernels_micro import append_rows, graph_ms  # benchmarks/kernels/, the script's own folder
from fasttrain.measure.env import environment
from fasttrain.techniques.optimizer import matmul_weights
from fasttrain.layers.sd_transformer import Attention
from fasttrain.layers.unet import SpatialTransformer

SHAPES = ((320, 64), (640, 32), (1280, 16))  # (channels, latent side) of the three levels
BATCH, CONTEXT, TOKENS, HEADS = 8, 768, 77, 8
VARIANTS = (("separate projections, plain LayerNorm", False, False),
            ("stacked projections, plain LayerNorm", True, False),
            ("stacked projections, fused LayerNorm", True, True))


def build(dim: int, layernorm: bool) -> nn.Module:
    torch.manual_seed(0)
    blk = SpatialTransformer(dim, HEADS, CONTEXT).cuda()
    for m in blk.modules():
        if callable(getattr(m, "use_fused", None)):
            m.use_fused(layernorm or m.fused_kind != "layernorm")
    for p in matmul_weights(blk):  # what master_weights stores in bf16
        p.data = p.data.to(torch.bfloat16)
    return blk


def variant_rows(env: dict, dim: int, side: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(BATCH, dim, side, side, device="cuda", dtype=torch.bfloat16, generator=g)
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_(True)
    ctx = torch.randn(BATCH, TOKENS, CONTEXT, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    rows, ref = [], None
    for name, stacked, layernorm in VARIANTS:
        Attention.stacked = stacked
        torch._dynamo.reset()
        blk = build(dim, layernorm)
        run = torch.compile(blk)

        def step():
            with torch.autocast("cuda", torch.bfloat16):
                y = run(x, ctx)
            y.backward(dy)

        x.grad = None
        step()
        grads = {"input": x.grad, **{n: p.grad for n, p in blk.named_parameters()}}
        grads = {n: t.float().clone() for n, t in grads.items()}
        ref = ref or grads
        err, worst = max((((g - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)).item(),
                          n) for n, g in grads.items())
        x.grad = None
        blk.zero_grad(set_to_none=True)
        ms = graph_ms(step)
        row = {"kind": "micro", "group": "sd_block", "kernel": "spatial transformer",
               "variant": name, "shape": {"batch": BATCH, "channels": dim, "side": side,
                                          "context": [TOKENS, CONTEXT]},
               "dtype": "bf16 autocast, bf16 weights", "ms": round(ms, 4),
               "max_rel_grad_diff": err, "of": worst, "env": env}
        print(json.dumps({k: v for k, v in row.items() if k != "env"}), flush=True)
        rows.append(row)
    Attention.stacked = True
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = environment("cuda")
    append_rows(args.out, [r for dim, side in SHAPES for r in variant_rows(env, dim, side)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
