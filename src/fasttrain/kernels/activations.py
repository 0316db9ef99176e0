"""Fused bias + GELU and SwiGLU in Triton, forward and backward.

What is fused
    ``bias_gelu(x, bias, approximate)`` computes ``y = gelu(x + bias)`` (the activation after
    a linear layer whose bias was left out of the matmul) in one pass: x and bias are read
    once and y written once; ``x + bias`` is never stored. The backward is one kernel as
    well: it reads dy and x, recomputes ``x + bias``, writes dx and per-program fp32 partial
    column sums of dx (the bias gradient) that a final ``torch.sum`` reduces (no atomics).
    ``swiglu(gate, up)`` computes ``silu(gate) * up`` (Llama's MLP) in one kernel, and its
    backward writes dgate and dup in one kernel that reads dy, gate and up.

When they help
    In eager mode, where PyTorch runs the bias add, the activation, the product and their
    backwards as separate kernels that each stream the whole activation through memory (and,
    for SwiGLU, keeps ``silu(gate)`` alive for backward besides gate and up). Under
    ``torch.compile`` Inductor already fuses these pointwise ops, so there they bring at most
    a different choice of what is saved for backward; measure before relying on them.

Numerics
    All math is in fp32 whatever the input dtype (fp32, bf16, fp16); outputs and gradients
    come out in the inputs' dtypes. ``x + bias`` is *not* rounded to x's dtype before the
    GELU (as ``gelu(x.float() + bias.float())``, which is what PyTorch computes for bf16 x and
    an fp32 bias, but one rounding fewer than bf16 x + bf16 bias in PyTorch). bias may be
    fp32 while x is bf16/fp16 (autocast style); its gradient is summed in fp32 from the
    unrounded dx and comes back in bias's own dtype. ``approximate="none"`` uses erf;
    ``"tanh"`` uses ``0.5·z·(1 + tanh(u)) = z·sigmoid(2u)``, and every sigmoid here is taken
    as ``1/(1+e)`` or ``e/(1+e)`` with ``e = exp(-|a|) ≤ 1``, so nothing overflows; ``1 - s``
    is the other of the two quotients rather than a subtraction, so the gradients keep their
    precision where s ≈ 1 (in fp32 they are closer to the exact values than PyTorch's own
    tanh-GELU and SiLU backwards, which differ from them by up to a few 1e-6).

torch.compile
    As in ``fasttrain.kernels.norms``: ``triton_op``s with ``register_autograd`` backwards on
    a GPU (traced without a graph break, Inductor sees the kernels), opaque ``custom_op``s
    under ``TRITON_INTERPRET=1``.

Layout
    bias_gelu: x may have any leading shape and any last dim D; it is viewed as (rows, D) and
    made contiguous if it is not. Programs cover 2-D tiles of ``BLOCK_R`` rows x ``BLOCK_D``
    columns (sizes from ``LAUNCH``) so the bias is loaded once per tile; in the backward each
    program walks a contiguous range of row tiles for one column block, accumulating its bias
    partial, with the next tiles' loads in flight (software pipelining, ``LAUNCH["stages"]``);
    the forward's programs walk row tiles the same way.
    swiglu: gate and up must have the same shape, dtype and device (any shape); non-contiguous
    views (e.g. ``chunk`` of a fused gate/up projection) are copied to contiguous first, and the
    kernels run over the flattened elements.
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton import launch, op, output_grad, programs_cap, sum0

__all__ = ["LAUNCH", "bias_gelu", "swiglu", "bias_gelu_reference", "swiglu_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_APPROXIMATE = ("none", "tanh")
Tensors2 = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- kernels
# Only builtins of triton.language (tl.math.erf and tl.exp are builtins), not its @triton.jit
# library (tl.sum, tl.sigmoid, tl.zeros): see fasttrain.kernels._triton.

_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1/sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1/sqrt(2*pi)
_SQRT_2_PI = tl.constexpr(0.7978845608028654)  # sqrt(2/pi)
_TANH_C = tl.constexpr(0.044715)  # tanh-GELU's cubic coefficient


@triton.jit
def _sigmoid(a):
    """(sigmoid(a), 1 - sigmoid(a)), both without overflow (exp only of -|a|) and without
    the cancellation of computing 1 - s from s."""
    e = tl.exp(-tl.abs(a))
    r = 1.0 / (1.0 + e)
    pos = a >= 0
    return tl.where(pos, r, e * r), tl.where(pos, e * r, r)


@triton.jit
def _gelu_and_grad(z, TANH: tl.constexpr):
    """(gelu(z), d gelu / dz) in fp32."""
    if TANH:
        inner = _SQRT_2_PI * (z + _TANH_C * z * z * z)
        s, one_minus_s = _sigmoid(2.0 * inner)  # s = 0.5 * (1 + tanh(inner))
        d_inner = _SQRT_2_PI * (1.0 + 3.0 * _TANH_C * z * z)
        return z * s, s + 2.0 * z * s * one_minus_s * d_inner
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(z * _SQRT1_2))
        pdf = tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
        return z * cdf, cdf + z * pdf


# Store addresses come from pointer-free helpers (``_columns``, ``_rows``): Inductor's analysis
# of which inputs a user Triton kernel writes follows a store's address back through every
# argument of a helper that returned it, so offsets returned by a helper that also took x_ptr
# marked x as written, and Inductor copied the saved x before every backward launch (a whole
# extra read and write of fc1's output: 0.9 ms of a Swin-B step, profile-swin-base-20261121-233750).
# tests/test_kernel_writes.py runs that analysis on every kernel here.

@triton.jit
def _columns(D, BLOCK_D: tl.constexpr):
    """Column block ``program_id(1)``: its columns and their mask."""
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    return cols, cols < D


@triton.jit
def _bias_row(b_ptr, cols, cmask, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The fp32 bias row of ``cols`` (0 without a bias)."""
    if HAS_BIAS:
        return tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    else:
        return tl.full((1, BLOCK_D), 0.0, tl.float32)


