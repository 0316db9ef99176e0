"""Microbenchmarks of fasttrain's kernels against eager PyTorch and torch.compile of the
reference, forward + backward, on one CUDA device. One JSONL row per (kernel, shape, variant)
with the time of one step (median of triton.testing.do_bench over CUDA-graph replays of it —
the kernels' own time, as the fast preset runs them — and, as ``ms_launched``, over steps
launched from Python, which adds the launch cost that dominates small shapes; the norms' loss
sums y and h, so the sums' own kernels are in every variant, while the activations, rope and
window groups backpropagate fixed cotangents from their outputs, so only the op's own kernels
are timed), the achieved TFLOP/s or GB/s against the device's ceilings (H200: ~800 TFLOP/s
bf16 matmul, 4.2 TB/s copy) and the peak memory. GB/s counts the bytes of the minimal reads and
writes of forward + backward.

    PYTHONPATH=src python3 benchmarks/kernels/kernels_micro.py --out $OUT/kernels-micro.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from fasttrain.measure.env import environment


def _bench(fn, args, grads=None) -> tuple[float, float, float | None]:
    """(ms per forward+backward — forward only, without autograd, where no input needs a
    gradient — launched from Python, ms per CUDA-graph replay of the same
    step or None where it cannot be captured, peak GiB above the inputs). ``fn`` returns a
    scalar loss, or with ``grads`` the output tensor(s) these cotangents are backpropagated
    from. The replay is the kernels' own time (the fast preset runs under CUDA graphs); the
    launched time adds Python's launch cost, which dominates the small shapes."""
    from triton.testing import do_bench

    def step():
        if not any(a.requires_grad for a in args):  # a frozen module's forward
            with torch.no_grad():
                fn(*args)
            return
        for a in args:
            if a.requires_grad:
                a.grad = None
        out = fn(*args)
        if grads is None:
            out.backward()
        else:
            torch.autograd.backward(out, grads)

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    launched = do_bench(step, warmup=5, rep=50, return_mode="median")
    try:
        replayed = graph_ms(step)
    except RuntimeError as err:
        print(f"  (not captured in a CUDA graph: {str(err).splitlines()[0][:120]})")
        replayed = None
    return launched, replayed, peak


def graph_ms(fn) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph (warmed up on a side stream
    first, as capture requires)."""
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=5, rep=50, return_mode="median")


def time_or_error(fn) -> tuple[float | None, str | None]:
    """(median ms of a CUDA-graph replay of ``fn``, None), or (None, the error) where the
    setting fails to compile or run: a failing setting is a row too."""
    try:
        fn()
        return graph_ms(fn), None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e)[:150]}"


def append_rows(path: str, rows: list[dict]) -> None:
    """Append ``rows`` to the JSONL file ``path`` (its folder made if missing)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


def norm_inputs(n: int, d: int) -> tuple[tuple, tuple]:
    """(x bf16, residual fp32, weight, bias) needing gradients and the two output cotangents
    (y bf16, h fp32) of a residual add + norm as the blocks run it under bf16 autocast."""
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(n, d, device="cuda", requires_grad=True)
    w = torch.ones(d, device="cuda", requires_grad=True)
    b = torch.zeros(d, device="cuda", requires_grad=True)
    return (x, r, w, b), (torch.randn(n, d, device="cuda", dtype=torch.bfloat16),
                          torch.randn(n, d, device="cuda"))


def _row(env: dict, kernel: str, variant: str, shape: dict, dtype: str,
         timed: tuple[float, float | None, float], rate: tuple[str, float]) -> dict:
    """One result row, printed as it is made; ``timed`` is ``_bench``'s result and ``rate``
    ("tflops" | "gb_per_s", the work of one step), turned into a rate of the graph replay
    (of the launched step where there is no replay)."""
    launched, replayed, peak = timed
    ms = replayed if replayed is not None else launched
    unit = "TFLOP/s" if rate[0] == "tflops" else "GB/s"
    value = rate[1] / ms / (1e9 if rate[0] == "tflops" else 1e6)
    print(f"{kernel} {' x '.join(str(v) for v in shape.values())} {variant:24s} "
          f"{ms:8.3f} ms (launched {launched:8.3f}) {value:7.1f} {unit}  peak {peak:6.2f} GiB",
          flush=True)
    return {"kind": "kernel-micro", "kernel": kernel, "variant": variant, "shape": shape,
            "dtype": dtype, "ms": ms, "ms_launched": launched,
            "timing": "cuda-graph replay" if replayed is not None else "launched",
            rate[0]: value, "peak_gib": peak, "env": env}


