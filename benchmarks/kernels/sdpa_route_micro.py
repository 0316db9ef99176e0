"""A plain-PyTorch self-attention (packed qkv projection, ``F.scaled_dot_product_attention``)
against the same code with ``layers/sdpa_route.py`` active, forward + backward, eager and
compiled, at ViT-B's width (768, 12 heads, bf16) and about 25,000 tokens a batch, for sequence
lengths 197 … 1,024: where the router should take the call (``SEQ_ATTENTION_MAX_TOKENS``).
Variants: ``sdpa`` (the original), ``route`` (the router: in eager the zero-copy ``_base``
path, compiled the ``seq_attention_qkv`` op), ``views`` (compiled ``seq_attention_of_views``
on the projection's output: what the compiled router would gain without the backward's copy).
The router's token cap is lifted here, so that every length is routed. One JSONL row per
(tokens, mode, variant): the median ms of ``triton.testing.do_bench`` of the launched step
(``ms``), and with ``GRAPHS=1`` of a CUDA-graph replay of it (``graph_ms``; the capture failed
on the H100, 2026-11-26). ``TOKENS`` sets the tokens a batch: at 25,216 (ViT-B batch 128) the
launched steps of one layer were bound by the host for every variant (1.1-1.8 ms); at 100,864
by the GPU (sdpa-route-micro-20261126-1614, the table in layers/attention.py).

    OUT=/tmp/x PYTHONPATH=src python3 benchmarks/kernels/sdpa_route_micro.py
"""
from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from fasttrain.kernels.seq_attention import seq_attention_of_views
from fasttrain.layers import sdpa_route
from fasttrain.layers.sdpa_route import SdpaRoute
from fasttrain.measure.env import environment
from fasttrain.measure.rows import append_row
from kernels_micro import time_or_error  # benchmarks/kernels/, the script's own folder

WIDTH, HEADS = 768, 12
TOKENS_A_BATCH = int(os.environ.get("TOKENS", 25_216))
LENGTHS = (197, 256, 512, 1024)


def attention(x, w, attend):
    """qkv projection → (3, B, H, T, D) views → attention → (B, T, C)."""
    B, T, C = x.shape
    qkv = F.linear(x, w).reshape(B, T, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
    return attend(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape(B, T, C)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def views(q, k, v):
    B, H, T, D = q.shape
    return seq_attention_of_views(q._base.view(B, T, 3 * H * D), q, k, v)


def main() -> None:
    sdpa_route.SEQ_ATTENTION_MAX_TOKENS = 1 << 30
    rows, env = [], environment("cuda")
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for T in LENGTHS:
        B = max(1, round(TOKENS_A_BATCH / T))
        x = torch.randn(B, T, WIDTH, **bf, requires_grad=True)
        w = (torch.randn(3 * WIDTH, WIDTH, **bf) * WIDTH ** -0.5).requires_grad_()
        dy = torch.randn(B, T, WIDTH, **bf)
        ref = None
        for mode in ("eager", "compiled"):
            for variant in ("sdpa", "route", "views"):
                if variant == "views" and mode == "eager":
                    continue
                torch._dynamo.reset()
                fn = lambda x, w: attention(x, w, views if variant == "views" else sdpa)
                fn = torch.compile(fn) if mode == "compiled" else fn
                route = SdpaRoute()

                def step():
                    with route.active() if variant == "route" else contextlib.nullcontext():
                        y = fn(x, w)
                    torch.autograd.grad(y, (x, w), dy)
                    return y
                y = step()
                err = None if ref is None else float((y.float() - ref).abs().max())
                ref = y.float() if ref is None else ref
                ms = do_bench(step, warmup=50, rep=300, return_mode="median")
                graph, error = (time_or_error(step) if os.environ.get("GRAPHS") == "1"
                                else (None, None))
                row = {"kind": "kernel", "kernel": "sdpa-route-micro", "tokens": T, "batch": B,
                       "mode": mode, "variant": variant, "ms": ms, "graph_ms": graph,
                       "graph_error": error, "max_abs_vs_sdpa_eager": err,
                       "routed": route.summary(), "device": torch.cuda.get_device_name(),
                       "env": env}
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    if out:
        for r in rows:
            append_row(os.path.join(out, "sdpa_route_micro.jsonl"), r)
    print(f"{'T':>5} {'B':>4} " + " ".join(f"{m[:4]}-{v:<6}" for m in ("eager", "compiled")
                                          for v in ("sdpa", "route", "views")
                                          if not (m == "eager" and v == "views")))
    for T in LENGTHS:
        for key in ("ms", "graph_ms"):
            got = {(r["mode"], r["variant"]): r[key] for r in rows if r["tokens"] == T}
            B = next(r["batch"] for r in rows if r["tokens"] == T)
            print(f"{T:>5} {B:>4} " + " ".join(f"{got[k] or float('nan'):>11.3f}" for k in got)
                  + f"  {key}")


if __name__ == "__main__":
    main()
