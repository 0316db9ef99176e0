"""Attention through torch's scaled_dot_product_attention, and heads too wide for its kernels.

Which kernel SDPA picks (flash, memory-efficient, cuDNN, math) is decided by the attention
technique with ``torch.nn.attention.sdpa_kernel`` around the step, never here, so every model
gets the same switch. Inputs are (B, heads, T, head_dim).

Heads wider than 256 (the SD VAE's mid-block: one head of 512 over 4,096 positions) have no
flash or cuDNN kernel, and SDPA runs its memory-efficient kernel at ~140 TFLOP/s (1.98 ms at
batch 8). Without autograd (a frozen encoder) on a GPU, such attention is computed as SDPA's math
kernel computes it, as two GEMMs around a softmax, with the scores accumulated and kept in fp32
and the probabilities rounded to the inputs' dtype before the second GEMM (as the fused kernels
do): 0.73 ms compiled at the VAE's shape, with a largest error against an fp32 SDPA comparable
to the memory-efficient kernel's (6.0e-4 against 5.5e-4;
``benchmarks/results/kernels-micro-wide-attention-20261122-0445.jsonl``). The fp32 scores take
B·heads·Tq·Tk·4 bytes (0.5 GiB for the VAE at 512 px; the softmax's output is a second such
buffer); above 1 GiB of scores, SDPA runs instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FUSED_MAX_HEAD_DIM = 256  # the widest head SDPA's flash and cuDNN kernels take
SCORES_MAX_BYTES = 1 << 30
GEMM_EVENT = "fasttrain::gemm_attention"  # the profiler label techniques.attention counts


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              bias: torch.Tensor | None = None, causal: bool = False,
              enable_gqa: bool = False) -> torch.Tensor:
    """softmax(q kᵀ / √d + bias) v ; ``bias`` is additive (B or 1, heads or 1, Tq, Tk)."""
    if bias is None and not causal and not enable_gqa and _wide_inference(q, k, v):
        with torch.profiler.record_function(GEMM_EVENT):  # the run's attention line counts it
            return gemm_attention(q, k, v)
    if bias is not None and bias.dtype != q.dtype:
        bias = bias.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal,
                                          enable_gqa=enable_gqa)


def _wide_inference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Heads SDPA has no fused kernel for, on a GPU, in 16-bit, without autograd, within the
    scores' memory cap."""
    if q.dim() != 4:
        return False
    B, H, Tq, D = q.shape
    return (D > FUSED_MAX_HEAD_DIM and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and k.shape == v.shape == (B, H, k.shape[2], D)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
            and B * H * Tq * k.shape[2] * 4 <= SCORES_MAX_BYTES)


def gemm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d) v as two batched GEMMs and a softmax: fp32 scores (a 16-bit GEMM with
    fp32 output on a GPU, fp32 inputs elsewhere), probabilities in v's dtype."""
    B, H, Tq, D = q.shape
    q3, k3, v3 = (t.reshape(B * H, t.shape[2], D) for t in (q, k, v))
    if q.is_cuda:
        scores = torch.bmm(q3, k3.transpose(1, 2), out_dtype=torch.float32)
    else:
        scores = torch.bmm(q3.float(), k3.float().transpose(1, 2))
    probs = scores.mul_(D ** -0.5).softmax(dim=-1).to(v.dtype)  # two fp32 buffers at a time
    return torch.bmm(probs, v3).view(B, H, Tq, D)
