"""Fused residual add + RMSNorm / LayerNorm in Triton, forward and backward.

What is fused
    ``rms_norm(x, weight, eps, residual)`` and ``layer_norm(x, weight, bias, eps, residual)``
    compute ``h = x + residual`` and ``y = norm(h) * weight (+ bias)`` in one pass per row:
    x and residual are read once, h and y written once, and one fp32 statistic per row
    (rstd, plus the mean for LayerNorm) is kept for backward. The backward is one kernel as
    well: it reads dy, the gradient arriving at h (the residual stream), h and the
    statistics, and writes dx (which is also the residual's gradient) plus per-program
    partial sums of dweight/dbias that a final ``torch.sum`` reduces (no atomics).
    Without ``residual`` they are plain RMSNorm / LayerNorm and return only ``y``.

When they help
    In eager mode, where PyTorch runs the add, the norm and their backwards as separate
    kernels that each stream the whole activation through memory. Under ``torch.compile``
    Inductor already fuses norms (and usually the add next to them), so there they matter
    at most for the memory traffic of the residual add; measure before relying on them.

Numerics
    Statistics (mean, variance, rstd) and every reduction are computed in fp32 whatever the
    input dtype (fp32, bf16, fp16). ``y`` and ``h`` come out in x's dtype, and h is rounded
    to that dtype before it is normalized, exactly like ``x + residual`` in PyTorch. weight
    and bias may be fp32 while x is bf16/fp16 (autocast style); their gradients come back
    in their own dtype.

torch.compile
    The kernels are custom ops with ``register_autograd`` backwards, registered through
    ``._triton`` (``triton_op`` on a GPU, so Inductor sees the Triton kernels; an opaque
    ``custom_op`` under the interpreter): no graph break either way.

Inputs may have any leading shape and any last dim D; each program handles one row in the
forward (a block of rows in the backward) over ``BLOCK_D = next_power_of_2(D)`` masked lanes.
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton import launch, op, programs_cap, sum0

__all__ = ["rms_norm", "layer_norm", "rms_norm_reference", "layer_norm_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Tensors2 = tuple[torch.Tensor, torch.Tensor]
Tensors3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- kernels
# Only builtins of triton.language and the reductions of ._triton, not triton.language's
# @triton.jit library (tl.sum, tl.zeros): see ._triton.

@triton.jit
def _rms_fwd_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, D, eps,
                    HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    eps = tl.cast(eps, tl.float32)  # see ._triton: Python floats
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    off = row * D + cols
    h = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(r_ptr + off, mask=mask, other=0.0).to(tl.float32)
        h_low = h.to(h_ptr.dtype.element_ty)  # normalize h as stored, like x + residual
        tl.store(h_ptr + off, h_low, mask=mask)
        h = h_low.to(tl.float32)
    rstd = tl.rsqrt(sum0(h * h) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + off, (h * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_bwd_kernel(dy_ptr, dh_ptr, h_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr,
                    n_rows, D, rows_per_prog,
                    HAS_DH: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.full((BLOCK_D,), 0.0, tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    for row in range(start, end):
        off = row * D + cols
        h = tl.load(h_ptr + off, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = h * rstd
        g = dy * w
        dx = rstd * (g - xhat * (sum0(g * xhat) / D))
        if HAS_DH:
            dx += tl.load(dh_ptr + off, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_ptr + pid * D + cols, dw, mask=mask)


@triton.jit
def _ln_fwd_kernel(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr, D, eps,
                   HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    eps = tl.cast(eps, tl.float32)  # see ._triton: Python floats
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    off = row * D + cols
    h = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(r_ptr + off, mask=mask, other=0.0).to(tl.float32)
        h_low = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + off, h_low, mask=mask)
        h = h_low.to(tl.float32)
    mean = sum0(h) / D
    diff = tl.where(mask, h - mean, 0.0)
    rstd = tl.rsqrt(sum0(diff * diff) / D + eps)
    y = diff * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _ln_bwd_kernel(dy_ptr, dh_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr,
                   n_rows, D, rows_per_prog,
                   HAS_DH: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.full((BLOCK_D,), 0.0, tl.float32)
    db = tl.full((BLOCK_D,), 0.0, tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    for row in range(start, end):
        off = row * D + cols
        h = tl.load(h_ptr + off, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        xhat = tl.where(mask, (h - mean) * rstd, 0.0)
        g = dy * w
        c_xhat = sum0(g * xhat) / D
        c_mean = sum0(g) / D
        dx = rstd * (g - c_mean - xhat * c_xhat)
        if HAS_DH:
            dx += tl.load(dh_ptr + off, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(dw_ptr + pid * D + cols, dw, mask=mask)
    tl.store(db_ptr + pid * D + cols, db, mask=mask)


# ----------------------------------------------------------------------------- launch helpers

def _block_and_warps(d: int) -> tuple[int, int]:
    block = triton.next_power_of_2(d)
    return block, min(max(block // 256, 1), 16)


def _grid_rows(device: torch.device, rows: int) -> tuple[int, int]:
    """(programs, rows per program) for the backward: a few programs per SM, each
    accumulating its dweight/dbias partial over a contiguous block of rows."""
    cap = programs_cap(device)
    per = triton.cdiv(rows, min(rows, cap)) if rows > 0 else 1
    return triton.cdiv(rows, per), per


# ----------------------------------------------------------------------------- custom ops

@op("fasttrain::rms_norm_fwd")
def _rms_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
             eps: float) -> Tensors3:
    rows, d = x.shape
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x.new_empty(0)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    block, warps = _block_and_warps(d)
    if rows > 0:
        launch(_rms_fwd_kernel, (rows,),
                x, x if residual is None else residual, weight, y, y if residual is None else h,
                rstd, d, eps, HAS_RES=residual is not None, BLOCK_D=block, num_warps=warps)
    return y, h, rstd


@op("fasttrain::rms_norm_bwd")
def _rms_bwd(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor,
             weight: torch.Tensor, rstd: torch.Tensor) -> Tensors2:
    rows, d = h.shape
    dx = torch.empty_like(h)
    progs, per = _grid_rows(h.device, rows)
    dw = torch.empty((progs, d), device=h.device, dtype=torch.float32)
    block, warps = _block_and_warps(d)
    if rows > 0:
        launch(_rms_bwd_kernel, (progs,),
                dy, dy if dh is None else dh, h, weight, rstd, dx, dw, rows, d, per,
                HAS_DH=dh is not None, BLOCK_D=block, num_warps=warps)
    return dx, dw.sum(0)


@op("fasttrain::layer_norm_fwd")
def _ln_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
            bias: Optional[torch.Tensor], eps: float) -> Tensors4:
    rows, d = x.shape
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x.new_empty(0)
    mean = torch.empty(rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    block, warps = _block_and_warps(d)
    if rows > 0:
        launch(_ln_fwd_kernel, (rows,),
                x, x if residual is None else residual, weight, weight if bias is None else bias,
                y, y if residual is None else h, mean, rstd, d, eps,
                HAS_RES=residual is not None, HAS_BIAS=bias is not None, BLOCK_D=block,
                num_warps=warps)
    return y, h, mean, rstd


@op("fasttrain::layer_norm_bwd")
def _ln_bwd(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor,
            weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> Tensors3:
    rows, d = h.shape
    dx = torch.empty_like(h)
    progs, per = _grid_rows(h.device, rows)
    dw = torch.empty((progs, d), device=h.device, dtype=torch.float32)
    db = torch.empty((progs, d), device=h.device, dtype=torch.float32)
    block, warps = _block_and_warps(d)
    if rows > 0:
        launch(_ln_bwd_kernel, (progs,),
                dy, dy if dh is None else dh, h, weight, mean, rstd, dx, dw, db, rows, d, per,
                HAS_DH=dh is not None, BLOCK_D=block, num_warps=warps)
    return dx, dw.sum(0), db.sum(0)


def _grads(saved: torch.Tensor, dy: Optional[torch.Tensor], dh: Optional[torch.Tensor],
           has_res: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Contiguous output gradients (autograd may hand in expanded or missing ones)."""
    dy = torch.zeros_like(saved) if dy is None else dy.contiguous()
    return dy, (dh.contiguous() if has_res and dh is not None else None)


