"""Causal GQA attention of Llama-1B (4 x 2,048 tokens, 32 query and 8 key/value heads of 64) on
cuDNN, forward + backward: q, k, v handed over as the (B, H, T, D) views of the projections'
(B, T, H·D) outputs that Llama's attention makes (transposed, not contiguous) against the same
values contiguous in (B, H, T, D); the output gradient as the view of a (B, T, H·D) gradient, as
o_proj's backward gives it. One JSONL row per layout: the median ms of a CUDA-graph replay and
the copy kernels a step launches (counted with torch.profiler).

    PYTHONPATH=src python3 benchmarks/kernels/sdpa_layout_micro.py --out $OUT/sdpa-layout.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fasttrain.measure.env import environment


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from triton.testing import do_bench

    B, T, H, KV, D = 4, 2048, 32, 8, 64
    dev, bf16 = "cuda", torch.bfloat16
    proj = {n: torch.randn(B, T, h * D, device=dev, dtype=bf16, requires_grad=True)
            for n, h in (("q", H), ("k", KV), ("v", KV))}
    grad = torch.randn(B, T, H * D, device=dev, dtype=bf16)
    rows, env = [], environment("cuda")
    for layout in ("views", "contiguous"):
        def step():
            q, k, v = (proj[n].view(B, T, -1, D).transpose(1, 2) for n in "qkv")
            if layout == "contiguous":
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            y = o.transpose(1, 2).reshape(B, T, H * D)
            torch.autograd.backward(y, grad)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        copies = [e for e in kernels if "copy" in e.name.lower()]
        ms = do_bench(step, warmup=5, rep=50, return_mode="median")
        row = {"kind": "kernel-micro", "kernel": "sdpa layout", "variant": layout,
               "shape": {"batch": B, "seq": T, "heads": H, "kv_heads": KV, "head_dim": D},
               "dtype": "bf16", "backend": "cudnn", "ms": ms, "kernels": len(kernels),
               "copy_kernels": len(copies),
               "copy_us": sum(e.device_time for e in copies), "env": env}
        print(layout, f"{ms:.3f} ms", len(kernels), "kernels,", len(copies), "copies",
              f"{row['copy_us']:.1f} us", flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