@triton.jit
def _rows(r0, end, cols, cmask, D, BLOCK_R: tl.constexpr):
    """Offsets and mask of rows r0 … r0 + BLOCK_R (below ``end``) of ``cols``."""
    rows = r0 + tl.arange(0, BLOCK_R)
    return rows[:, None] * D + cols[None, :], (rows[:, None] < end) & cmask[None, :]


@triton.jit
def _bias_gelu_fwd_kernel(x_ptr, b_ptr, y_ptr, n_rows, D, rows_per_prog,
                          HAS_BIAS: tl.constexpr, TANH: tl.constexpr, STAGES: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (p, c) walks the row tiles of rows p·rows_per_prog … (p + 1)·rows_per_prog of
    column block c; with STAGES > 1 the next tiles' loads are in flight during the math."""
    cols, cmask = _columns(D, BLOCK_D)
    b = _bias_row(b_ptr, cols, cmask, HAS_BIAS, BLOCK_D)
    start = tl.program_id(0).to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    for r0 in tl.range(start, end, BLOCK_R, num_stages=STAGES):
        off, mask = _rows(r0, end, cols, cmask, D, BLOCK_R)
        z = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32) + b
        y, _ = _gelu_and_grad(z, TANH)
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(dy_ptr, x_ptr, b_ptr, dx_ptr, db_ptr, n_rows, D, rows_per_prog,
                          HAS_BIAS: tl.constexpr, TANH: tl.constexpr, STAGES: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols, cmask = _columns(D, BLOCK_D)
    b = _bias_row(b_ptr, cols, cmask, HAS_BIAS, BLOCK_D)
    db = tl.full((BLOCK_R, BLOCK_D), 0.0, tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    for r0 in tl.range(start, end, BLOCK_R, num_stages=STAGES):
        off, mask = _rows(r0, end, cols, cmask, D, BLOCK_R)
        z = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32) + b
        dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
        _, grad = _gelu_and_grad(z, TANH)
        dz = dy * grad  # 0 where masked (dy = 0, grad finite)
        tl.store(dx_ptr + off, dz.to(dx_ptr.dtype.element_ty), mask=mask)
        db += dz
    if HAS_BIAS:
        tl.store(db_ptr + pid * D + cols, sum0(db), mask=cmask)


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + off, mask=mask, other=0.0).to(tl.float32)
    s, _ = _sigmoid(g)
    tl.store(y_ptr + off, (g * s * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    dy = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + off, mask=mask, other=0.0).to(tl.float32)
    s, one_minus_s = _sigmoid(g)
    # d silu / dg = s + g * s * (1 - s)
    tl.store(dg_ptr + off, (dy * u * s * (1.0 + g * one_minus_s)).to(dg_ptr.dtype.element_ty),
             mask=mask)
    tl.store(du_ptr + off, (dy * g * s).to(du_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launch helpers

_TILE = 4096  # elements per program of swiglu
_WARPS = 8  # 16 elements per thread: two 16-byte loads per tensor in bf16

# bias_gelu launch settings, from benchmarks/kernels/gelu_tune.py on an H200 (gelu-tune-20261121-1629,
# fc1 of Swin-B's stages and ViT-B): tiles of ``*_elements`` elements, at most ``*_block_d``
# columns wide. The forward is bound by GELU's arithmetic (without it the same loads and stores
# run at the copy ceiling); narrow tiles with 4 warps measured 3-5% faster there than 8 warps
# over 1,024 columns. The backward is a few persistent programs per SM walking row tiles;
# software-pipelining their loads (``stages``) at 2 programs per SM with 4 warps made it 27-40%
# faster than 4 programs of 8 warps without (of which only 2 fit an SM at 100 registers a
# thread). Forward + backward together: 14-19% faster than before at every one of these shapes
# (launch-tune-20261121-1633). The forward, persistent the same way (4 programs per SM over
# tiles of 4 rows x 1,024 columns, loads 3 stages ahead), took forward + backward another 1-4%
# at Swin-B's stages 1-3 and 4% at ViT-B (stage 4: 4% slower, 2 of Swin's 24 blocks;
# launch-tune-20261121-2123); 0 programs per SM: one tile a program.
LAUNCH = {"fwd_elements": 4096, "fwd_block_d": 1024, "fwd_warps": 4,
          "fwd_programs_per_sm": 4, "fwd_stages": 3,
          "bwd_elements": 4096, "bwd_block_d": 512, "bwd_warps": 4,
          "programs_per_sm": 2, "stages": 3}


def _tile(d: int, elements: int, max_block_d: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D) of a bias_gelu tile: up to ``max_block_d`` columns, ``elements`` in
    all (both powers of two, as Triton's tiles are)."""
    for name, value in (("elements", elements), ("block_d", max_block_d)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"bias_gelu LAUNCH {name} must be a power of two, got {value}")
    block_d = min(triton.next_power_of_2(d), max_block_d, elements)
    return max(1, elements // block_d), block_d


def _grid_persistent(device: torch.device, rows: int, d: int, block_r: int, block_d: int,
                     per_sm: int) -> tuple[int, int, int]:
    """(row programs, column blocks, rows per program): ``per_sm`` programs per SM in all,
    each walking a contiguous range of whole row tiles; 0 programs per SM: one row tile each."""
    col_blocks = triton.cdiv(d, block_d)
    if per_sm == 0:
        return triton.cdiv(rows, block_r), col_blocks, block_r
    target = max(1, programs_cap(device, per_sm) // col_blocks)
    per = max(1, triton.cdiv(triton.cdiv(rows, target), block_r)) * block_r  # no rows: none
    return triton.cdiv(rows, per), col_blocks, per


# ----------------------------------------------------------------------------- custom ops

@op("fasttrain::bias_gelu_fwd")
def _bias_gelu_fwd(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str
                   ) -> torch.Tensor:
    rows, d = x.shape
    y = torch.empty_like(x)
    block_r, block_d = _tile(d, LAUNCH["fwd_elements"], LAUNCH["fwd_block_d"])
    progs, col_blocks, per = _grid_persistent(x.device, rows, d, block_r, block_d,
                                              LAUNCH["fwd_programs_per_sm"])
    if rows > 0:
        launch(_bias_gelu_fwd_kernel, (progs, col_blocks), x, x if bias is None else bias, y,
               rows, d, per, HAS_BIAS=bias is not None, TANH=approximate == "tanh",
               STAGES=LAUNCH["fwd_stages"], BLOCK_R=block_r, BLOCK_D=block_d,
               num_warps=LAUNCH["fwd_warps"])
    return y


@op("fasttrain::bias_gelu_bwd")
def _bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
                   approximate: str) -> Tensors2:
    rows, d = x.shape
    dx = torch.empty_like(x)
    block_r, block_d = _tile(d, LAUNCH["bwd_elements"], LAUNCH["bwd_block_d"])
    progs, col_blocks, per = _grid_persistent(x.device, rows, d, block_r, block_d,
                                              LAUNCH["programs_per_sm"])
    db = torch.empty((progs if bias is not None else 0, d), device=x.device,
                     dtype=torch.float32)  # per-program partials, every one written
    if rows > 0:
        launch(_bias_gelu_bwd_kernel, (progs, col_blocks),
               dy, x, x if bias is None else bias, dx, dx if bias is None else db, rows, d, per,
               HAS_BIAS=bias is not None, TANH=approximate == "tanh", STAGES=LAUNCH["stages"],
               BLOCK_R=block_r, BLOCK_D=block_d, num_warps=LAUNCH["bwd_warps"])
    return dx, db.sum(0)


@op("fasttrain::swiglu_fwd")
def _swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(gate)
    n = gate.numel()
    if n > 0:
        launch(_swiglu_fwd_kernel, (triton.cdiv(n, _TILE),), gate, up, y, n,
               BLOCK=_TILE, num_warps=_WARPS)
    return y


@op("fasttrain::swiglu_bwd")
def _swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> Tensors2:
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n > 0:
        launch(_swiglu_bwd_kernel, (triton.cdiv(n, _TILE),), dy, gate, up, dgate, dup, n,
               BLOCK=_TILE, num_warps=_WARPS)
    return dgate, dup


def _bias_gelu_setup(ctx, inputs, output) -> None:
    x, bias, approximate = inputs
    ctx.approximate = approximate
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, bias)


def _bias_gelu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, db = torch.ops.fasttrain.bias_gelu_bwd(output_grad(x, dy), x, bias, ctx.approximate)
    return dx, (db.to(bias.dtype) if ctx.has_bias else None), None


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return torch.ops.fasttrain.swiglu_bwd(output_grad(gate, dy), gate, up)


_bias_gelu_fwd.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)
_swiglu_fwd.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


# ----------------------------------------------------------------------------- public API

def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def _check_bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str) -> int:
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    _check_float("x", x)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x needs a non-empty last dim, got shape {tuple(x.shape)}")
    d = x.shape[-1]
    _check_bias(bias, x)
    return d


def _check_bias(bias: Optional[torch.Tensor], x: torch.Tensor) -> None:
    """A one-line ValueError unless bias is None or a float vector of x's last dim on x's
    device."""
    if bias is None:
        return
    d = x.shape[-1]
    if bias.shape != (d,):
        raise ValueError(f"bias shape {tuple(bias.shape)} does not match x's last dim ({d})")
    if bias.dtype not in _DTYPES or bias.device != x.device:
        raise ValueError(f"bias must be a float tensor on {x.device}, "
                         f"got {bias.dtype} on {bias.device}")


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str = "none"
              ) -> torch.Tensor:
    """``gelu(x + bias)`` over x's last dim D (bias of shape (D,), or None for plain GELU);
    ``approximate`` is "none" (erf) or "tanh", as in ``torch.nn.functional.gelu``."""
    d = _check_bias_gelu(x, bias, approximate)
    b = None if bias is None else bias.contiguous()
    y = torch.ops.fasttrain.bias_gelu_fwd(x.reshape(-1, d).contiguous(), b, approximate)
    return y.view(x.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for gate and up of the same shape, dtype and device (non-contiguous
    inputs are copied to contiguous ones first); the result is contiguous."""
    _check_float("gate", gate)
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"up must match gate ({tuple(gate.shape)}, {gate.dtype}, {gate.device}), "
                         f"got ({tuple(up.shape)}, {up.dtype}, {up.device})")
    return torch.ops.fasttrain.swiglu_fwd(gate.contiguous(), up.contiguous())


def bias_gelu_reference(x: torch.Tensor, bias: Optional[torch.Tensor],
                        approximate: str = "none") -> torch.Tensor:
    """Plain-PyTorch ``bias_gelu``: fp32 internally, output in x's dtype."""
    z = x.float() if bias is None else x.float() + bias.float()
    return F.gelu(z, approximate=approximate).to(x.dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch ``swiglu``: fp32 internally, output in gate's dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
