"""Fused residual add + RMSNorm / LayerNorm in Triton, forward and backward.

What is fused
    ``rms_norm(x, weight, eps, residual)`` and ``layer_norm(x, weight, bias, eps, residual)``
    compute ``h = x + residual`` and ``y = norm(h) * weight (+ bias)`` in one pass, keeping
    fp32 rstd (and mean) per row. The backward is one kernel: it reads dy, the gradient at h
    (the residual stream), h and the statistics, and writes dx (also the residual's gradient)
    and per-program partials of dweight/dbias that one ``torch.sum`` reduces (no atomics).
    x's gradient in x's dtype, where that is not the stream's, is a second store of that pass.
    Without ``residual`` they are plain RMSNorm / LayerNorm and return only ``y``.
    ``layer_norm(..., residual, x_bias=b)`` also takes the bias of the linear layer that made
    x, left out of its matmul: ``h = x + b + residual``, and the backward sums dx over the rows
    for b's gradient in the same pass (a pre-norm block's attention-projection and fc2 biases:
    no separate bias-gradient reduction over the activations).

When they help
    Eager: 3-3.5× PyTorch's separate kernels (kernels-micro-norms-20261121-1352); compiled: see
    benchmarks/reports/2026-11-21-to-26-results-log.md. Mixed dtypes as autocast runs pre-norm
    blocks (bf16 branch, fp32 stream).

Numerics
    Statistics and reductions in fp32 whatever the input dtype (fp32, bf16, fp16). ``h`` comes
    out in the wider of x's and residual's dtypes, rounded before it is normalized, exactly like
    ``x + residual``; ``y`` in ``out_dtype`` (default x's); weight and bias may be fp32 with a
    bf16/fp16 x. Every gradient comes back in its input's dtype.

torch.compile: custom ops with ``register_autograd`` backwards, through ``._triton``.

Any leading shape and last dim D. Tiles of whole rows (``BLOCK_D = next_power_of_2(D)`` masked
lanes): one tile a program forward; backward a few persistent programs an SM, each walking a
strided set of tiles with its weight-gradient partials in registers until its last tile.
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton import add, launch, op, output_grad, programs_cap, rounded, sum0

__all__ = ["rms_norm", "layer_norm", "rms_norm_reference", "layer_norm_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Tensors3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# Tile elements (whole rows, at most max_rows), warps, persistent backward programs an SM and
# tiles loaded ahead (H200: launch-tune-20261121-1633; 8 warps when x's bf16 gradient is stored
# too, ln-bwd-tune-20261125-0316). A 16-bit stream (h; x without a residual) takes the ``_16``
# values, the backward's only where D is not a power of two (ln-stream-tune-20261125-0731).
LAUNCH = {"fwd_elements": 8192, "bwd_elements": 4096, "max_rows": 64, "fwd_warps": 8,
          "bwd_warps": 4, "bwd_copy_warps": 8, "programs_per_sm": 1, "bwd_stages": 3,
          "fwd_elements_16": 4096, "fwd_warps_16": 4, "programs_per_sm_16": 2}


# ----------------------------------------------------------------------------- kernels
# Only builtins of triton.language and the reductions of ._triton, not triton.language's
# @triton.jit library (tl.sum, tl.zeros): see ._triton.

@triton.jit
def _fwd_kernel(x_ptr, xb_ptr, r_ptr, w_ptr, b_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr, n_rows, D,
                eps, RMS: tl.constexpr, HAS_XB: tl.constexpr, HAS_RES: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """One tile of BLOCK_M rows × BLOCK_D columns: rows are contiguous, so each row's loads
    and stores are whole memory transactions, and the tile keeps many rows in flight."""
    eps = tl.cast(eps, tl.float32)  # see ._triton: Python floats
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    off = rows[:, None] * D + cols[None, :]
    h = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_XB:  # the bias x's linear layer left out (only with a residual)
        h += tl.load(xb_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        h += tl.load(r_ptr + off, mask=mask, other=0.0).to(tl.float32)
        h_low = h.to(h_ptr.dtype.element_ty)  # normalize h as stored, like x + residual
        tl.store(h_ptr + off, h_low, mask=mask)
        h = h_low.to(tl.float32)
    if RMS:
        diff = h
    else:
        mean = tl.reduce(h, 1, add) / D
        diff = tl.where(mask, h - mean[:, None], 0.0)
        tl.store(mean_ptr + rows, mean, mask=rmask)
    rstd = tl.rsqrt(tl.reduce(diff * diff, 1, add) / D + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = diff * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _bwd_kernel(dy_ptr, dh_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dx2_ptr, parts_ptr,
                n_rows, D, RMS: tl.constexpr, HAS_DH: tl.constexpr, HAS_XB: tl.constexpr,
                HAS_DX2: tl.constexpr, K: tl.constexpr, STAGES: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Persistent: program p walks row tiles p, p + programs, … (neighbours run side by
    side), writes dx for each (HAS_DX2: a second time, rounded from the same fp32 values to
    dx2's dtype, x's) and sums dy·x̂ (and dy, and dx for x's bias) over all of them in register
    tiles, which it reduces to its rows of partials (programs, K, D) at the end: weight, then
    LayerNorm's bias, then x's bias (K rows)."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    db = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    dxb = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    for tile in tl.range(pid, tl.cdiv(n_rows, BLOCK_M), progs, num_stages=STAGES):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # row count < 2³¹
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        off = rows[:, None] * D + cols[None, :]
        h = tl.load(h_ptr + off, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        if RMS:
            xhat = h * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
            xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        dx = g - xhat * (tl.reduce(g * xhat, 1, add) / D)[:, None]
        if not RMS:
            dx -= (tl.reduce(g, 1, add) / D)[:, None]
            db += dy
        dx *= rstd[:, None]
        if HAS_DH:
            dx += tl.load(dh_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if HAS_XB:
            dxb += dx  # masked lanes are 0: dy, dh and x̂ load as 0 there
        tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DX2:  # x's gradient, as dx.to(x's dtype) would round it (dx is fp32 there)
            tl.store(dx2_ptr + off, rounded(dx, dx2_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    part = parts_ptr + pid * K * D + cols
    tl.store(part, sum0(dw), mask=cmask)
    if not RMS:
        tl.store(part + D, sum0(db), mask=cmask)
    if HAS_XB:
        tl.store(part + (K - 1) * D, sum0(dxb), mask=cmask)


# ----------------------------------------------------------------------------- launch helpers

def _setting(key: str, stream: torch.dtype) -> int:
    """LAUNCH[key], or its ``_16`` value where the stream's dtype is 16 bits."""
    return LAUNCH.get(f"{key}_16", LAUNCH[key]) if stream.itemsize == 2 else LAUNCH[key]


