"""A GELU MLP whose GELU lives in the epilogues of two Triton GEMMs, forward and backward: the
experiment ``benchmarks/gemm_gelu_micro.py`` measures. Not part of the library: on the H200 these
GEMMs ran well below cuBLAS at ViT-B's and Swin-B's MLP shapes, so the fused MLP was slower than
cuBLAS + fasttrain's bias + GELU kernel (gemm-gelu-micro-20261125-0244.jsonl).

What is fused
    ``gelu_mlp(x, w1, b1, w2)`` computes ``gelu(x w1ᵀ + b1) w2ᵀ`` (a transformer MLP without
    fc2's bias, which the caller adds, e.g. in the next fused LayerNorm). Forward, fc1 is a
    Triton GEMM whose epilogue adds b1 in fp32 and applies the GELU while the tile is still
    in registers, writing the activation g (fc2's input) and the pre-activation a (kept for
    backward); fc2 is cuBLAS. Backward, fc2's input gradient ``dy w2`` is a Triton GEMM whose
    epilogue multiplies by GELU's derivative at a and writes fc1's output gradient straight
    away, with per-tile fp32 column sums of it (b1's gradient, reduced by one ``torch.sum``,
    no atomics); the weight gradients and fc1's input gradient are cuBLAS. So the two
    elementwise passes over the (tokens × hidden) activation that a bias + GELU kernel needs
    (read h, write g; read dg and h, write da) are gone; the GEMMs write what they wrote
    before plus a, and the backward one reads a.

When it helps
    Wide MLPs over many tokens, where the bias + GELU passes are a tenth of the step (ViT-B/16
    at batch 128: 25,216 tokens × 3,072). Only worth it where the Triton GEMM runs close to
    cuBLAS at these shapes, which they did not (above).

Numerics
    Products accumulate in fp32 on tensor cores (bf16/fp16 inputs; fp32 inputs multiply in
    TF32-free fp32, slow, for tests); the bias add and the GELU (erf, or ``approximate="tanh"``)
    in fp32 on the unrounded accumulator, as cuBLAS's bias epilogue + PyTorch's GELU would on a
    rounded one. a is kept rounded to the inputs' dtype; backward evaluates GELU's derivative at
    that rounded a. b1's gradient is summed in fp32 from the unrounded product.

Layout
    x (tokens, D) contiguous, w1 (H, D) and w2 (D, H) as ``nn.Linear`` stores them, b1 (H,).
    Tiles of ``BLOCK_M × BLOCK_N`` outputs, ``BLOCK_K`` deep, grouped ``GROUP_M`` row tiles at a
    time so that neighbouring programs share their operand tiles in L2 (``LAUNCH``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from fasttrain.kernels._triton import INTERPRETED, launch, op, sum0, tile_dot
from fasttrain.kernels.activations import _gelu_and_grad

__all__ = ["LAUNCH", "gelu_mlp", "gelu_mlp_reference", "gemm_gelu_fwd", "gemm_gelu_bwd"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_APPROXIMATE = ("none", "tanh")
# Tile shape per direction (the script sweeps them): output rows and columns a program,
# the depth of one step of the K loop, warps, pipelining stages of the K loop, row tiles a
# group.
LAUNCH = {"fwd": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8,
                      num_stages=4),
          "bwd": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8,
                      num_stages=4)}


# ----------------------------------------------------------------------------- kernels
# Builtins of triton.language and the helpers of ._triton / .activations only (see ._triton).

@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (row tile, column tile): column tiles vary slowest within a group of
    GROUP_M row tiles, so a group's programs reuse the same columns of B from L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _mainloop(a_ptr, b_ptr, pid_m, pid_n, M, N, K: tl.constexpr, sbk, sbn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              STAGES: tl.constexpr, DOT: tl.constexpr):
    """The fp32 tile ``A[rows] @ B[:, cols]`` of A (M, K) row-major and B (K, N) at strides
    (sbk, sbn). Rows and columns past the ends wrap around (their results are never stored);
    K is masked where it is not a multiple of BLOCK_K."""
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    ks = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    b_tile = b_ptr + ks[:, None] * sbk + cols[None, :] * sbn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if K % BLOCK_K == 0:
            a = tl.load(a_tile)
            b = tl.load(b_tile)
        else:
            a = tl.load(a_tile, mask=(k0 + ks)[None, :] < K, other=0.0)
            b = tl.load(b_tile, mask=(k0 + ks)[:, None] < K, other=0.0)
        acc += tile_dot(a, b, DOT)
        a_tile += BLOCK_K
        b_tile += BLOCK_K * sbk
    return acc


@triton.jit
def _outputs(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets of this tile in an (M, N) row-major output, its mask, its columns and their
    mask."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    return rows[:, None].to(tl.int64) * N + cols[None, :], (rows < M)[:, None] & cmask[None, :], \
        cols, cmask


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, b_ptr, a_ptr, g_ptr, M, N, K: tl.constexpr,
                HAS_BIAS: tl.constexpr, TANH: tl.constexpr, DOT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    """a = x wᵀ + b and g = gelu(a) for one tile; w (N, K) row-major is B = wᵀ at strides
    (1, K)."""
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    z = _mainloop(x_ptr, w_ptr, pid_m, pid_n, M, N, K, 1, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                  DOT)
    offs, mask, cols, cmask = _outputs(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(a_ptr + offs, z.to(a_ptr.dtype.element_ty), mask=mask)
    g, _ = _gelu_and_grad(z, TANH)
    tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(dy_ptr, w_ptr, a_ptr, da_ptr, parts_ptr, M, N, K: tl.constexpr,
                HAS_BIAS: tl.constexpr, TANH: tl.constexpr, DOT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    """da = (dy w) · gelu'(a) for one tile, and its column sums into row ``pid_m`` of the
    (row tiles, N) fp32 partials; w (K, N) row-major is B at strides (N, 1)."""
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    dg = _mainloop(dy_ptr, w_ptr, pid_m, pid_n, M, N, K, N, 1, BLOCK_M, BLOCK_N, BLOCK_K,
                   STAGES, DOT)
    offs, mask, cols, cmask = _outputs(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _, slope = _gelu_and_grad(a, TANH)
    da = tl.where(mask, dg * slope, 0.0)
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(parts_ptr + pid_m * N + cols, sum0(da), mask=cmask)


# ----------------------------------------------------------------------------- custom ops

def _meta(way: str, x: torch.Tensor, approximate: str) -> tuple[dict, dict]:
    """(the kernel's compile-time settings, its launch settings) for ``way``."""
    cfg = dict(LAUNCH[way])
    launch_cfg = {"num_warps": cfg.pop("num_warps")}
    cfg["STAGES"] = cfg.pop("num_stages")
    cfg.update(TANH=approximate == "tanh",
               DOT=1 if x.dtype == torch.float32 else 2 if INTERPRETED else 0)
    return cfg, launch_cfg


def _grid(M: int, N: int, cfg: dict) -> tuple[int]:
    return (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)


@op("fasttrain_bench::gemm_gelu_fwd")
def _gemm_gelu_fwd(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                   approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    N = w.shape[0]
    a = x.new_empty((M, N))
    g = x.new_empty((M, N))
    if M and N:
        cfg, launch_cfg = _meta("fwd", x, approximate)
        launch(_fwd_kernel, _grid(M, N, cfg), x, w, w if b is None else b, a, g, M, N, K,
               HAS_BIAS=b is not None, **cfg, **launch_cfg)
    return g, a


@op("fasttrain_bench::gemm_gelu_bwd")
def _gemm_gelu_bwd(dy: torch.Tensor, w: torch.Tensor, a: torch.Tensor, has_bias: bool,
                   approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = dy.shape
    N = w.shape[1]
    da = torch.empty_like(a)
    cfg, launch_cfg = _meta("bwd", dy, approximate)
    tiles_m = triton.cdiv(M, cfg["BLOCK_M"]) if has_bias else 0
    alloc = torch.empty if M else torch.zeros  # every row tile writes its row of partials
    parts = alloc((tiles_m, N), device=dy.device, dtype=torch.float32)
    if M and N:
        launch(_bwd_kernel, _grid(M, N, cfg), dy, w, a, da, da if parts.numel() == 0 else parts,
               M, N, K, HAS_BIAS=has_bias, **cfg, **launch_cfg)
    return da, parts.sum(0)


def gemm_gelu_fwd(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                  approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """(gelu(x wᵀ + b), x wᵀ + b) of a 2-D x; w (N, K) as ``nn.Linear.weight``."""
    return torch.ops.fasttrain_bench.gemm_gelu_fwd(x, w, b, approximate)


def gemm_gelu_bwd(dy: torch.Tensor, w: torch.Tensor, a: torch.Tensor, has_bias: bool = True,
                  approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """((dy w) · gelu'(a), its fp32 column sums — empty without ``has_bias``) of a 2-D dy;
    w (K, N) as the next ``nn.Linear.weight``."""
    return torch.ops.fasttrain_bench.gemm_gelu_bwd(dy, w, a, has_bias, approximate)


class _GeluMlp(torch.autograd.Function):
    """x (M, D) → gelu(x w1ᵀ + b1) w2ᵀ; saves x, a and g (as fc1 → GELU → fc2 would)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, approximate):
        g, a = gemm_gelu_fwd(x, w1, b1, approximate)
        ctx.approximate, ctx.b1_dtype = approximate, None if b1 is None else b1.dtype
        ctx.save_for_backward(x, w1, w2, a, g)
        return g @ w2.t()

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, a, g = ctx.saved_tensors
        dy = dy.contiguous()
        has_bias = ctx.b1_dtype is not None
        da, db1 = gemm_gelu_bwd(dy, w2, a, has_bias, ctx.approximate)
        dw2 = dy.t() @ g
        dw1 = da.t() @ x
        dx = da @ w1
        return dx, dw1, (db1.to(ctx.b1_dtype) if has_bias else None), dw2, None


# ----------------------------------------------------------------------------- public API

def _check(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
           approximate: str) -> None:
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1 or w1.dim() != 2 or w2.dim() != 2 or w1.shape[1] != x.shape[-1] \
            or w2.shape[1] != w1.shape[0]:
        raise ValueError(f"gelu_mlp needs x (..., D), w1 (H, D), w2 (E, H); got x "
                         f"{tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    if b1 is not None and b1.shape != (w1.shape[0],):
        raise ValueError(f"b1 shape {tuple(b1.shape)} does not match w1's {w1.shape[0]} rows")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """autocast's dtype where it is on for x's device (as it would cast fc1's inputs), else
    x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def gelu_mlp(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
             approximate: str = "none") -> torch.Tensor:
    """``gelu(x w1ᵀ + b1) w2ᵀ`` over x's last dim (fc2's bias left to the caller), in x's
    dtype, or autocast's where it is on (x and the weights are cast to it first, as autocast
    casts a linear layer's inputs); b1 is added in fp32 as it is."""
    _check(x, w1, b1, w2, approximate)
    dtype = _compute_dtype(x)
    x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = _GeluMlp.apply(x2, w1.contiguous(), b1, w2.contiguous(), approximate)
    return y.view(*x.shape[:-1], w2.shape[0])


def gelu_mlp_reference(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
                       w2: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Plain-PyTorch ``gelu_mlp``: products, bias and GELU in fp32 (or wider), g rounded to
    the compute dtype before fc2 as the kernel stores it; output in that dtype."""
    dtype = _compute_dtype(x)
    acc = torch.promote_types(dtype, torch.float32)
    with torch.autocast(x.device.type, enabled=False):
        z = x.to(dtype).to(acc) @ w1.to(dtype).to(acc).t()
        if b1 is not None:
            z = z + b1.to(acc)
        g = torch.nn.functional.gelu(z, approximate=approximate).to(dtype).to(acc)
        return (g @ w2.to(dtype).to(acc).t()).to(dtype)