def _variant_rows(env: dict, kernel: str, variants: dict, args: tuple, shape: dict, dtype: str,
                  rate: tuple[str, float], grads=None, extra: tuple = ()) -> list[dict]:
    """One row per variant, each step ``fn(*args, *extra)`` timed by ``_bench``."""
    return [_row(env, kernel, name, shape, dtype,
                 _bench(lambda *a: fn(*a, *extra), args, grads), rate)
            for name, fn in variants.items()]


def linear_ce_rows(env: dict) -> list[dict]:
    from fasttrain.kernels.cross_entropy import linear_cross_entropy_fused
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
                    "fused (chunks of 2048)": autocast(linear_cross_entropy),
                    "compiled loss kernel": torch.compile(autocast(linear_cross_entropy_fused))}
        rows += _variant_rows(env, "linear_cross_entropy", variants, (h, w),
                              {"tokens": tokens, "dim": dim, "vocab": vocab},
                              "bf16 autocast, fp32 weight", ("tflops", flops))
        if vocab == 128256 and dim == 2048:  # the loss kernel's launch settings, Llama-1B
            rows += _ce_launch_rows(env, autocast(linear_cross_entropy_fused), (h, w),
                                    {"tokens": tokens, "dim": dim, "vocab": vocab}, flops)
    return rows


CE_LAUNCHES = [(2048, 4), (8192, 8), (8192, 16), (16384, 16)]
"""(columns a loop iteration, warps) tried for the loss kernel besides kernels/cross_entropy.py's
LAUNCH."""


def _ce_launch_rows(env: dict, fn, args: tuple, shape: dict, flops: float) -> list[dict]:
    from fasttrain.kernels import cross_entropy

    rows, default = [], dict(cross_entropy.LAUNCH)
    try:
        for block, warps in CE_LAUNCHES:
            cross_entropy.LAUNCH.update(block=block, warps=warps)
            torch._dynamo.reset()
            rows += _variant_rows(env, "linear_cross_entropy",
                                  {f"compiled loss kernel b{block} w{warps}": torch.compile(fn)},
                                  args, shape, "bf16 autocast, fp32 weight", ("tflops", flops))
    finally:
        cross_entropy.LAUNCH.update(default)
    return rows


# Tile settings tried for the norm kernels besides the default: (forward elements, warps,
# backward elements, warps, programs per SM), see kernels/norms.py LAUNCH.
NORM_TILE_KEYS = ("fwd_elements", "fwd_warps", "bwd_elements", "bwd_warps", "programs_per_sm")
NORM_TILES = [(2048, 4, 2048, 4, 4), (4096, 4, 4096, 4, 4), (8192, 8, 4096, 8, 2),
              (8192, 8, 8192, 8, 2), (16384, 16, 2048, 8, 8)]