def _tile(d: int, elements: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_D): whole rows, as many as make about ``elements`` per tile."""
    block_d = triton.next_power_of_2(d)
    return max(1, min(LAUNCH["max_rows"], elements // block_d)), block_d


_PIPELINE_BYTES = 160 * 1024  # shared memory the pipelined loads may take (H100/H200: 227 KiB)


def _stages(tile_bytes: int) -> int:
    """Pipeline stages of the backward: LAUNCH's, fewer where that many tiles of loads would not
    fit in shared memory (a tile holds at least one whole row: 80 KiB a stage at D = 8,192 with
    an fp32 residual), at least 1 (no pipelining, no shared memory)."""
    return max(1, min(LAUNCH["bwd_stages"], _PIPELINE_BYTES // max(1, tile_bytes)))


def _warps(block_m: int, block_d: int, per_tile: int) -> int:
    return max(1, min(16, per_tile, block_m * block_d // 256))


def _fwd(x: torch.Tensor, x_bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
         weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, rms: bool,
         out_dtype: Optional[torch.dtype]) -> Tensors4:
    rows, d = x.shape
    y = torch.empty_like(x, dtype=out_dtype or x.dtype)
    h = x.new_empty(0) if residual is None else \
        torch.empty_like(x, dtype=torch.promote_types(x.dtype, residual.dtype))
    mean = torch.empty(0 if rms else rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    if rows > 0:
        stream = x.dtype if residual is None else h.dtype
        block_m, block_d = _tile(d, _setting("fwd_elements", stream))
        launch(_fwd_kernel, (triton.cdiv(rows, block_m),),
               x, weight if x_bias is None else x_bias, x if residual is None else residual,
               weight, weight if bias is None else bias,
               y, y if residual is None else h, rstd if rms else mean, rstd, rows, d, eps,
               RMS=rms, HAS_XB=x_bias is not None, HAS_RES=residual is not None,
               HAS_BIAS=bias is not None,
               BLOCK_M=block_m, BLOCK_D=block_d,
               num_warps=_warps(block_m, block_d, _setting("fwd_warps", stream)))
    return y, h, mean, rstd


def _bwd(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor, weight: torch.Tensor,
         mean: torch.Tensor, rstd: torch.Tensor, rms: bool, x_bias: bool = False,
         x_dtype: Optional[torch.dtype] = None) -> Tensors3:
    """dx, dx again in ``x_dtype`` where that differs from h's (x's gradient; else empty), and
    the parameter gradients as rows of one (K, D) fp32 tensor (one reduction launch for all):
    dweight, (LayerNorm only) dbias, (with ``x_bias``) the sum of dx."""
    rows, d = h.shape
    dx = torch.empty_like(h)
    has_dx2 = x_dtype not in (None, h.dtype)
    dx2 = torch.empty_like(h, dtype=x_dtype) if has_dx2 else h.new_empty(0)
    block_m, block_d = _tile(d, LAUNCH["bwd_elements"])
    loaded = h.element_size() + dy.element_size() + (0 if dh is None else dh.element_size())
    per_sm = _setting("programs_per_sm", h.dtype) if d & (d - 1) else LAUNCH["programs_per_sm"]
    progs = max(1, min(triton.cdiv(rows, block_m), programs_cap(h.device, per_sm)))
    k = (1 if rms else 2) + x_bias
    alloc = torch.empty if rows else torch.zeros  # every program writes its rows of partials
    parts = alloc((progs, k, d), device=h.device, dtype=torch.float32)
    if rows > 0:
        launch(_bwd_kernel, (progs,),
               dy, dy if dh is None else dh, h, weight, rstd if rms else mean, rstd, dx,
               dx2 if has_dx2 else dx, parts, rows, d, RMS=rms, HAS_DH=dh is not None,
               HAS_XB=x_bias, HAS_DX2=has_dx2, K=k,
               STAGES=_stages(block_m * block_d * loaded), BLOCK_M=block_m, BLOCK_D=block_d,
               num_warps=_warps(block_m, block_d,
                                LAUNCH["bwd_copy_warps" if has_dx2 else "bwd_warps"]))
    return dx, dx2, parts.sum(0)


# ----------------------------------------------------------------------------- custom ops

@op("fasttrain::rms_norm_fwd")
def _rms_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
             eps: float, out_dtype: Optional[torch.dtype]) -> Tensors3:
    y, h, _, rstd = _fwd(x, None, residual, weight, None, eps, True, out_dtype)
    return y, h, rstd


@op("fasttrain::rms_norm_bwd")
def _rms_bwd(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor,
             weight: torch.Tensor, rstd: torch.Tensor,
             x_dtype: Optional[torch.dtype] = None) -> Tensors3:
    dx, dx2, dw = _bwd(dy, dh, h, weight, rstd, rstd, rms=True, x_dtype=x_dtype)
    return dx, dx2, dw.view(-1)


@op("fasttrain::layer_norm_fwd")
def _ln_fwd(x: torch.Tensor, x_bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
            weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
            out_dtype: Optional[torch.dtype]) -> Tensors4:
    return _fwd(x, x_bias, residual, weight, bias, eps, False, out_dtype)


@op("fasttrain::layer_norm_bwd")
def _ln_bwd(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor,
            weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
            x_bias: bool, x_dtype: Optional[torch.dtype] = None) -> Tensors3:
    """dx, its copy in ``x_dtype`` (see ``_bwd``), (K, D) weight, bias and x's bias grads."""
    return _bwd(dy, dh, h, weight, mean, rstd, rms=False, x_bias=x_bias, x_dtype=x_dtype)


