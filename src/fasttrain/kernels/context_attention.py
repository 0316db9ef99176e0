"""Attention to a short context (at most 128 keys: SD's 77 text tokens) straight from the
projections' (B, T, C) layouts, one Triton kernel each way.

What is fused
    ``context_attention(q, k, v, heads)`` computes ``softmax(q kᵀ · scale) v`` for every
    sample and head from q (B, T, C) and k, v (B, Tk, C), the heads side by side on the last
    dim, and writes (B, T, C) for the output projection: no head permutes, no score matrix in
    memory. All of a head's keys fit one tile, so the forward is one pass over the queries
    (no online softmax); it keeps each row's log-sum-exp. The backward is one kernel: each
    program takes every few blocks of queries of one (sample, head), recomputes the
    probabilities, writes dq and sums its share of dk and dv in registers; the shares (a few
    per head) are added by ``torch.sum``: no atomics.

When it helps
    SDPA's kernels tile the keys for long contexts: at SD's 64 × 64 latents (4,096 queries, 77
    keys, head dim 40, batch 8 × 8 heads) cuDNN's forward and backward took 0.200 ms a layer,
    against ~0.03 ms of memory traffic (attention-probe-sd-20261122-1342); its backward ran
    on 64 of the H200's 132 SMs.

Numerics
    Scores, softmax and the reductions in fp32 (exp2 of log2-scaled scores); the
    probabilities, and the scores' gradients, are rounded to the inputs' dtype before they
    multiply (as flash attention does); dk and dv are summed in fp32. fp32 inputs multiply in
    full fp32 (no TF32).

Limits
    Head dim at most 64 and at most 128 keys (the register budget of the backward's dk and dv
    sums); q, k and v in one float dtype, their last dim contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import INTERPRETED, add, launch, maximum, op, output_grad, tile_dot

__all__ = ["context_attention", "context_attention_reference", "LAUNCH", "MAX_KEYS",
           "MAX_HEAD_DIM"]

MAX_KEYS = 128
MAX_HEAD_DIM = 64
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

LAUNCH = {"fwd_block": 64, "fwd_warps": 4, "bwd_block": 64, "bwd_warps": 8,
          "bwd_programs_per_head": 8}
"""Queries a block and warps a program each way; the backward's programs per (sample, head),
each taking every ``bwd_programs_per_head``-th block of queries."""


@triton.jit
def _tiles(q_ptr, k_ptr, v_ptr, b, h, rows, T, Tk, D, sqb, sqt, skb, skt, svb, svt,
           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """q (rows × D) of sample b, head h, and all of its keys and values (Tk × D); masks."""
    dcol = tl.arange(0, BLOCK_D)
    dmask = dcol < D
    keys = tl.arange(0, BLOCK_N)
    kmask = keys < Tk
    rmask = rows < T
    q = tl.load(q_ptr + b * sqb + rows[:, None] * sqt + (h * D + dcol)[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    kvmask = kmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + b * skb + keys[:, None] * skt + (h * D + dcol)[None, :], mask=kvmask,
                other=0.0)
    v = tl.load(v_ptr + b * svb + keys[:, None] * svt + (h * D + dcol)[None, :], mask=kvmask,
                other=0.0)
    return q, k, v, dcol, dmask, kmask, rmask


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, T, Tk, H, D, sqb, sqt, skb, skt, svb,
                svt, scale, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Queries block program_id(0) of (sample, head) program_id(1): out (B, T, C) and the rows'
    log2-sum-exp2 of the log2-scaled scores (lse, (B·H, T))."""
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    q, k, v, dcol, dmask, kmask, rmask = _tiles(q_ptr, k_ptr, v_ptr, b, h, rows, T, Tk, D,
                                                sqb, sqt, skb, skt, svb, svt, BLOCK_N, BLOCK_D)
    s = tile_dot(q, tl.trans(k), DOT) * (tl.cast(scale, tl.float32) * 1.4426950408889634)
    s = tl.where(kmask[None, :], s, float("-inf"))
    m = tl.reduce(s, 1, maximum)
    p = tl.exp2(s - m[:, None])
    l = tl.reduce(p, 1, add)
    o = tile_dot(p.to(v.dtype), v, DOT) / l[:, None]
    C = H * D
    tl.store(o_ptr + (b * T + rows)[:, None] * C + (h * D + dcol)[None, :],
             o.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + bh * T + rows, m + tl.log2(l), mask=rmask)


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr,
                T, Tk, H, D, sqb, sqt, skb, skt, svb, svt, scale, blocks,
                DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Program (s, bh): query blocks s, s + S, … of (sample, head) bh (S = programs per head):
    dq of those rows, and this program's share of dk and dv (fp32, (S, B·H, Tk, D))."""
    split = tl.program_id(0)
    splits = tl.num_programs(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    sc = tl.cast(scale, tl.float32)
    C = H * D
    dk = tl.full((BLOCK_N, BLOCK_D), 0.0, tl.float32)
    dv = tl.full((BLOCK_N, BLOCK_D), 0.0, tl.float32)
    for blk in range(split, blocks, splits):
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        q, k, v, dcol, dmask, kmask, rmask = _tiles(
            q_ptr, k_ptr, v_ptr, b, h, rows, T, Tk, D, sqb, sqt, skb, skt, svb, svt, BLOCK_N,
            BLOCK_D)
        rc = (b * T + rows)[:, None] * C + (h * D + dcol)[None, :]
        rcmask = rmask[:, None] & dmask[None, :]
        do = tl.load(do_ptr + rc, mask=rcmask, other=0.0)
        o = tl.load(o_ptr + rc, mask=rcmask, other=0.0)
        lse = tl.load(lse_ptr + bh * T + rows, mask=rmask, other=0.0)
        s = tile_dot(q, tl.trans(k), DOT) * (sc * 1.4426950408889634)
        p = tl.where(kmask[None, :] & rmask[:, None], tl.exp2(s - lse[:, None]), 0.0)
        delta = tl.reduce(do.to(tl.float32) * o.to(tl.float32), 1, add)
        dv += tile_dot(tl.trans(p.to(do.dtype)), do, DOT)
        dp = tile_dot(do, tl.trans(v), DOT)
        ds = (p * (dp - delta[:, None])).to(q.dtype)
        dq = tile_dot(ds, k, DOT) * sc
        tl.store(dq_ptr + rc, dq.to(dq_ptr.dtype.element_ty), mask=rcmask)
        dk += tile_dot(tl.trans(ds), q, DOT)
    keys = tl.arange(0, BLOCK_N)
    dcol = tl.arange(0, BLOCK_D)
    at = ((split * tl.num_programs(1) + bh) * Tk + keys)[:, None] * D + dcol[None, :]
    mask = (keys < Tk)[:, None] & (dcol < D)[None, :]
    tl.store(dk_ptr + at, dk * sc, mask=mask)
    tl.store(dv_ptr + at, dv, mask=mask)


# ----------------------------------------------------------------------------- custom ops

def _meta(q: torch.Tensor, k: torch.Tensor, heads: int, way: str) -> dict:
    D = q.shape[2] // heads
    return dict(DOT=1 if q.dtype == torch.float32 else 2 if INTERPRETED else 0,
                BLOCK_M=LAUNCH[f"{way}_block"],
                BLOCK_N=max(16, triton.next_power_of_2(k.shape[1])),
                BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=LAUNCH[f"{way}_warps"])


@op("fasttrain::context_attention_fwd")
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, C = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B * heads, T), device=q.device, dtype=torch.float32)
    if q.numel():
        meta = _meta(q, k, heads, "fwd")
        launch(_fwd_kernel, (triton.cdiv(T, meta["BLOCK_M"]), B * heads), q, k, v, out, lse,
               T, k.shape[1], heads, C // heads, q.stride(0), q.stride(1), k.stride(0),
               k.stride(1), v.stride(0), v.stride(1), scale, **meta)
    return out, lse


