"""GroupNorm (optionally followed by SiLU) in Triton, forward and backward, for any memory
layout — built for the channels-last activations of a convolutional UNet and VAE. ``x_bias``
(a convolution's bias left out of it, plus a time embedding) is added inside the kernels.

What is fused
    ``group_norm(x, weight, bias, groups, eps, silu)`` computes
    ``silu(group_norm(x) * weight + bias)`` (or without the SiLU) in two passes over x: a
    reduction pass, in which each program sums one block of channels over a range of positions
    into per-channel partial sums, and an elementwise pass that normalizes, applies the affine
    and the SiLU and writes y. Both passes walk tiles of (positions × channels) and read x in its
    own layout: in channels-last memory a tile row is a run of contiguous channels, so the reads
    coalesce whatever the group width (4 channels of 2 bytes at the VAE's 512 × 512 stage).
    Between the two, one small kernel (on a GPU a program per sample and group) combines the
    partial sums into the group's statistics and writes what the elementwise pass reads per
    (sample, channel). The backward is two passes as well: one reduction of the gradient's per-channel
    sums (which give dweight, dbias and the group terms of dx), the same small combining
    kernel, and one elementwise pass for dx. y and dx come out in x's layout and dtype. The
    gradient of ``x_bias`` (Σ dx over the positions) comes from those per-channel sums, not
    from a pass over dx.

    The combining kernels replaced a dozen small PyTorch ops, which Inductor compiled into 2-6
    kernels each way: 8-11 µs between the two passes of every GroupNorm, 1.54 ms of an SD step
    over its 142 GroupNorm passes forward and backward (profile-sd-base-20261122-094525).

When it helps
    Under ``torch.compile`` with channels-last activations: Inductor reduces each group over its
    own channels, a few bytes wide with a stride of the full channel count, so its GroupNorm
    kernels read a fraction of each memory transaction (the top non-convolution kernels of
    SD's profile, profile-sd-base-20261121-034602: 16.6 ms a step in the VAE encoder's
    GroupNorm + SiLU at 512 px, 22 ms in all). In contiguous (NCHW) memory a group is one
    contiguous run, which Inductor already reads well.

Numerics
    Sums, statistics and the affine in fp32 whatever the input dtype. Each program's sums are
    taken about a per-(sample, channel) pivot (the channel's first value), and the per-channel
    results are combined into group statistics with Chan's formula (means and sums of squared
    deviations), so a large mean does not cancel the variance away. y is rounded once to x's
    dtype: the value an autocast GroupNorm (fp32) followed by SiLU hands the next convolution.
    weight and bias may be fp32 while x is bf16/fp16; their gradients come back in their own
    dtype.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton

from ._group_norm_kernels import _apply_kernel, _stats_kernel, _sum_kernel, _terms_kernel
from ._triton import INTERPRETED, launch, op, programs_cap, realized

__all__ = ["group_norm", "group_norm_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Tile of the reduction passes (positions × channels) and of the elementwise passes; the
# channel block is the widest power of two from 16 up to 128 that divides the channel count (a
# partial last block is masked). Samples share grid axis 0 with the positions (axis 1 of a CUDA
# grid holds at most 65,535). The reduction pass's loads are software-pipelined ``sum_stages``
# tiles ahead (launch-tune-20261121-1633: 3 stages, 64 positions a tile, 2 programs per SM took
# SD's six GroupNorm shapes together 1.9% below 32 positions, 4 programs, no pipelining).
# The combining kernels between the passes: on a GPU a program per (sample, group), 1 warp,
# 16 splits' sums a load (measured as part of the step: train-group-stats-sd-20261122-1351);
# interpreted, a sample's groups in one program (tiles of up to ``stats_elements``), since the
# interpreter runs programs one after another.
LAUNCH = {"sum_rows": 64, "apply_rows": 64, "max_channels": 128, "sum_warps": 4,
          "apply_warps": 8, "programs_per_sm": 2, "sum_stages": 3,
          "stats_groups": None if INTERPRETED else 1, "stats_elements": 1024,
          "stats_warps": 1}


# ----------------------------------------------------------------------------- launch helpers

def _shape(t: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(N, L, C, sN, sL, sC) of (N, C, *spatial) read as (N, positions, C): the caller makes t
    contiguous in one of the layouts whose spatial dims collapse into one (channels-last or
    contiguous); the strides are those of that (N, L, C) view.

    The kernels take t itself, never a view of it: handed a view of a value Inductor has not
    written to memory yet (a convolution's bias add, a residual sum), Inductor writes one copy
    of it for every kernel argument that view is (four stores in one kernel at the VAE's
    512-px stage, 0.68 ms: profile-sd-base-20261122-035033); see ``_triton.realized``."""
    N, C = t.shape[:2]
    L = math.prod(t.shape[2:])
    # the view's strides, not t's own: a size-1 spatial dim's stride is arbitrary in a tensor
    # PyTorch still calls contiguous; the view itself is never passed on
    return (N, L, C, *t.movedim(1, -1).view(N, L, C).stride())