def _stream_grad(ctx, dh: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The gradient arriving at h from the residual stream (None: only y carries one)."""
    return dh.contiguous() if ctx.has_res and dh is not None else None


def _input_grads(ctx, dx: torch.Tensor, dx2: torch.Tensor
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """dx as x's and the residual's gradients, each in its own dtype (x's: ``dx2``, if any)."""
    dx_x = dx if ctx.x_dtype == dx.dtype else dx2
    return dx_x, (dx.to(ctx.res_dtype) if ctx.has_res else None)


def _save_dtypes(ctx, x: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    ctx.has_res, ctx.x_dtype = residual is not None, x.dtype
    ctx.res_dtype = None if residual is None else residual.dtype


def _rms_setup(ctx, inputs, output) -> None:
    x, residual, weight, _eps, _out_dtype = inputs
    _save_dtypes(ctx, x, residual)
    ctx.save_for_backward(output[1] if ctx.has_res else x, weight, output[2])


def _rms_backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    dx, dx2, dw = torch.ops.fasttrain.rms_norm_bwd(output_grad(h, dy), _stream_grad(ctx, dh),
                                                   h, weight, rstd, ctx.x_dtype)
    return *_input_grads(ctx, dx, dx2), dw.to(weight.dtype), None, None


def _ln_setup(ctx, inputs, output) -> None:
    x, x_bias, residual, weight, bias, _eps, _out_dtype = inputs
    _save_dtypes(ctx, x, residual)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.x_bias_dtype = None if x_bias is None else x_bias.dtype
    ctx.save_for_backward(output[1] if ctx.has_res else x, weight, output[2], output[3])


def _ln_backward(ctx, dy, dh, _dmean, _drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    has_xb = ctx.x_bias_dtype is not None
    dx, dx2, sums = torch.ops.fasttrain.layer_norm_bwd(
        output_grad(h, dy), _stream_grad(ctx, dh), h, weight, mean, rstd, has_xb, ctx.x_dtype)
    db = None if ctx.bias_dtype is None else sums[1].to(ctx.bias_dtype)
    dxb = sums[2].to(ctx.x_bias_dtype) if has_xb else None
    dx, dres = _input_grads(ctx, dx, dx2)
    return dx, dxb, dres, sums[0].to(weight.dtype), db, None, None


_rms_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)
_ln_fwd.register_autograd(_ln_backward, setup_context=_ln_setup)


# ----------------------------------------------------------------------------- public API

def _check(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           residual: Optional[torch.Tensor], out_dtype: Optional[torch.dtype],
           x_bias: Optional[torch.Tensor] = None) -> int:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x needs a non-empty last dim, got shape {tuple(x.shape)}")
    d = x.shape[-1]
    if x_bias is not None and residual is None:
        raise ValueError("x_bias (the bias of x's linear layer) needs a residual to add x to")
    for name, p in (("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        if p is None:
            continue
        if p.shape != (d,):
            raise ValueError(f"{name} shape {tuple(p.shape)} does not match x's last dim ({d})")
        if p.dtype not in _DTYPES or p.device != x.device:
            raise ValueError(f"{name} must be a float tensor on {x.device}, "
                             f"got {p.dtype} on {p.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype not in _DTYPES
                                 or residual.device != x.device):
        raise ValueError(f"residual must be a float tensor shaped like x ({tuple(x.shape)} on "
                         f"{x.device}), got ({tuple(residual.shape)}, {residual.dtype}, "
                         f"{residual.device})")
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    return d


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    return t.reshape(-1, d).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x / sqrt(mean(x**2, -1) + eps) * weight``; with ``residual``, ``h = x + residual``
    (in the wider of their dtypes) is normalized instead and ``(y, h)`` returned. ``y`` comes
    out in ``out_dtype`` (default x's: under autocast, the dtype the next matmul takes)."""
    d = _check(x, weight, None, residual, out_dtype)
    res = None if residual is None else _rows(residual, d)
    y, h, _ = torch.ops.fasttrain.rms_norm_fwd(_rows(x, d), res, weight.contiguous(), float(eps),
                                               out_dtype)
    return y.view(x.shape) if residual is None else (y.view(x.shape), h.view(x.shape))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
               x_bias: Optional[torch.Tensor] = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim with affine ``weight`` (and ``bias``, may be None); with
    ``residual``, ``h = x + residual`` (in the wider of their dtypes) is normalized instead and
    ``(y, h)`` returned. ``y`` comes out in ``out_dtype`` (default x's). ``x_bias`` (needs
    ``residual``): the bias of the linear layer that produced x, left out of its matmul and
    added here, ``h = x + x_bias + residual`` summed in fp32; its gradient (the sum of h's over
    the rows) comes out of the backward's one pass instead of a reduction of its own."""
    d = _check(x, weight, bias, residual, out_dtype, x_bias)
    res = None if residual is None else _rows(residual, d)
    b = None if bias is None else bias.contiguous()
    xb = None if x_bias is None else x_bias.contiguous()
    y, h, _, _ = torch.ops.fasttrain.layer_norm_fwd(_rows(x, d), xb, res, weight.contiguous(), b,
                                                    float(eps), out_dtype)
    return y.view(x.shape) if residual is None else (y.view(x.shape), h.view(x.shape))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: Optional[torch.Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch ``rms_norm``: fp32 internally, output in x's dtype."""
    h = x if residual is None else x + residual
    y = F.rms_norm(h.float(), (h.shape[-1],), weight.float(), eps).to(out_dtype or x.dtype)
    return y if residual is None else (y, h)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         eps: float, residual: Optional[torch.Tensor] = None,
                         out_dtype: Optional[torch.dtype] = None,
                         x_bias: Optional[torch.Tensor] = None
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch ``layer_norm``: fp32 internally, output in x's dtype."""
    if x_bias is not None:  # h = x + x_bias + residual in fp32, stored like x + residual
        h = (x.float() + x_bias.float() + residual.float()).to(
            torch.promote_types(x.dtype, residual.dtype))
    else:
        h = x if residual is None else x + residual
    b = None if bias is None else bias.float()
    y = F.layer_norm(h.float(), (h.shape[-1],), weight.float(), b, eps).to(out_dtype or x.dtype)
    return y if residual is None else (y, h)