def _rms_setup(ctx, inputs, output) -> None:
    x, residual, weight, _eps = inputs
    ctx.has_res = residual is not None
    ctx.save_for_backward(output[1] if ctx.has_res else x, weight, output[2])


def _rms_backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    dy, dh = _grads(h, dy, dh, ctx.has_res)
    dx, dw = torch.ops.fasttrain.rms_norm_bwd(dy, dh, h, weight, rstd)
    return dx, (dx if ctx.has_res else None), dw.to(weight.dtype), None


def _ln_setup(ctx, inputs, output) -> None:
    x, residual, weight, bias, _eps = inputs
    ctx.has_res = residual is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(output[1] if ctx.has_res else x, weight, output[2], output[3])


def _ln_backward(ctx, dy, dh, _dmean, _drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    dy, dh = _grads(h, dy, dh, ctx.has_res)
    dx, dw, db = torch.ops.fasttrain.layer_norm_bwd(dy, dh, h, weight, mean, rstd)
    db = None if ctx.bias_dtype is None else db.to(ctx.bias_dtype)
    return dx, (dx if ctx.has_res else None), dw.to(weight.dtype), db, None


_rms_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)
_ln_fwd.register_autograd(_ln_backward, setup_context=_ln_setup)


# ----------------------------------------------------------------------------- public API

