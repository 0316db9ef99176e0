"""GEMM-friendly widths (``gemm_pad``): an LM head's three GEMMs and its whole loss at an odd
vocabulary against the same vocabulary padded to a multiple of 64, bf16, on one CUDA device.

Shapes: Llama-3.2-1B's head (8,192 tokens × 2,048) at GPT-2's 50,257 (padded 50,304), at
32,001 (a Llama-2 vocabulary plus one added token, padded 32,064), and at Llama-3's 128,256
(a multiple of 64 already: the control). Per (vocabulary, padded or not): the forward logits
``h Wᵀ``, the hidden states' gradient ``g W`` and the weight's ``gᵀ h`` (median ms of a
CUDA-graph replay; TFLOP/s counts the unpadded vocabulary's FLOPs, so padding shows as the
speed it buys), then ``LMHeadLoss`` forward + backward as the model runs it, compiled
(plain path) and chunked (``kernels=loss``), launched from Python. One JSONL row each.

    OUT=/tmp/x PYTHONPATH=src python3 benchmarks/kernels/gemm_pad_micro.py
    PYTHONPATH=src python3 benchmarks/kernels/gemm_pad_micro.py --check   # CPU, tiny shapes
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from fasttrain.measure.env import environment
from fasttrain.layers.loss import LMHeadLoss
from kernels_micro import append_rows, time_or_error  # benchmarks/kernels/, the script's own folder

SHAPES = {"gpt2": 50257, "llama2+1": 32001, "llama3": 128256}


def _launched_ms(fn, cuda: bool) -> float:
    if cuda:
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=50, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def gemm_rows(env: dict, tokens: int, dim: int, vocab: int, pad: int, cuda: bool) -> list[dict]:
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    width = vocab + -vocab % pad if pad else vocab
    h = torch.randn(tokens, dim, device=dev, dtype=dt)
    w = torch.randn(width, dim, device=dev, dtype=dt)
    g = torch.randn(tokens, width, device=dev, dtype=dt)
    flops = 2 * tokens * dim * vocab
    rows = []
    for name, fn in (("logits h Wt", lambda: h @ w.t()), ("grad h = g W", lambda: g @ w),
                     ("grad W = gt h", lambda: g.t() @ h)):
        ms, err = time_or_error(fn) if cuda else (_launched_ms(fn, False), None)
        rows.append({"kind": "gemm-pad-micro", "gemm": name, "tokens": tokens, "dim": dim,
                     "vocab": vocab, "padded_to": width, "dtype": str(dt).removeprefix("torch."),
                     "ms": ms, "tflops": None if ms is None else flops / ms / 1e9,
                     "timing": "cuda-graph replay" if cuda else "cpu, one call",
                     "error": err, "env": env})
    return rows


def loss_rows(env: dict, tokens: int, dim: int, vocab: int, pad: int, cuda: bool) -> list[dict]:
    dev = "cuda" if cuda else "cpu"
    h = torch.randn(tokens, dim, device=dev, requires_grad=True)
    w = torch.randn(vocab, dim, device=dev, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device=dev)
    rows = []
    for variant in ("compiled", "chunked"):
        layer = LMHeadLoss(vocab=vocab)
        layer.use_fused(variant == "chunked")
        if pad:
            layer.pad_gemm(pad)
        step = torch.compile(layer) if variant == "compiled" and cuda else layer

        def fwd_bwd():
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
                loss = step(h, w, labels)
            loss.backward()

        try:
            ms, err = _launched_ms(fwd_bwd, cuda), None
        except Exception as e:  # noqa: BLE001 - a failing setting is a row too
            ms, err = None, f"{type(e).__name__}: {str(e)[:150]}"
        rows.append({"kind": "gemm-pad-micro", "gemm": f"LMHeadLoss fwd+bwd ({variant})",
                     "tokens": tokens, "dim": dim, "vocab": vocab,
                     "padded_to": vocab + -vocab % pad if pad else vocab, "ms": ms,
                     "tflops": None if ms is None else 6 * tokens * dim * vocab / ms / 1e9,
                     "timing": "launched" if cuda else "cpu, one call", "error": err,
                     "env": env})
        h.grad = w.grad = None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="CPU, tiny shapes: the script runs")
    args = ap.parse_args()
    cuda = not args.check
    env = environment("cuda" if cuda else "cpu")
    tokens, dim = (8192, 2048) if cuda else (64, 32)
    out = os.path.join(os.environ.get("OUT", "out"), "gemm-pad-micro.jsonl")
    for label, vocab in SHAPES.items():
        vocab = vocab if cuda else vocab // 256 + 1  # tiny and odd on the CPU
        for pad in (0, 64):
            rows = gemm_rows(env, tokens, dim, vocab, pad, cuda) + \
                loss_rows(env, tokens, dim, vocab, pad, cuda)
            for r in rows:
                r["shape"] = label
                print(f"{label:9} {r['vocab']:>7} → {r['padded_to']:>7} {r['gemm']:34} "
                      f"{r['ms'] if r['ms'] is None else round(r['ms'], 3)} ms "
                      f"{'' if r['tflops'] is None else round(r['tflops'], 1)}", flush=True)
            append_rows(out, rows)
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
