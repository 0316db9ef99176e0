"""GEGLU in Triton, forward and backward: ``h · gelu(gate)`` of the two halves of one
projection's output (the feed-forward of SD's UNet transformer blocks).

What is fused
    ``geglu(x)`` reads x (..., 2·D) in place, h and gate side by side on its last dim, and
    writes (..., D); no chunked view is copied. The backward reads x and dy once, computes GELU
    and its derivative once per (h, gate) pair and writes both halves of dx. Inductor's own
    backward of ``h * gelu(gate)`` computed GELU's derivative for each element of the
    concatenated gradient: 0.30 ms a call at SD's 64 × 64 latents, about 2.5× its traffic at the
    copy ceiling (profile-sd-base-20261122-035033); these kernels take 0.196 ms forward +
    backward (kernels-micro-geglu-20261122-0652).

Numerics
    fp32 math, as ``kernels.activations`` (whose exact and tanh GELU this shares); the output
    is rounded once to x's dtype.

Layout
    x is viewed as (rows, 2·D); 2-D tiles of the (rows, D) output (``GEGLU``), rows and columns
    masked.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton import launch, op
from .activations import _APPROXIMATE, _check_float, _gelu_and_grad

__all__ = ["GEGLU", "geglu", "geglu_reference"]


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _geglu_tile(n_rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile (program_id(0), program_id(1)) of the (rows, D) output: offsets of h in the (rows,
    2·D) input (gate at + D), of the output, and the mask."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    return rows[:, None] * (2 * D) + cols[None, :], rows[:, None] * D + cols[None, :], mask


@triton.jit
def _geglu_fwd_kernel(x_ptr, y_ptr, n_rows, D, TANH: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    xo, yo, mask = _geglu_tile(n_rows, D, BLOCK_R, BLOCK_D)
    h = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(x_ptr + xo + D, mask=mask, other=0.0).to(tl.float32)
    act, _ = _gelu_and_grad(g, TANH)
    tl.store(y_ptr + yo, (h * act).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _geglu_bwd_kernel(dy_ptr, x_ptr, dx_ptr, n_rows, D, TANH: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    xo, yo, mask = _geglu_tile(n_rows, D, BLOCK_R, BLOCK_D)
    h = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(x_ptr + xo + D, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + yo, mask=mask, other=0.0).to(tl.float32)
    act, grad = _gelu_and_grad(g, TANH)
    tl.store(dx_ptr + xo, (dy * act).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + xo + D, (dy * h * grad).to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launch helpers

# geglu: tiles of 4,096 outputs, the widest power of two up to 1,024 columns that divides D
# (SD's 1,280, 2,560 and 5,120: 256, 512, 1,024; no masked columns), or, where that is under
# 128, D's next power of two up to 1,024 with the last column block masked; 4 warps as
# bias_gelu's forward
GEGLU = {"elements": 4096, "max_block_d": 1024, "warps": 4}


def _geglu_grid(rows: int, d: int) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_R, BLOCK_D) of the geglu kernels over a (rows, d) output."""
    block_d = GEGLU["max_block_d"]
    while block_d > 1 and d % block_d:
        block_d //= 2
    if block_d < 128:
        block_d = min(GEGLU["max_block_d"], triton.next_power_of_2(d))
    block_r = max(1, GEGLU["elements"] // block_d)
    return (triton.cdiv(rows, block_r), triton.cdiv(d, block_d)), block_r, block_d


# ----------------------------------------------------------------------------- custom ops

@op("fasttrain::geglu_fwd")
def _geglu_fwd(x: torch.Tensor, approximate: str) -> torch.Tensor:
    rows, d = x.shape[0], x.shape[1] // 2
    y = x.new_empty((rows, d))
    if rows > 0:
        grid, block_r, block_d = _geglu_grid(rows, d)
        launch(_geglu_fwd_kernel, grid, x, y, rows, d, TANH=approximate == "tanh",
               BLOCK_R=block_r, BLOCK_D=block_d, num_warps=GEGLU["warps"])
    return y


@op("fasttrain::geglu_bwd")
def _geglu_bwd(dy: torch.Tensor, x: torch.Tensor, approximate: str) -> torch.Tensor:
    rows, d = dy.shape
    dx = torch.empty_like(x)
    if rows > 0:
        grid, block_r, block_d = _geglu_grid(rows, d)
        launch(_geglu_bwd_kernel, grid, dy, x, dx, rows, d, TANH=approximate == "tanh",
               BLOCK_R=block_r, BLOCK_D=block_d, num_warps=GEGLU["warps"])
    return dx


def _geglu_setup(ctx, inputs, output) -> None:
    ctx.approximate = inputs[1]
    ctx.save_for_backward(inputs[0])


def _geglu_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    dy = x.new_zeros((x.shape[0], x.shape[1] // 2)) if dy is None else dy.contiguous()
    return torch.ops.fasttrain.geglu_bwd(dy, x, ctx.approximate), None


_geglu_fwd.register_autograd(_geglu_backward, setup_context=_geglu_setup)


# ----------------------------------------------------------------------------- public API

def geglu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``h * gelu(gate)`` for ``h, gate = x.chunk(2, dim=-1)`` (the GEGLU of SD's
    feed-forward), read from x in place: x (..., 2·D) → (..., D); ``approximate`` as in
    ``torch.nn.functional.gelu``."""
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    _check_float("x", x)
    if x.dim() == 0 or x.shape[-1] % 2 or x.shape[-1] == 0:
        raise ValueError(f"x needs an even, non-empty last dim (h and gate side by side), got "
                         f"shape {tuple(x.shape)}")
    two_d = x.shape[-1]
    y = torch.ops.fasttrain.geglu_fwd(x.reshape(-1, two_d).contiguous(), approximate)
    return y.view(*x.shape[:-1], two_d // 2)


def geglu_reference(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Plain-PyTorch ``geglu``: fp32 internally, output in x's dtype."""
    h, gate = x.float().chunk(2, dim=-1)
    return (h * F.gelu(gate, approximate=approximate)).to(x.dtype)