def _check(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           residual: Optional[torch.Tensor]) -> int:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x needs a non-empty last dim, got shape {tuple(x.shape)}")
    d = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.shape != (d,):
            raise ValueError(f"{name} shape {tuple(p.shape)} does not match x's last dim ({d})")
        if p.dtype not in _DTYPES or p.device != x.device:
            raise ValueError(f"{name} must be a float tensor on {x.device}, "
                             f"got {p.dtype} on {p.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}, {x.device}), got "
                         f"({tuple(residual.shape)}, {residual.dtype}, {residual.device})")
    return d


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    return t.reshape(-1, d).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x / sqrt(mean(x**2, -1) + eps) * weight``; with ``residual``, ``h = x + residual``
    is normalized instead and ``(y, h)`` returned."""
    d = _check(x, weight, None, residual)
    res = None if residual is None else _rows(residual, d)
    y, h, _ = torch.ops.fasttrain.rms_norm_fwd(_rows(x, d), res, weight.contiguous(), float(eps))
    return y.view(x.shape) if residual is None else (y.view(x.shape), h.view(x.shape))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               residual: Optional[torch.Tensor] = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim with affine ``weight`` (and ``bias``, may be None); with
    ``residual``, ``h = x + residual`` is normalized instead and ``(y, h)`` returned."""
    d = _check(x, weight, bias, residual)
    res = None if residual is None else _rows(residual, d)
    b = None if bias is None else bias.contiguous()
    y, h, _, _ = torch.ops.fasttrain.layer_norm_fwd(_rows(x, d), res, weight.contiguous(), b,
                                                    float(eps))
    return y.view(x.shape) if residual is None else (y.view(x.shape), h.view(x.shape))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: Optional[torch.Tensor] = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch ``rms_norm``: fp32 internally, output in x's dtype."""
    h = x if residual is None else x + residual
    y = F.rms_norm(h.float(), (h.shape[-1],), weight.float(), eps).to(x.dtype)
    return y if residual is None else (y, h)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         eps: float, residual: Optional[torch.Tensor] = None
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch ``layer_norm``: fp32 internally, output in x's dtype."""
    h = x if residual is None else x + residual
    b = None if bias is None else bias.float()
    y = F.layer_norm(h.float(), (h.shape[-1],), weight.float(), b, eps).to(x.dtype)
    return y if residual is None else (y, h)