def _channel_block(C: int) -> int:
    """The widest power of two from 16 up to LAUNCH's maximum that divides C (at most C's next
    power of two)."""
    block_c = LAUNCH["max_channels"]
    while block_c > 16 and C % block_c:
        block_c //= 2
    return min(block_c, triton.next_power_of_2(C))


def _blocks(L: int, C: int, N: int, device: torch.device) -> tuple[int, int, int, int]:
    """(channel block, channel blocks, splits of the positions, rows per split)."""
    block_c = _channel_block(C)
    cblocks = triton.cdiv(C, block_c)
    rows = LAUNCH["sum_rows"]
    cap = programs_cap(device, LAUNCH["programs_per_sm"])
    splits = max(1, min(triton.cdiv(L, rows), cap // max(1, N * cblocks)))
    per = triton.cdiv(triton.cdiv(L, splits), rows) * rows
    return block_c, cblocks, triton.cdiv(L, per), per


def _sums(x: torch.Tensor, dy: Optional[torch.Tensor], per_channel: Optional[torch.Tensor],
          silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduction pass: two (N, splits, C) fp32 partial per-channel sums (see
    ``_sum_kernel``), one row per split of the positions; ``per_channel`` is the forward's (5, N,
    C) μ, a, b, rstd, e in the backward, None in the forward."""
    N, L, C, sN, sL, sC = _shape(x)
    block_c, cblocks, splits, per = _blocks(L, C, N, x.device)
    s1 = torch.empty((N, splits, C), device=x.device, dtype=torch.float32)
    s2 = torch.empty_like(s1)
    mu, a, b, r = (s1,) * 4 if per_channel is None else per_channel[:4]  # the forward: unread
    launch(_sum_kernel, (splits * N, cblocks), x, s1 if dy is None else dy, mu, a, b, r,
           s1, s2, L, C, sN, sL, sC, per, splits, BACKWARD=dy is not None, SILU=silu,
           STAGES=LAUNCH["sum_stages"], BLOCK_L=LAUNCH["sum_rows"], BLOCK_C=block_c,
           num_warps=LAUNCH["sum_warps"])
    return s1, s2


def _group_grid(s1: torch.Tensor, groups: int) -> tuple[tuple[int, int], dict]:
    """The grid and tiles of the combining kernels: a program per sample and block of
    ``LAUNCH["stats_groups"]`` groups (None: as many as fit a tile of ``stats_elements``
    group channels), reading up to 16 splits' sums at a time."""
    N, splits, C = s1.shape
    block_cg = max(2, triton.next_power_of_2(C // groups))
    block_g = LAUNCH["stats_groups"]
    if block_g is None:
        fit = max(1, LAUNCH["stats_elements"] // block_cg)
        block_g = min(triton.next_power_of_2(groups), 1 << (fit.bit_length() - 1))
    return (N, triton.cdiv(groups, block_g)), {
        "BLOCK_S": min(16, triton.next_power_of_2(splits)), "BLOCK_G": block_g,
        "BLOCK_CG": block_cg, "num_warps": LAUNCH["stats_warps"]}


def _stats(x: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor, x_bias: Optional[torch.Tensor], groups: int, eps: float
           ) -> torch.Tensor:
    """(5, N, C) fp32 per (sample, channel): μ, a, b, rstd, e (``_stats_kernel``), from the
    forward's partial sums, in one launch."""
    N, L, C, sN, _, sC = _shape(x)
    pc = torch.empty((5, N, C), device=x.device, dtype=torch.float32)
    if x_bias is None:
        sh, shN, shC = pc, 0, 0
    else:
        sh, shN, shC = x_bias, (x_bias.stride(0) if x_bias.dim() == 2 else 0), x_bias.stride(-1)
    grid, meta = _group_grid(s1, groups)
    launch(_stats_kernel, grid, s1, s2, x, sh, weight, bias, pc, s1.shape[1], L, C, groups,
           C // groups, N, sN, sC, shN, shC, eps, HAS_SHIFT=x_bias is not None, **meta)
    return pc


def _terms(t1: torch.Tensor, t2: torch.Tensor, weight: torch.Tensor, pc: torch.Tensor, L: int,
           groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(4, N, C) fp32 q, k, Σ dz, Σ dz·x̂ and (N, C) fp32 Σ dx per (sample, channel)
    (``_terms_kernel``), in one launch."""
    N, splits, C = t1.shape
    out = torch.empty((4, N, C), device=t1.device, dtype=torch.float32)
    dxb = torch.empty((N, C), device=t1.device, dtype=torch.float32)
    grid, meta = _group_grid(t1, groups)
    launch(_terms_kernel, grid, t1, t2, weight, pc, out, dxb, splits, L, C, groups, C // groups,
           N, **meta)
    return out, dxb


def _apply(x: torch.Tensor, dy: Optional[torch.Tensor], per_channel: tuple[torch.Tensor, ...],
           silu: bool) -> torch.Tensor:
    """The elementwise pass: y (dy None, ``per_channel`` = μ, a, b) or dx (μ, a, b, p, q, k),
    with x's strides and dtype."""
    out = torch.empty_strided(x.size(), x.stride(), device=x.device, dtype=x.dtype)
    N, L, C, sN, sL, sC = _shape(x)
    block_c = _channel_block(C)
    rows = LAUNCH["apply_rows"]
    mu, a, b, p, q, k = per_channel if dy is not None else (*per_channel, *per_channel)
    blocks = triton.cdiv(L, rows)
    launch(_apply_kernel, (blocks * N, triton.cdiv(C, block_c)),
           x, out if dy is None else dy, mu, a, b, p, q, k, out, L, C,
           sN, sL, sC, blocks, BACKWARD=dy is not None, SILU=silu, BLOCK_L=rows, BLOCK_C=block_c,
           num_warps=LAUNCH["apply_warps"])
    return out


# ----------------------------------------------------------------------------- custom ops

@op("fasttrain::group_norm_fwd")
def _fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
         x_bias: Optional[torch.Tensor], groups: int, eps: float,
         silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    N, C = x.shape[:2]
    if x.numel() == 0:
        return torch.empty_like(x), torch.zeros((5, N, C), device=x.device, dtype=torch.float32)
    x = realized(x.contiguous(memory_format=_layout(x)))
    s1, s2 = _sums(x, None, None, silu)
    pc = _stats(x, s1, s2, weight, bias, x_bias, groups, eps)
    return _apply(x, None, (pc[0], pc[1], pc[2]), silu), pc


@op("fasttrain::group_norm_bwd")
def _bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, pc: torch.Tensor,
         groups: int, silu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    N, C = x.shape[:2]
    if x.numel() == 0:
        zeros = torch.zeros_like(weight, dtype=torch.float32)
        return torch.empty_like(x), zeros, zeros.clone(), torch.zeros((N, C), device=x.device)
    x = realized(x.contiguous(memory_format=_layout(x)))
    if dy.stride() != x.stride():
        dy = torch.empty_strided(x.size(), x.stride(), device=x.device, dtype=dy.dtype).copy_(dy)
    dy = realized(dy)
    t1, t2 = _sums(x, dy, pc, silu)  # Σ dz and Σ dz·x̂ per (sample, split, channel)
    terms, dxb = _terms(t1, t2, weight, pc, x.numel() // (N * C), groups)
    # dx = r·(w·dz − c1 − x̂·c2) = dz·(r·w) + (x − μ)·(−r²·c2) + (−r·c1)
    dx = _apply(x, dy, (pc[0], pc[1], pc[2], pc[1], terms[0], terms[1]), silu)
    return dx, terms[3].sum(0), terms[2].sum(0), dxb


def _setup(ctx, inputs, output) -> None:
    x, weight, bias, x_bias, groups, _eps, silu = inputs
    ctx.groups, ctx.silu = groups, silu
    ctx.bias_dtype = bias.dtype
    ctx.x_bias = None if x_bias is None else (x_bias.dim(), x_bias.dtype)
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _dpc):
    x, weight, pc = ctx.saved_tensors
    dy = torch.zeros_like(x) if dy is None else dy  # the op gives it x's strides
    dx, dw, db, dxb = torch.ops.fasttrain.group_norm_bwd(dy, x, weight, pc, ctx.groups,
                                                         ctx.silu)
    if ctx.x_bias is not None and ctx.needs_input_grad[3]:
        # x_bias was added to every position: its gradient is Σ dx over them, per (sample,
        # channel) from the sums the backward has (not a pass over dx)
        dim, dtype = ctx.x_bias
        dxb = (dxb.sum(0) if dim == 1 else dxb).to(dtype)
    else:
        dxb = None
    return dx, dw.to(weight.dtype), db.to(ctx.bias_dtype), dxb, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------- public API

def _layout(x: torch.Tensor) -> torch.memory_format:
    """x's own layout where its spatial dims collapse into one (channels-last or
    contiguous), else contiguous."""
    last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    if last is not None and x.is_contiguous(memory_format=last):
        return last
    return torch.contiguous_format


def _check(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
           groups: int, x_bias: Optional[torch.Tensor] = None) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must be (batch, channels, *spatial), got shape {tuple(x.shape)}")
    N, C = x.shape[:2]
    if groups < 1 or C % groups:
        raise ValueError(f"{C} channels do not split into {groups} groups")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.shape != (C,) or p.dtype not in _DTYPES
                              or p.device != x.device):
            raise ValueError(f"{name} must be a ({C},) float tensor on {x.device}, got "
                             f"{tuple(p.shape)} {p.dtype} on {p.device}")
    if x_bias is not None and (x_bias.shape not in ((C,), (N, C)) or x_bias.dtype not in _DTYPES
                               or x_bias.device != x.device):
        raise ValueError(f"x_bias must be a ({C},) or ({N}, {C}) float tensor on {x.device}, got "
                         f"{tuple(x_bias.shape)} {x_bias.dtype} on {x_bias.device}")


def group_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               groups: int, eps: float = 1e-5, silu: bool = False,
               x_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.group_norm(x + x_bias, groups, weight, bias, eps)``, followed by SiLU if ``silu``; x
    is (batch, channels, *spatial) in any layout (channels-last and contiguous are read in
    place, others copied to contiguous first). ``x_bias``, (channels,) or (batch, channels), is
    added to every position in fp32 without ``x + x_bias`` being written (a convolution's bias,
    left out of it, plus a time embedding). Returns x's dtype, and x's layout where it is
    channels-last or contiguous (else contiguous). Differentiable once (no double backward)."""
    _check(x, weight, bias, groups, x_bias)
    C = x.shape[1]
    w = torch.ones(C, device=x.device) if weight is None else weight.contiguous()
    b = torch.zeros(C, device=x.device) if bias is None else bias.contiguous()
    y, _ = torch.ops.fasttrain.group_norm_fwd(x.contiguous(memory_format=_layout(x)), w, b,
                                                 x_bias, groups, float(eps), bool(silu))
    return y


def group_norm_reference(x: torch.Tensor, weight: Optional[torch.Tensor],
                         bias: Optional[torch.Tensor], groups: int, eps: float = 1e-5,
                         silu: bool = False, x_bias: Optional[torch.Tensor] = None
                         ) -> torch.Tensor:
    """Plain PyTorch: GroupNorm (and SiLU) in fp32 (or wider), as autocast runs it, of
    ``x + x_bias`` (added in that precision), rounded to x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    z = x.to(acc)
    if x_bias is not None:
        z = z + x_bias.to(acc).reshape(*x_bias.shape, *(1,) * (x.dim() - 2))
    y = F.group_norm(z, groups, None if weight is None else weight.to(acc),
                     None if bias is None else bias.to(acc), eps)
    return (F.silu(y) if silu else y).to(x.dtype)