def norm_rows(env: dict) -> list[dict]:
    """Residual add + RMSNorm / LayerNorm as the blocks run them under bf16 autocast: the
    branch's bf16 output joins the fp32 residual stream, the norm feeds a matmul in bf16.
    Eager and compiled reference against the Triton kernels with their default tiles
    (``triton``) and the alternatives of NORM_TILES (``triton fe/fw be/bw/pps``)."""
    from fasttrain.kernels import norms

    rows = []
    cases = [("layer_norm", "swin-B stage 1", 64 * 56 * 56, 128),
             ("layer_norm", "swin-B stage 3", 64 * 14 * 14, 512),
             ("layer_norm", "vit-B", 128 * 197, 768), ("rms_norm", "llama-1B", 8192, 2048)]
    for kernel, where, n, d in cases:
        (x, r, w, b), grads = norm_inputs(n, d)
        # fwd: read x (2 B), r (4); write h (4), y (2). bwd: read dy (2), dh (4), h (4); write dx (4)
        moved = 26 * n * d

        def call(f, tiles=None):
            def run(x, r, w, b):
                if tiles is not None:
                    norms.LAUNCH.update(zip(NORM_TILE_KEYS, tiles))
                extra = () if kernel == "rms_norm" else (b,)
                return f(x, w, *extra, 1e-5, residual=r, out_dtype=torch.bfloat16)
            return run

        ref = getattr(norms, f"{kernel}_reference")
        default = tuple(norms.LAUNCH[k] for k in NORM_TILE_KEYS)
        torch._dynamo.reset()
        variants = {"eager reference": call(ref), "compiled reference": torch.compile(call(ref)),
                    "triton": call(getattr(norms, kernel), default)}
        variants.update({f"triton {t[0]}/{t[1]} {t[2]}/{t[3]}/{t[4]}":
                         call(getattr(norms, kernel), t) for t in NORM_TILES if t != default})
        rows += _variant_rows(env, f"add+{kernel}", variants, (x, r, w, b),
                              {"rows": n, "dim": d, "model": where},
                              "x bf16 + residual fp32 -> h fp32, y bf16; fp32 weights",
                              ("gb_per_s", moved), grads=grads)
        norms.LAUNCH.update(zip(NORM_TILE_KEYS, default))  # the default tiles back
    return rows


def fp8_rows(env: dict) -> list[dict]:
    """One linear layer, forward + backward (dx, dw, db), bf16 autocast against fp8."""
    from torch import nn

    from fasttrain.layers.linear import Float8Linear

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
        rows += _variant_rows(env, "linear", variants, (x,),
                              {"tokens": m, "in": k, "out": n, "model": where},
                              "bf16 autocast, fp32 weight", ("tflops", flops))
    return rows


