"""The Triton kernels of ``kernels/group_norm.py`` (which documents what they compute and the
layouts they read): the reduction pass and the elementwise pass, each both ways, and the small
kernels that combine the reduction pass's partial sums into what the elementwise pass reads."""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton import add, sum0

# Builtins of triton.language and the reductions of ._triton only: the kernels also run in
# the interpreter.


@triton.jit
def _tile(base, rows, cols, L, C, sL, sC):
    """Offsets and mask of a (positions × channels) tile."""
    mask = (rows < L)[:, None] & (cols < C)[None, :]
    return base + rows[:, None] * sL + cols.to(tl.int64)[None, :] * sC, mask


@triton.jit
def _silu_grad(dy, z):
    """dy · silu'(z) = dy · σ(z)(1 + z(1 − σ(z)))."""
    s = 1.0 / (1.0 + tl.exp(-z))
    return dy * s * (1.0 + z * (1.0 - s))


@triton.jit
def _channels(ptr, nc, cmask):
    """One per-(sample, channel) fp32 value for each column of the tile, as a row."""
    return tl.load(ptr + nc, mask=cmask, other=0.0)[None, :]


@triton.jit
def _sum_kernel(x_ptr, dy_ptr, mu_ptr, a_ptr, b_ptr, r_ptr, s1_ptr, s2_ptr,
                L, C, sN, sL, sC, rows_per, splits,
                BACKWARD: tl.constexpr, SILU: tl.constexpr, STAGES: tl.constexpr,
                BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per-channel sums over positions [split · rows_per, (split + 1) · rows_per) of sample n.
    Forward: Σ(x − pivot) and Σ(x − pivot)², pivot = the channel's value at position 0.
    Backward: Σ dz and Σ dz · x̂, dz the gradient at the norm's output (through the SiLU),
    x̂ = (x − μ)·rstd."""
    split = tl.program_id(0).to(tl.int64) % splits
    n = tl.program_id(0).to(tl.int64) // splits
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    base = n * sN
    nc = n * C + cols
    if BACKWARD:
        mu = _channels(mu_ptr, nc, cmask)
        a = _channels(a_ptr, nc, cmask)
        b = _channels(b_ptr, nc, cmask)
        r = _channels(r_ptr, nc, cmask)
    else:
        mu = tl.load(x_ptr + base + cols.to(tl.int64) * sC, mask=cmask,
                     other=0.0).to(tl.float32)[None, :]
    acc1 = tl.full((BLOCK_L, BLOCK_C), 0.0, tl.float32)
    acc2 = tl.full((BLOCK_L, BLOCK_C), 0.0, tl.float32)
    start = split * rows_per
    end = tl.minimum(start + rows_per, L)  # this split's positions only
    for i in tl.range(0, rows_per, BLOCK_L, num_stages=STAGES):
        offs, mask = _tile(base, start + i + tl.arange(0, BLOCK_L), cols, end, C, sL, sC)
        d = tl.where(mask, tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) - mu,
                     0.0)
        if BACKWARD:
            dz = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if SILU:
                dz = _silu_grad(dz, d * a + b)
            acc1 += dz
            acc2 += dz * (d * r)
        else:
            acc1 += d
            acc2 += d * d
    out = (n * splits + split) * C + cols
    tl.store(s1_ptr + out, sum0(acc1), mask=cmask)
    tl.store(s2_ptr + out, sum0(acc2), mask=cmask)


@triton.jit
def _apply_kernel(x_ptr, dy_ptr, mu_ptr, a_ptr, b_ptr, p_ptr, q_ptr, k_ptr, out_ptr,
                  L, C, sN, sL, sC, row_blocks,
                  BACKWARD: tl.constexpr, SILU: tl.constexpr,
                  BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    """Forward: y = act(z), z = (x − μ)·a + b. Backward: dx = dz·p + (x − μ)·q + k, dz the
    gradient through the SiLU of z. μ, a, b, p, q, k: one fp32 value per (sample, channel)."""
    rows = (tl.program_id(0).to(tl.int64) % row_blocks) * BLOCK_L + tl.arange(0, BLOCK_L)
    n = tl.program_id(0).to(tl.int64) // row_blocks
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    nc = n * C + cols
    offs, mask = _tile(n * sN, rows, cols, L, C, sL, sC)
    d = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) - _channels(mu_ptr, nc, cmask)
    z = d * _channels(a_ptr, nc, cmask) + _channels(b_ptr, nc, cmask)
    if BACKWARD:
        dz = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if SILU:
            dz = _silu_grad(dz, z)
        out = dz * _channels(p_ptr, nc, cmask) + d * _channels(q_ptr, nc, cmask) + \
            _channels(k_ptr, nc, cmask)
    elif SILU:
        out = z / (1.0 + tl.exp(-z))
    else:
        out = z
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _groups(n, gb, C, G, Cg, BLOCK_G: tl.constexpr, BLOCK_CG: tl.constexpr):
    """Groups gb·BLOCK_G … of sample n as a (groups × their channels) tile: the channels'
    indices, the tile's mask and the (sample, channel) slots."""
    g = gb * BLOCK_G + tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_CG)
    cols = g[:, None] * Cg + c[None, :]
    mask = (g < G)[:, None] & (c < Cg)[None, :]
    return cols, mask, n * C + cols


