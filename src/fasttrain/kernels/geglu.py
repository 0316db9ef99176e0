"""GEGLU in Triton, forward and backward: ``h · gelu(gate)`` of the two halves of one
projection's output (the feed-forward of SD's UNet transformer blocks).

What is fused
    ``geglu(x, bias)`` reads x (..., 2·D) in place, h and gate side by side on its last dim,
    adds the projection's bias (the GEMM runs without it) and writes (..., D); no chunked view
    is copied and ``x + bias`` is never stored. The backward reads x and dy once, computes GELU
    and its derivative once per (h, gate) pair, writes both halves of dx and per-program fp32
    partial column sums of dx (the bias gradient) that a final ``torch.sum`` reduces (no
    atomics). Inductor's own backward of ``h * gelu(gate)`` computed GELU's derivative for each
    element of the concatenated gradient: 0.30 ms a call at SD's 64 × 64 latents, about 2.5×
    its traffic at the copy ceiling (profile-sd-base-20261122-035033); these kernels took 0.196
    ms forward + backward (kernels-micro-geglu-20261122-0652). The bias gradient was then still
    a reduction of its own over the whole of dx (68 µs a call at 64 × 64 latents, about 0.6 ms
    of SD's step: profile-sd-base-20261122-081837).

Numerics
    fp32 math, as ``kernels.activations`` (whose exact and tanh GELU this shares): ``x + bias``
    is not rounded before the GELU (one rounding fewer than a GEMM with the bias in its
    epilogue); the output is rounded once to x's dtype; the bias gradient is summed in fp32
    from the unrounded dx and comes back in bias's dtype.

Layout
    x is viewed as (rows, 2·D). The forward's programs are 2-D tiles of the (rows, D) output;
    the backward's walk row tiles of one column block, as bias_gelu's backward does (``GEGLU``);
    rows and columns masked.
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton import launch, op, sum0
from .activations import (_APPROXIMATE, _bias_row, _check_bias, _check_float, _gelu_and_grad,
                          _grid_persistent)

__all__ = ["GEGLU", "geglu", "geglu_reference"]


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _geglu_fwd_kernel(x_ptr, b_ptr, y_ptr, n_rows, D, HAS_BIAS: tl.constexpr,
                      TANH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile (program_id(0), program_id(1)) of the (rows, D) output; h at column c of the (rows,
    2·D) input, gate at c + D."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    xo = rows[:, None] * (2 * D) + cols[None, :]
    h = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32) \
        + _bias_row(b_ptr, cols, cmask, HAS_BIAS, BLOCK_D)  # the bias of h, then of the gate
    g = tl.load(x_ptr + xo + D, mask=mask, other=0.0).to(tl.float32) \
        + _bias_row(b_ptr + D, cols, cmask, HAS_BIAS, BLOCK_D)
    act, _ = _gelu_and_grad(g, TANH)
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], (h * act).to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _geglu_bwd_kernel(dy_ptr, x_ptr, b_ptr, dx_ptr, db_ptr, n_rows, D, rows_per_prog,
                      HAS_BIAS: tl.constexpr, TANH: tl.constexpr, STAGES: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (p, c) walks the row tiles of rows p·rows_per_prog … (p + 1)·rows_per_prog of
    column block c (loads STAGES tiles ahead); with a bias it writes its fp32 partial column
    sums of both halves of dx to row p of db (rows, 2·D)."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    bh = _bias_row(b_ptr, cols, cmask, HAS_BIAS, BLOCK_D)
    bg = _bias_row(b_ptr + D, cols, cmask, HAS_BIAS, BLOCK_D)
    dbh = tl.full((BLOCK_R, BLOCK_D), 0.0, tl.float32)
    dbg = tl.full((BLOCK_R, BLOCK_D), 0.0, tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    for r0 in tl.range(start, end, BLOCK_R, num_stages=STAGES):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & cmask[None, :]
        xo = rows[:, None] * (2 * D) + cols[None, :]
        h = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32) + bh
        g = tl.load(x_ptr + xo + D, mask=mask, other=0.0).to(tl.float32) + bg
        dy = tl.load(dy_ptr + rows[:, None] * D + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        act, grad = _gelu_and_grad(g, TANH)
        dh = dy * act  # 0 where masked (dy = 0, act and grad finite)
        dg = dy * h * grad
        tl.store(dx_ptr + xo, dh.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + xo + D, dg.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            dbh += dh
            dbg += dg
    if HAS_BIAS:
        tl.store(db_ptr + pid * (2 * D) + cols, sum0(dbh), mask=cmask)
        tl.store(db_ptr + pid * (2 * D) + D + cols, sum0(dbg), mask=cmask)


# ----------------------------------------------------------------------------- launch helpers

# The forward: tiles of 4,096 outputs, the widest power of two up to 1,024 columns that divides
# D (SD's 1,280, 2,560 and 5,120: 256, 512, 1,024; no masked columns), or, where that is under
# 128, D's next power of two up to 1,024 with the last column block masked; 4 warps as
# bias_gelu's forward. The backward walks row tiles of 2,048 outputs (two fp32 partial sums
# of a tile live in registers with a bias), 2 programs per SM, loads 3 tiles ahead, as
# bias_gelu's backward (kernels/activations.py).
GEGLU = {"elements": 4096, "max_block_d": 1024, "warps": 4,
         "bwd_elements": 2048, "bwd_block_d": 512, "bwd_warps": 4, "programs_per_sm": 2,
         "stages": 3}


def _block_d(d: int, max_block_d: int) -> int:
    """The widest power of two up to ``max_block_d`` dividing d, or d's next power of two (up
    to ``max_block_d``, the last block masked) where that is under 128."""
    block_d = max_block_d
    while block_d > 1 and d % block_d:
        block_d //= 2
    if block_d < 128:
        block_d = min(max_block_d, triton.next_power_of_2(d))
    return block_d


def _geglu_grid(rows: int, d: int) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_R, BLOCK_D) of the forward over a (rows, d) output."""
    block_d = _block_d(d, GEGLU["max_block_d"])
    block_r = max(1, GEGLU["elements"] // block_d)
    return (triton.cdiv(rows, block_r), triton.cdiv(d, block_d)), block_r, block_d


def _geglu_bwd_grid(device: torch.device, rows: int, d: int) -> tuple[int, int, int, int, int]:
    """(row programs, column blocks, rows per program, BLOCK_R, BLOCK_D) of the backward."""
    block_d = _block_d(d, GEGLU["bwd_block_d"])
    block_r = max(1, GEGLU["bwd_elements"] // block_d)
    progs, col_blocks, per = _grid_persistent(device, rows, d, block_r, block_d,
                                              GEGLU["programs_per_sm"])
    return progs, col_blocks, per, block_r, block_d


# ----------------------------------------------------------------------------- custom ops

@op("fasttrain::geglu_fwd")
def _geglu_fwd(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str) -> torch.Tensor:
    rows, d = x.shape[0], x.shape[1] // 2
    y = x.new_empty((rows, d))
    if rows > 0:
        grid, block_r, block_d = _geglu_grid(rows, d)
        launch(_geglu_fwd_kernel, grid, x, x if bias is None else bias, y, rows, d,
               HAS_BIAS=bias is not None, TANH=approximate == "tanh", BLOCK_R=block_r,
               BLOCK_D=block_d, num_warps=GEGLU["warps"])
    return y


@op("fasttrain::geglu_bwd")
def _geglu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
               approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows, d = dy.shape
    dx = torch.empty_like(x)
    progs, col_blocks, per, block_r, block_d = _geglu_bwd_grid(x.device, rows, d)
    db = torch.empty((progs if bias is not None else 0, 2 * d), device=x.device,
                     dtype=torch.float32)  # per-program partials, every one written
    if rows > 0:
        launch(_geglu_bwd_kernel, (progs, col_blocks), dy, x, x if bias is None else bias, dx,
               dx if bias is None else db, rows, d, per, HAS_BIAS=bias is not None,
               TANH=approximate == "tanh", STAGES=GEGLU["stages"], BLOCK_R=block_r,
               BLOCK_D=block_d, num_warps=GEGLU["bwd_warps"])
    return dx, db.sum(0)


def _geglu_setup(ctx, inputs, output) -> None:
    x, bias, approximate = inputs
    ctx.approximate, ctx.has_bias = approximate, bias is not None
    ctx.save_for_backward(x, bias)


def _geglu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dy = x.new_zeros((x.shape[0], x.shape[1] // 2)) if dy is None else dy.contiguous()
    dx, db = torch.ops.fasttrain.geglu_bwd(dy, x, bias, ctx.approximate)
    return dx, (db.to(bias.dtype) if ctx.has_bias else None), None


_geglu_fwd.register_autograd(_geglu_backward, setup_context=_geglu_setup)


# ----------------------------------------------------------------------------- public API

def geglu(x: torch.Tensor, bias: Optional[torch.Tensor] = None, approximate: str = "none"
          ) -> torch.Tensor:
    """``h * gelu(gate)`` for ``h, gate = (x + bias).chunk(2, dim=-1)`` (the GEGLU of SD's
    feed-forward, bias that of the projection before it, or None), read from x in place: x
    (..., 2·D) → (..., D); ``approximate`` as in ``torch.nn.functional.gelu``."""
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    _check_float("x", x)
    if x.dim() == 0 or x.shape[-1] % 2 or x.shape[-1] == 0:
        raise ValueError(f"x needs an even, non-empty last dim (h and gate side by side), got "
                         f"shape {tuple(x.shape)}")
    two_d = x.shape[-1]
    _check_bias(bias, x)
    b = None if bias is None else bias.contiguous()
    y = torch.ops.fasttrain.geglu_fwd(x.reshape(-1, two_d).contiguous(), b, approximate)
    return y.view(*x.shape[:-1], two_d // 2)


def geglu_reference(x: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    approximate: str = "none") -> torch.Tensor:
    """Plain-PyTorch ``geglu``: fp32 internally, output in x's dtype."""
    z = x.float() if bias is None else x.float() + bias.float()
    h, gate = z.chunk(2, dim=-1)
    return (h * F.gelu(gate, approximate=approximate)).to(x.dtype)
