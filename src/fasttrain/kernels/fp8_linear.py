"""FP8 linear layers: the three matmuls of a linear layer in float8 on tensor cores.

Hopper and Ada GPUs multiply float8 at twice the bf16 rate (H200: ~1,600 vs ~800 TFLOP/s
dense). Here a linear layer's forward, ``y = x wᵀ``, and both gradient matmuls, ``dx = dy w`` and
``dw = dyᵀ x``, run as ``torch._scaled_mm`` of float8 operands: e4m3 (3 mantissa bits, range
±448) for activations and weights, e5m2 (2 mantissa bits, range ±57,344) for the output
gradient, whose values span a wider range. Every operand is scaled by its own absolute maximum
at every call ("dynamic tensorwise" scaling, as torchao's default recipe), so there is no
history to keep and nothing to calibrate. Accumulation is fp32 inside the tensor cores; the
output is bf16, the weight gradient fp32 (or the weight's dtype).

Memory: the input is saved for backward in float8 (half the bytes of bf16). Cost: each operand
is read once for its maximum and once for the cast — under torch.compile both fuse into the
neighbouring kernels. Shapes: ``_scaled_mm`` needs every matmul dimension divisible by 16;
a call whose token count is not runs the plain matmul instead (same result class, bf16).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALIGN = 16  # _scaled_mm: every dimension a multiple of 16
# Below this many weights the casts cost more than the faster matmul saves. H200 rows
# (kernels-micro-fp8-20261121-0549), one layer forward + backward, compiled, against bf16:
# 2048→8192 and 8192→2048 at 8,192 tokens 1.30× and 1.28× faster; 768→3072 at 25,216 tokens
# 1.06×; 2048→2048, 2048→512, 768→2304, 3072→768, 512→2048, 320→2560 slower (0.5–0.8×).
LARGE = 2 ** 24


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8, inv_scale)`` with ``x ≈ x8.float() * inv_scale``; x's absolute max maps to the
    format's largest finite value. An all-zero tensor gets scale 1/1e-12 (its fp8 is zero)."""
    fmax = torch.finfo(dtype).max
    amax = x.detach().abs().amax().float()
    scale = fmax / amax.clamp(min=1e-12)
    x8 = (x.float() * scale).clamp(-fmax, fmax).to(dtype)
    return x8, scale.reciprocal()


def _scaled_mm(a8, b8, sa, sb, out_dtype, fast_accum=False, bias=None):
    """a8 (M, K) row-major @ b8 (K, N) column-major, dequantised by sa·sb."""
    return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def fp8_shapes_ok(tokens: int, in_features: int, out_features: int) -> bool:
    """Whether all three matmuls of a linear layer meet _scaled_mm's alignment."""
    return tokens % ALIGN == 0 and in_features % ALIGN == 0 and out_features % ALIGN == 0


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):  # x (M, K), weight (N, K), bias (N,) or None
        x8, sx = to_fp8(x, E4M3)
        w8, sw = to_fp8(weight, E4M3)
        b = bias.to(torch.bfloat16) if bias is not None else None
        # the fast-accumulation mode is for the forward only (torchao's choice): gradients,
        # summed over many more terms, keep the exact fp32 accumulation
        out = _scaled_mm(x8, w8.t(), sx, sw, torch.bfloat16, fast_accum=True, bias=b)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):  # dy (M, N)
        x8, sx, w8, sw = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dy8, sdy = to_fp8(dy, E5M2)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # (M, N) @ (N, K): w as a column-major (N, K)
            dx = _scaled_mm(dy8, w8.t().contiguous().t(), sdy, sw, torch.bfloat16).to(x_dtype)
        if ctx.needs_input_grad[1]:  # (N, M) @ (M, K): x as a column-major (M, K)
            out = torch.float32 if w_dtype == torch.float32 else torch.bfloat16
            dw = _scaled_mm(dy8.t().contiguous(), x8.t().contiguous().t(), sdy, sx,
                            out).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32).to(b_dtype)
        return dx, dw, db


def fp8_linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with its matmuls in float8; bf16 output. Unaligned shapes run F.linear."""
    K, N = x.shape[-1], weight.shape[0]
    tokens = x.numel() // K if K else 0
    if not fp8_shapes_ok(tokens, K, N) or tokens == 0:
        return F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16),
                        bias.to(torch.bfloat16) if bias is not None else None)
    out = _FP8Linear.apply(x.reshape(tokens, K), weight, bias)
    return out.view(*x.shape[:-1], N)