@triton.jit
def _split_sums(s_ptr, n, cols, mask, splits, C, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_CG: tl.constexpr):
    """Σ over the reduction pass's splits of one sample's (N, splits, C) partial sums, BLOCK_S
    splits at a time."""
    acc = tl.full((BLOCK_G, BLOCK_CG), 0.0, tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        rows = s0 + tl.arange(0, BLOCK_S)
        m3 = (rows < splits)[:, None, None] & mask[None, :, :]
        acc += tl.reduce(tl.load(s_ptr + ((n * splits + rows) * C)[:, None, None]
                                 + cols[None, :, :], mask=m3, other=0.0), 0, add)
    return acc


@triton.jit
def _stats_kernel(s1_ptr, s2_ptr, x_ptr, sh_ptr, w_ptr, b_ptr, pc_ptr, splits, L, C, G, Cg, N,
                  sN, sC, shN, shC, eps, HAS_SHIFT: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_CG: tl.constexpr):
    """Groups block program_id(1) of sample program_id(0), forward: the channels' sums about
    their pivots (x at position 0) → channel means and squared deviations → each group's mean
    and rstd by Chan's formula → per channel μ, a = rstd·w, b, rstd and e = channel mean −
    group mean (rows 0-4 of pc, (5, N, C)); with a shift (x_bias) the means are those of
    x + shift and μ = group mean − shift."""
    n = tl.program_id(0).to(tl.int64)
    cols, mask, nc = _groups(n, tl.program_id(1), C, G, Cg, BLOCK_G, BLOCK_CG)
    eps = tl.cast(eps, tl.float32)
    Lf = tl.cast(L, tl.float32)
    s1 = _split_sums(s1_ptr, n, cols, mask, splits, C, BLOCK_S, BLOCK_G, BLOCK_CG)
    s2 = _split_sums(s2_ptr, n, cols, mask, splits, C, BLOCK_S, BLOCK_G, BLOCK_CG)
    ch_mean = tl.load(x_ptr + n * sN + cols.to(tl.int64) * sC, mask=mask,
                      other=0.0).to(tl.float32) + s1 / Lf
    shift = tl.full((BLOCK_G, BLOCK_CG), 0.0, tl.float32)
    if HAS_SHIFT:  # a channel's shift moves its mean, not its squared deviations
        shift = tl.load(sh_ptr + n * shN + cols * shC, mask=mask, other=0.0).to(tl.float32)
        ch_mean += shift
    ch_m2 = s2 - s1 * s1 / Lf
    cgf = tl.cast(Cg, tl.float32)
    mean = tl.reduce(tl.where(mask, ch_mean, 0.0), 1, add) / cgf
    dev = tl.where(mask, ch_mean - mean[:, None], 0.0)
    m2 = tl.reduce(tl.where(mask, ch_m2, 0.0), 1, add) + Lf * tl.reduce(dev * dev, 1, add)
    rstd = tl.rsqrt(tl.maximum(m2 / (Lf * cgf), 0.0) + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    NC = N * C
    tl.store(pc_ptr + nc, mean[:, None] - shift, mask=mask)
    tl.store(pc_ptr + NC + nc, rstd[:, None] * w, mask=mask)
    tl.store(pc_ptr + 2 * NC + nc, b, mask=mask)
    tl.store(pc_ptr + 3 * NC + nc, tl.full((BLOCK_G, BLOCK_CG), 0.0, tl.float32)
             + rstd[:, None], mask=mask)
    tl.store(pc_ptr + 4 * NC + nc, dev, mask=mask)


@triton.jit
def _terms_kernel(t1_ptr, t2_ptr, w_ptr, pc_ptr, out_ptr, dxb_ptr, splits, L, C, G, Cg, N,
                  BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_CG: tl.constexpr):
    """Groups block program_id(1) of sample program_id(0), backward: per channel Σ dz and
    Σ dz·x̂ (rows 2, 3 of out, (4, N, C)), the group terms of dx = dz·a + (x − μ)·q + k (q
    and k: rows 0, 1) and Σ over positions of dx, = a·Σdz + q·L·e + L·k (dxb, (N, C):
    x_bias's gradient)."""
    n = tl.program_id(0).to(tl.int64)
    cols, mask, nc = _groups(n, tl.program_id(1), C, G, Cg, BLOCK_G, BLOCK_CG)
    Lf = tl.cast(L, tl.float32)
    t1 = _split_sums(t1_ptr, n, cols, mask, splits, C, BLOCK_S, BLOCK_G, BLOCK_CG)
    t2 = _split_sums(t2_ptr, n, cols, mask, splits, C, BLOCK_S, BLOCK_G, BLOCK_CG)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    m = Lf * tl.cast(Cg, tl.float32)
    c1 = tl.reduce(t1 * w, 1, add) / m
    c2 = tl.reduce(t2 * w, 1, add) / m
    NC = N * C
    a = tl.load(pc_ptr + NC + nc, mask=mask, other=0.0)
    r = tl.load(pc_ptr + 3 * NC + nc, mask=mask, other=0.0)
    e = tl.load(pc_ptr + 4 * NC + nc, mask=mask, other=0.0)
    q = -r * r * c2[:, None]
    k = -r * c1[:, None]
    tl.store(out_ptr + nc, q, mask=mask)
    tl.store(out_ptr + NC + nc, k, mask=mask)
    tl.store(out_ptr + 2 * NC + nc, t1, mask=mask)
    tl.store(out_ptr + 3 * NC + nc, t2, mask=mask)
    tl.store(dxb_ptr + nc, a * t1 + q * Lf * e + Lf * k, mask=mask)
