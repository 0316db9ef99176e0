"""SDPA's backends at SD's UNet attention shapes: self-attention at 64, 32 and 16 latents (4,096,
1,024 and 256 tokens, head dims 40, 80, 160) and cross-attention to the 77 text tokens at the
same latents; batch 8, 8 heads, bf16, q/k/v as the transformer makes them ((B, T, H, D) memory
seen as (B, H, T, D)); forward + backward timed by kernels_micro's CUDA-graph replay. Also a
compiled plain attention (fp32 scores) where the scores are small. TFLOP/s count the real sizes
(fwd 4·B·H·T·Tk·D, bwd 2.5× that). Rows in ``$OUT/attention-probe.jsonl``.

    OUT=/tmp/x PYTHONPATH=src python3 benchmarks/probes/attention_probe.py
"""
import json
import os
import sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))
from kernels_micro import _bench  # benchmarks/kernels/
from fasttrain.measure.env import environment

env = environment("cuda")
rows = []
B, H = 8, 8
def mk(T, D):
    return torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
def math(q, k, v):
    s = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    return s.softmax(-1).to(v.dtype) @ v
cmath = torch.compile(math)
for name, T, Tk, D in [("self64", 4096, 4096, 40), ("cross64", 4096, 77, 40),
                       ("self32", 1024, 1024, 80), ("cross32", 1024, 77, 80),
                       ("self16", 256, 256, 160), ("cross16", 256, 77, 160)]:
    q, k, v = mk(T, D), mk(Tk, D), mk(Tk, D)
    for t in (q, k, v): t.requires_grad_()
    g = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    variants = {}
    for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def f(q, k, v, be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v)
        variants[be.name] = f
    if T * Tk <= 1024 * 1024:
        variants["compiled math"] = cmath
    for vn, f in variants.items():
        try:
            launched, replayed, peak = _bench(f, (q, k, v), g)
        except Exception as e:
            print(name, vn, "failed", str(e)[:100]); continue
        ms = replayed if replayed is not None else launched
        fl = 4 * B * H * T * Tk * D * 3.5
        row = {"kind": "attention-probe", "case": name, "shape": [B, H, T, Tk, D], "variant": vn,
               "ms": ms, "tflops": fl / ms / 1e9, "env": env}
        print(name, vn, round(ms, 4), round(fl / ms / 1e9, 1), flush=True)
        rows.append(row)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "attention-probe.jsonl"), "w") as fh:
    fh.write("".join(json.dumps(r) + "\n" for r in rows))