def activation_rows(env: dict) -> list[dict]:
    """bias + GELU (ViT-B, Swin-B fc1; bf16 activations, fp32 bias) and SwiGLU (Llama-1B),
    each from a fixed cotangent of its output."""
    import torch.nn.functional as F

    from fasttrain.kernels import activations as act

    rows = []
    for where, n, d in [("vit-B fc1", 128 * 197, 3072), ("swin-B stage 1 fc1", 64 * 3136, 512),
                        ("swin-B stage 3 fc1", 64 * 196, 2048)]:
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = (0.1 * torch.randn(d, device="cuda")).requires_grad_()
        dy = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
        moved = 5 * n * d * 2 + 2 * d * 4  # fwd: read x, write y — bwd: read dy, x; write dx
        shape = {"rows": n, "dim": d, "model": where}

        torch._dynamo.reset()
        variants = {"eager reference": act.bias_gelu_reference,
                    "eager bf16 (model's math)": lambda x, b: F.gelu(x + b.to(x.dtype)),
                    "compiled reference": torch.compile(act.bias_gelu_reference),
                    "triton fused": act.bias_gelu,
                    # other math (tanh GELU): how much faster the kernels run with a cheaper
                    # activation, i.e. how far erf's arithmetic bounds them
                    "triton fused, tanh GELU (other math)": lambda x, b: act.bias_gelu(x, b,
                                                                                       "tanh")}
        rows += _variant_rows(env, "bias+gelu", variants, (x, b), shape,
                              "bf16 activations, fp32 bias", ("gb_per_s", moved), (dy,))

    for where, n, h in [("llama-1B", 8192, 8192)]:
        gate, up = (torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
        dy = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
        moved = 8 * n * h * 2  # fwd: read gate, up; write y — bwd: read dy, gate, up; write 2

        torch._dynamo.reset()
        variants = {"eager reference": act.swiglu_reference,
                    "eager bf16 (model's math)": lambda g, u: F.silu(g) * u,
                    "compiled reference": torch.compile(act.swiglu_reference),
                    "triton fused": act.swiglu}
        rows += _variant_rows(env, "swiglu", variants, (gate, up),
                              {"tokens": n, "hidden": h, "model": where}, "bf16",
                              ("gb_per_s", moved), (dy,))
    return rows


def geglu_rows(env: dict) -> list[dict]:
    """GEGLU (h · gelu(gate) of one projection's two halves) at SD's UNet feed-forward shapes,
    batch 8: 64², 32² and 16² latents' tokens × inner widths 1,280, 2,560, 5,120; bf16."""
    import torch.nn.functional as F

    from fasttrain.kernels.geglu import geglu

    def model_math(x):  # the plain layer under autocast: chunk, bf16 GELU, product
        h, gate = x.chunk(2, dim=-1)
        return h * F.gelu(gate)

    rows = []
    for where, n, d in [("sd 64x64", 8 * 4096, 1280), ("sd 32x32", 8 * 1024, 2560),
                        ("sd 16x16", 8 * 256, 5120)]:
        x = torch.randn(n, 2 * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
        moved = 7 * n * d * 2  # fwd: read x (2d), write y — bwd: read dy, x (2d); write dx (2d)
        torch._dynamo.reset()
        variants = {"eager bf16 (model's math)": model_math,
                    "compiled (model's math)": torch.compile(model_math),
                    "triton fused": geglu}
        rows += _variant_rows(env, "geglu", variants, (x,),
                              {"tokens": n, "inner": d, "model": where}, "bf16",
                              ("gb_per_s", moved), (dy,))
    return rows


def rope_rows(env: dict) -> list[dict]:
    """RoPE of q and k (GQA) as in the Llama attention: (B, T, H*D) projections viewed as
    non-contiguous (B, H, T, D); bf16, fp32 cos/sin tables."""
    from fasttrain.kernels import rope as rope_kernels
    from fasttrain.workloads.llama import LlamaConfig, rope_tables
    from fasttrain.layers.rope import apply_rope

    rows = []
    for where, b, t, hq, hk, d in [("llama-1B", 4, 2048, 32, 8, 64)]:
        cfg = LlamaConfig(dim=hq * d, heads=hq, kv_heads=hk, seq=t)
        cos, sin = (table.cuda() for table in rope_tables(cfg))
        q = torch.randn(b, t, hq * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, t, hk * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grads = tuple(torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                      for h in (hq, hk))
        elems = b * t * (hq + hk) * d
        moved = 4 * elems * 2 + 4 * t * d * 4  # read + write q and k, forward and backward

        def call(f):
            def run(q, k):
                return f(q.view(b, t, hq, d).transpose(1, 2), k.view(b, t, hk, d).transpose(1, 2),
                         cos, sin)
            return run

        def model(q, k, cos, sin):
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        torch._dynamo.reset()
        variants = {"eager reference": call(rope_kernels.rope_reference),
                    "eager bf16 (model's apply_rope)": call(model),
                    "compiled reference": torch.compile(call(rope_kernels.rope_reference)),
                    "triton fused": call(rope_kernels.rope)}
        rows += _variant_rows(env, "rope", variants, (q, k),
                              {"batch": b, "seq": t, "q_heads": hq, "kv_heads": hk,
                               "head_dim": d, "model": where},
                              "bf16, fp32 cos/sin", ("gb_per_s", moved), grads)
    return rows


def _window_sdpa(qkv, bias, mask, heads):
    """Swin's plain window attention: SDPA over (Bw, N, 3·C) windows, bias + mask materialised."""
    Bw, N, C3 = qkv.shape
    q, k, v = qkv.view(Bw, N, 3, heads, C3 // 3 // heads).permute(2, 0, 3, 1, 4).unbind(0)
    full = (bias[None] + mask[:, None]).repeat(Bw // mask.shape[0], 1, 1, 1) \
        if mask is not None else bias[None]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full.to(q.dtype))
    return out.transpose(1, 2).reshape(Bw, N, C3 // 3)


def _window_math(qkv, bias, mask, heads):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return _window_sdpa(qkv, bias, mask, heads)


def window_rows(env: dict) -> list[dict]:
    """Swin-B's window attention per stage (batch 64, 7x7 windows, shifted blocks' masks): the
    model's plain path (SDPA with the bias materialised), eager and compiled, compile's math
    attention (what the fast rung with math attention runs) and the Triton kernel; from the
    qkv projection's output to the (windows, 49, C) input of the output projection."""
    from fasttrain.kernels.window_attention import window_attention
    from fasttrain.layers.windows import shift_mask

    rows = []
    for stage, windows, heads, dim, res in [(1, 64 * 64, 4, 128, 56), (2, 64 * 16, 8, 256, 28),
                                            (3, 64 * 4, 16, 512, 14), (4, 64, 32, 1024, 7)]:
        N = 49
        qkv = torch.randn(windows, N, 3 * dim, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True)
        bias = (0.1 * torch.randn(heads, N, N, device="cuda")).requires_grad_()
        mask = shift_mask(res, 7, 3).cuda() if res > 7 else None
        dy = torch.randn(windows, N, dim, device="cuda", dtype=torch.bfloat16)
        moved = windows * N * dim * 12 * 2  # fwd: qkv in, out — bwd: qkv, out, dout in, dqkv
        torch._dynamo.reset()
        variants = {"eager sdpa (model's plain path)": _window_sdpa,
                    "compiled sdpa": torch.compile(_window_sdpa),
                    "compiled math attention": torch.compile(_window_math),
                    "triton fused": window_attention}
        rows += _variant_rows(env, "window-attention", variants, (qkv, bias),
                              {"stage": stage, "windows": windows, "tokens": N, "heads": heads,
                               "dim": dim, "shifted": mask is not None},
                              "bf16 qkv, fp32 bias", ("gb_per_s", moved), (dy,),
                              extra=(mask, heads))
    return rows


def map_window_rows(env: dict) -> list[dict]:
    """Swin-B's attention on the token map (``kernels=window`` in the blocks: the map mode), per
    stage at batch 64, shifted blocks (shift 3) where the map holds more than one window: from
    the block's normed map x (B, H, W, C) to the attention's output map before the output
    projection. The plain path rolls and partitions x, projects the windows to qkv, attends
    (SDPA with the bias and mask materialised), reverses the partition and rolls back; the
    kernel path projects the map itself and runs ``map_window_attention``, which finds each
    window's tokens by address. Both include the same qkv GEMM, so their difference is the
    roll, partition, reverse and attention. TFLOP/s counts the GEMM's and attention's FLOPs."""
    import torch.nn.functional as F

    from fasttrain.kernels.window_attention import map_window_attention, window_attention
    from fasttrain.kernels.windows import cyclic_shift, window_partition, window_reverse
    from fasttrain.layers.windows import shift_mask

    def plain(attend):
        def run(x, w, b, bias, mask, heads, shift):
            _, H, W, _ = x.shape
            win = window_partition(cyclic_shift(x, shift) if shift else x, 7)
            y = window_reverse(attend(F.linear(win, w, b), bias, mask, heads), 7, H, W)
            return cyclic_shift(y, -shift) if shift else y
        return run

    def on_map(x, w, b, bias, mask, heads, shift):
        return map_window_attention(F.linear(x, w, b), bias, mask, heads, 7, shift)

    rows = []
    for stage, heads, dim, res in [(1, 4, 128, 56), (2, 8, 256, 28), (3, 16, 512, 14),
                                   (4, 32, 1024, 7)]:
        B, N = 64, 49
        shift = 3 if res > 7 else 0
        x = torch.randn(B, res, res, dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        w = (torch.randn(3 * dim, dim, device="cuda") * dim ** -0.5).bfloat16().requires_grad_()
        b = torch.zeros(3 * dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bias = (0.1 * torch.randn(heads, N, N, device="cuda")).requires_grad_()
        mask = shift_mask(res, 7, shift).cuda() if shift else None
        dy = torch.randn(B, res, res, dim, device="cuda", dtype=torch.bfloat16)
        tokens = B * res * res
        flops = 3 * (2 * tokens * dim * 3 * dim + 4 * tokens * N * dim)  # fwd + bwd ≈ 3 × fwd
        torch._dynamo.reset()
        variants = {"eager roll + partition + sdpa (model's plain path)": plain(_window_sdpa),
                    "compiled roll + partition + sdpa": torch.compile(plain(_window_sdpa)),
                    "compiled roll + partition + math attention":
                        torch.compile(plain(_window_math)),
                    "roll + partition + triton window kernel": plain(window_attention),
                    "triton map kernel": on_map}
        rows += _variant_rows(env, "map-window-attention", variants, (x, w, b, bias),
                              {"stage": stage, "batch": B, "map": res, "heads": heads,
                               "dim": dim, "shift": shift},
                              "bf16 x, qkv weight and bias; fp32 position bias",
                              ("tflops", flops), (dy,), extra=(mask, heads, shift))
    return rows


def attention_rows(env: dict) -> list[dict]:
    """ViT's self-attention (kernels=attention): the model's plain path (the qkv projection's
    output viewed as q, k, v, SDPA, the heads put back side by side), eager and compiled, and
    the Triton kernels, which read and write the projection's layout; ViT-B/16 and ViT-L/16 at
    197 tokens, and a 1,024-token case."""
    from fasttrain.kernels.seq_attention import seq_attention

    def sdpa(qkv, heads):
        B, T, C3 = qkv.shape
        q, k, v = qkv.view(B, T, 3, heads, C3 // 3 // heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(B, T, C3 // 3)

    rows = []
    for batch, tokens, heads, dim in [(128, 197, 12, 768), (64, 197, 16, 1024),
                                      (8, 1024, 12, 768)]:
        qkv = torch.randn(batch, tokens, 3 * dim, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True)
        dy = torch.randn(batch, tokens, dim, device="cuda", dtype=torch.bfloat16)
        flops = 3.5 * 4 * batch * heads * tokens * tokens * (dim // heads)  # fwd 1 + bwd 2.5
        torch._dynamo.reset()
        variants = {"eager sdpa (model's plain path)": sdpa, "compiled sdpa": torch.compile(sdpa),
                    "triton fused": seq_attention}
        rows += _variant_rows(env, "seq-attention", variants, (qkv,),
                              {"batch": batch, "tokens": tokens, "heads": heads, "dim": dim},
                              "bf16", ("tflops", flops), (dy,), extra=(heads,))
    return rows


def wide_attention_rows(env: dict) -> list[dict]:
    """The SD VAE's mid-block attention (one head of 512 over 4,096 positions, batch 8, frozen:
    forward only): SDPA (its memory-efficient kernel; flash and cuDNN take heads up to 256) and
    the library's GEMM path (fp32 scores), eager and compiled, with each one's largest error
    against an fp32 SDPA."""
    from fasttrain.layers.attention import gemm_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 1, 4096, 512, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    flops = 4 * 8 * 4096 * 4096 * 512
    torch._dynamo.reset()
    variants = {"sdpa (memory-efficient)": torch.nn.functional.scaled_dot_product_attention,
                "gemm, fp32 scores": gemm_attention,
                "compiled gemm, fp32 scores": torch.compile(gemm_attention)}
    rows = _variant_rows(env, "wide-attention", variants, (q, k, v),
                         {"batch": 8, "heads": 1, "tokens": 4096, "head_dim": 512},
                         "bf16", ("tflops", flops))
    for row, fn in zip(rows, variants.values()):
        with torch.no_grad():
            row["max_err_vs_fp32"] = (fn(q, k, v).float() - ref).abs().max().item()
    return rows


def groupnorm_rows(env: dict) -> list[dict]:
    """GroupNorm + SiLU at SD's shapes, bf16 channels-last activations, fp32 weights: the frozen
    VAE encoder's (forward only) and the UNet's (forward + backward); compile of the reference
    also on a contiguous (NCHW) input, where each group is one contiguous run."""
    from fasttrain.kernels.group_norm import group_norm, group_norm_reference

    rows = []
    cases = [("vae 512 px", (8, 128, 512, 512), False), ("vae 256 px", (8, 256, 256, 256), False),
             ("vae 128 px", (8, 512, 128, 128), False), ("unet 64", (8, 320, 64, 64), True),
             ("unet 32", (8, 640, 32, 32), True), ("unet 16", (8, 1280, 16, 16), True)]
    for where, shape, grad in cases:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(shape[1], device="cuda").requires_grad_(grad)
        b = torch.randn(shape[1], device="cuda").requires_grad_(grad)
        cot = torch.randn(shape, device="cuda", dtype=torch.bfloat16) if grad else None
        moved = (5 if grad else 2) * x.numel() * 2  # fwd: read x, write y; bwd: x, dy, dx
        desc = {"shape": list(shape), "model": where, "backward": grad}

        def call(f):
            return lambda x, w, b: f(x, w, b, 32, 1e-6, True)

        torch._dynamo.reset()
        last = x.contiguous(memory_format=torch.channels_last).requires_grad_(grad)
        rows += _variant_rows(env, "groupnorm+silu", {
            "eager reference": call(group_norm_reference),
            "compiled reference": torch.compile(call(group_norm_reference)),
            "triton": call(group_norm)}, (last, w, b), {**desc, "layout": "channels-last"},
            "bf16 activations, fp32 weight", ("gb_per_s", moved),
            grads=None if cot is None else cot.contiguous(memory_format=torch.channels_last))
        rows += _variant_rows(env, "groupnorm+silu", {
            "compiled reference": torch.compile(call(group_norm_reference)),
            "triton": call(group_norm)}, (x.requires_grad_(grad), w, b),
            {**desc, "layout": "contiguous"}, "bf16 activations, fp32 weight",
            ("gb_per_s", moved), grads=cot)
    return rows


def conv_rows(env: dict) -> list[dict]:
    """SD's VAE input convolution (3 → 128 channels, 3 × 3, padding 1, 512 px, batch 8), frozen
    (forward only), bf16 channels-last input: cuDNN eagerly, the gather + GEMM compiled (what
    channels_last runs) and the Triton pass at a few launch settings. GB/s counts reading the
    input and writing the output once."""
    from fasttrain.kernels import narrow_conv
    from fasttrain.layers.conv import as_gemm

    x = torch.randn(8, 3, 512, 512, device="cuda", dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(3, 128, 3, padding=1).to("cuda", torch.bfloat16).requires_grad_(False)
    conv = conv.to(memory_format=torch.channels_last)
    w, b = conv.weight, conv.bias
    shape = {"shape": [8, 3, 512, 512], "out_channels": 128, "kernel": 3, "model": "sd vae"}
    moved = x.numel() * 2 + 8 * 128 * 512 * 512 * 2
    gemm = torch.nn.Conv2d(3, 128, 3, padding=1).to("cuda", torch.bfloat16).requires_grad_(False)
    gemm.load_state_dict(conv.state_dict())
    as_gemm(gemm)
    torch._dynamo.reset()
    variants = {"eager cudnn": lambda x: torch.nn.functional.conv2d(x, w, b, padding=1),
                "compiled gather + GEMM": torch.compile(gemm)}
    rows = _variant_rows(env, "narrow-conv", variants, (x,), shape, "bf16", ("gb_per_s", moved))
    keep = dict(narrow_conv.LAUNCH)
    try:
        for block_m, tiles, warps in ((128, 1, 4), (128, 8, 4), (128, 16, 4), (128, 32, 4),
                                      (64, 16, 2), (64, 32, 2), (64, 64, 2), (64, 16, 4),
                                      (32, 32, 1), (128, 16, 2)):
            narrow_conv.LAUNCH.update(block_m=block_m, tiles=tiles, warps=warps)
            rows += _variant_rows(
                env, "narrow-conv", {f"triton {block_m} px × {tiles}, {warps} warps":
                                     lambda x: narrow_conv.narrow_conv2d(x, w, b, (1, 1))},
                (x,), {**shape, "launch": dict(narrow_conv.LAUNCH)}, "bf16", ("gb_per_s", moved))
    finally:
        narrow_conv.LAUNCH.update(keep)
    return rows


def optimizer_rows(env: dict) -> list[dict]:
    """One optimizer step over a model's trainable fp32 weights (shapes from the workload,
    built on the meta device): PyTorch's clip_grad_norm_ + fused AdamW (+ foreach EMA where the
    workload keeps one), as the peer runs it, the same step under torch.compile (foreach AdamW
    with a tensor lr, Inductor's fused kernels), and fasttrain's one-launch AdamW at a few
    block sizes (``OPTIMIZER_WORKLOADS=llama,vit`` picks the workloads). GB/s counts the
    minimal traffic of the fused step for every variant: norm 4 bytes a weight, AdamW 28, EMA 8."""
    rows = []
    for name in os.environ.get("OPTIMIZER_WORKLOADS", "sd,llama,vit").split(","):
        rows += _optimizer_rows_for(env, name)
        torch.cuda.empty_cache()
    return rows


def _optimizer_rows_for(env: dict, name: str) -> list[dict]:
    from fasttrain.kernels import adamw
    from fasttrain.optim.adamw import FlatAdamW
    from fasttrain.workloads import load_workload

    wl = load_workload(name, "base")
    with torch.device("meta"):
        shapes = [p.shape for p in wl.trainable(wl.build_model()).parameters() if p.requires_grad]
    n = sum(s.numel() for s in shapes)
    ema = wl.has_ema
    shape = {"workload": name, "tensors": len(shapes), "params_m": round(n / 1e6, 1)}
    gbytes = n * (4 + 28 + (8 if ema else 0))
    torch.manual_seed(0)
    weights = [torch.randn(s, device="cuda") * 0.02 for s in shapes]
    grads = [torch.randn_like(w) * 1e-3 for w in weights]

    def params():
        ps = [w.clone().requires_grad_() for w in weights]
        for q, g in zip(ps, grads):
            q.grad = g
        return ps

    def torch_step(compiled: bool = False):  # each variant's state lives only while timed
        ps = params()
        # compiled: PyTorch's other best practice, the whole step under torch.compile (foreach
        # AdamW with a tensor lr, so the lr is not baked into the graph)
        opt = torch.optim.AdamW(ps, lr=torch.tensor(1e-4, device="cuda") if compiled else 1e-4,
                                weight_decay=0.01, capturable=True,
                                **({"foreach": True} if compiled else {"fused": True}))
        shadow = [w.clone() for w in weights] if ema else None

        def step():
            torch.nn.utils.clip_grad_norm_(ps, 1.0)
            opt.step()
            if shadow is not None:
                with torch.no_grad():  # no autograd history on the shadow weights
                    torch._foreach_lerp_(shadow, ps, 1e-4)
        # compiled: three graphs (clip, AdamW, EMA): Optimizer.step breaks the graph around
        # itself on purpose, so that AOTAutograd sees an in-place inference graph
        return torch.compile(step) if compiled else step

    def flat_step():
        flat = FlatAdamW(params(), lr=1e-4, weight_decay=0.01, max_grad_norm=1.0)
        if ema:
            flat.attach_ema(0.9999)
        return flat.step

    rows = [_opt_row(env, "clip + fused AdamW" + (" + foreach EMA" if ema else ""), shape,
                     torch_step(), gbytes)]
    torch._dynamo.reset()
    rows.append(_opt_row(env, "compiled clip + AdamW" + (" + EMA" if ema else ""), shape,
                         torch_step(compiled=True), gbytes))
    default = dict(adamw.LAUNCH)
    try:
        for block, warps in ((1024, 4), (2048, 4), (4096, 8)):
            adamw.LAUNCH.update(block=block, warps=warps)
            rows.append(_opt_row(env, f"fasttrain one launch, block {block} x {warps} warps",
                                 shape, flat_step(), gbytes))
    finally:
        adamw.LAUNCH.update(default)
    return rows


def _opt_row(env: dict, variant: str, shape: dict, step, gbytes: float) -> dict:
    from triton.testing import do_bench

    step()
    torch.cuda.synchronize()
    launched = do_bench(step, warmup=3, rep=30, return_mode="median")
    return _row(env, "optimizer", variant, shape, "fp32",
                (launched, graph_ms(step), 0.0), ("gb_per_s", gbytes))


GROUPS = {"linear_ce": linear_ce_rows, "norms": norm_rows, "fp8": fp8_rows,
          "activations": activation_rows, "rope": rope_rows, "window": window_rows,
          "optimizer": optimizer_rows, "groupnorm": groupnorm_rows, "attention": attention_rows,
          "map_window": map_window_rows,
          "conv": conv_rows,
          "wide_attention": wide_attention_rows, "geglu": geglu_rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=",".join(GROUPS), help=f"of {', '.join(GROUPS)}")
    args = ap.parse_args()
    env = environment("cuda")
    out = Path(args.out)
    out.unlink(missing_ok=True)
    for name in args.only.split(","):  # each group's rows written as it finishes
        append_rows(str(out), GROUPS[name](env))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