@op("fasttrain::context_attention_bwd")
def _bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         out: torch.Tensor, lse: torch.Tensor, heads: int,
         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, C = q.shape
    Tk, D = k.shape[1], C // heads
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    if not q.numel():
        return dq, torch.zeros_like(k), torch.zeros_like(v)
    meta = _meta(q, k, heads, "bwd")
    blocks = triton.cdiv(T, meta["BLOCK_M"])
    splits = max(1, min(LAUNCH["bwd_programs_per_head"], blocks))
    dk = torch.empty((splits, B * heads, Tk, D), device=q.device, dtype=torch.float32)
    dv = torch.empty_like(dk)
    launch(_bwd_kernel, (splits, B * heads), q, k, v, out, dout, lse, dq, dk, dv, T, Tk, heads,
           D, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           scale, blocks, **meta)

    def heads_last(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.sum(0).view(B, heads, Tk, D).transpose(1, 2).reshape(B, Tk, C).to(like.dtype)

    return dq, heads_last(dk, k), heads_last(dv, v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, heads, scale = inputs
    ctx.heads, ctx.scale = heads, scale
    ctx.save_for_backward(q, k, v, output[0], output[1])


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fasttrain.context_attention_bwd(output_grad(out, dout), q, k, v, out,
                                                           lse, ctx.heads, ctx.scale)
    return dq, dk, dv, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------- public API

def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2]:
        raise ValueError(f"context_attention takes q (B, T, C) and k, v (B, Tk, C), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"context_attention needs q, k, v in one of fp32, bf16, fp16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if heads < 1 or q.shape[2] % heads:
        raise ValueError(f"{q.shape[2]} channels do not split into {heads} heads")
    if q.shape[2] // heads > MAX_HEAD_DIM or k.shape[1] > MAX_KEYS:
        raise ValueError(f"context_attention takes head dims up to {MAX_HEAD_DIM} and up to "
                         f"{MAX_KEYS} keys; got {q.shape[2] // heads} and {k.shape[1]}")


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                      scale: float | None = None) -> torch.Tensor:
    """``softmax(q kᵀ · scale) v`` per sample and head, q (B, T, C) and k, v (B, Tk, C) with
    the heads side by side on the last dim; ``scale`` defaults to head_dim^-½. Returns (B, T,
    C) in q's dtype."""
    _check(q, k, v, heads)
    scale = (q.shape[2] // heads) ** -0.5 if scale is None else float(scale)
    last = [t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v)]
    out, _ = torch.ops.fasttrain.context_attention_fwd(last[0].contiguous(), last[1], last[2],
                                                       heads, scale)
    return out


def context_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                                scale: float | None = None) -> torch.Tensor:
    """The same with SDPA, through (B, heads, T, D) views."""
    B, T, C = q.shape
    D = C // heads

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], heads, D).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(split(q), split(k), split(v),
                                                           scale=scale)
    return out.transpose(1, 2).reshape(B, T, C)
