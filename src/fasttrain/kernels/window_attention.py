"""Swin's window attention in one Triton kernel each way: bias, shift mask and odd window sizes
inside the kernel.

What is fused
    ``window_attention(qkv, bias, mask, heads)`` computes, for every window and head,
    ``softmax(q kᵀ · scale + bias[head] + mask[window % nW]) v`` straight from the qkv
    projection's output (Bw, N, 3·C) and writes (Bw, N, C), ready for the output projection:
    no q/k/v permutes, no (Bw, heads, N, N) bias tensor, no score matrix in memory. A window
    (N = 49 tokens for Swin's 7×7) lives in one tile padded to a power of two (64), so the odd
    size costs masked lanes, not the unaligned GEMMs that batched matmuls of 49 × 49 × 32 run
    (cuBLAS picks align-1 kernels for them: the top kernel of
    profile-swin-base-20261121-061841). Bias and mask are first summed into one padded
    (nW, heads, 64, 64) tile set in the inputs' dtype (-inf on padded keys), so each program
    reads its addend in one aligned, unmasked load (the separate fp32 bias and mask tiles,
    loaded with masks, cost twice the registers and most of the forward's time). The forward
    keeps one log-sum-exp per row.

    The backward recomputes the probabilities per window and writes dq, dk, dv into one
    (Bw, N, 3·C) gradient — the layout the qkv projection's backward reads. The bias gradient
    is the sum of the score gradients over all windows: each program walks a strided set of
    windows for one head, sums their score gradients in registers and writes one partial,
    which a final ``torch.sum`` reduces (no atomics, no (Bw, heads, N, N) tensor).

When it helps
    Swin's window attention, eager or compiled: compile's decomposed attention runs two
    batched matmuls of odd sizes plus a fused bias/mask/softmax kernel and materialises the
    scores and their gradient; SDPA's fused kernels take the bias only as a (Bw, heads, N, N)
    tensor and are built for long sequences. Windows of more than 128 tokens do not fit one
    tile; the Swin layer keeps its plain path for them.

Numerics
    bias + mask is rounded to the inputs' dtype once (as SDPA under autocast takes its mask);
    scores, softmax and every reduction in fp32; the probabilities are rounded to the input
    dtype before they multiply v (as flash attention does). fp32 inputs multiply in full fp32
    (no TF32). ``bias`` and ``mask`` may be fp32 while qkv is bf16/fp16; the bias gradient
    (summed in fp32) comes back in the bias's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .windows import cyclic_shift, window_partition, window_reverse
from ._triton import (INTERPRETED, add, launch, maximum, op, output_grad, programs_cap,
                      tile_dot)

__all__ = ["window_attention", "window_attention_reference", "map_window_attention",
           "map_window_attention_reference", "map_window_attention_tiles", "window_bias_tiles",
           "MAX_TOKENS"]

MAX_TOKENS = 128  # tokens per window that one tile holds (a 64 × 64 or 128 × 128 score tile)
WIDE_ELEMENTS = 2**31  # qkv maps this large index in int64 (the kernels' WIDE), smaller in int32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Launch settings (H200, benchmarks/kernels/window_tune.py, window-tune-20261121-0813: fastest at all
# four Swin stages): warps per program; for the backward the persistent programs per SM, each
# summing one bias partial over its windows, and the software-pipelining stages of its loop
# (capping its 242 registers a thread to fit 3 or 4 programs an SM measured 19-52% slower:
# window-tune-20261121-2133). The forward walks windows persistently too, 4 programs per SM
# with the next windows' loads 3 stages ahead: once the index arithmetic was int32 with the
# geometry constant (ncu-window-20261122-0059: forward 21-27% and backward 33-35% faster), that
# took Swin-B's graphed step another 0.9% (3,242 and 3,247 against 3,213 and 3,215 img/s,
# train-window-int32-20261122-0108); before it, a tie (train-window-fwd-ab-20261121-2156).
# fwd_programs_per_sm 0: one window a program.
LAUNCH = {"fwd_warps": 4, "bwd_warps": 4, "programs_per_sm": 2, "stages": 3,
          "fwd_programs_per_sm": 4, "fwd_stages": 3}


# ----------------------------------------------------------------------------- kernels
# Builtins of triton.language and the reductions of ._triton only: the kernels also run in
# the interpreter.

@triton.jit
def _tokens(win, rows, H: tl.constexpr, W: tl.constexpr, WH: tl.constexpr, WW: tl.constexpr,
            SHIFT: tl.constexpr):
    """Where window ``win``'s tokens ``rows`` sit in the (B, H, W) token map: the windows of
    the map rolled up-left by SHIFT, WH × WW tokens each, row-major (window_partition of
    cyclic_shift). Windows side by side in memory are the map 1 × N with windows 1 × N.

    The geometry is constant, so the divisions are multiplies and the roll's wrap-around one
    conditional subtraction, in ``win``'s integer type (int32 unless the kernel's WIDE): ncu
    found int64 divisions by runtime sizes keeping the ALU these kernels' busiest pipeline.
    Padded rows (rows ≥ N) get addresses that are never loaded."""
    across: tl.constexpr = W // WW
    per_image: tl.constexpr = (H // WH) * across
    image = win // per_image
    w = win % per_image
    y = (w // across) * WH + rows // WW + SHIFT
    x = (w % across) * WW + rows % WW + SHIFT
    if SHIFT > 0:
        y = tl.where(y >= H, y - H, y)
        x = tl.where(x >= W, x - W, x)
    return (image * H + y) * W + x


@triton.jit
def _load_qkv(qkv_ptr, tok, head, rows, dcols, N, C, D):
    """q, k and v tiles (BLOCK_N × BLOCK_D) of one window and head; padded rows and columns 0."""
    ld = (rows < N)[:, None] & (dcols < D)[None, :]
    ptrs = qkv_ptr + tok[:, None] * 3 * C + head * D + dcols[None, :]
    return (tl.load(ptrs, mask=ld, other=0.0), tl.load(ptrs + C, mask=ld, other=0.0),
            tl.load(ptrs + 2 * C, mask=ld, other=0.0))


@triton.jit
def _fwd_kernel(qkv_ptr, bm_ptr, out_ptr, lse_ptr, Bw, scale, N: tl.constexpr,
                C: tl.constexpr, D: tl.constexpr, heads: tl.constexpr, NW: tl.constexpr,
                H: tl.constexpr, W: tl.constexpr, WH: tl.constexpr, WW: tl.constexpr,
                SHIFT: tl.constexpr, WIDE: tl.constexpr, DOT: tl.constexpr,
                STAGES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (part, head) walks windows part, part + parts, …: one window each when there
    are as many parts as windows; else persistent, the next windows' loads in flight (STAGES)."""
    part = tl.program_id(0)
    if WIDE:  # qkv has 2³¹ elements or more: int64 offsets
        part = part.to(tl.int64)
    head = tl.program_id(1)
    parts = tl.num_programs(0)
    scale = tl.cast(scale, tl.float32)  # see ._triton: Python floats
    rows = tl.arange(0, BLOCK_N)
    dcols = tl.arange(0, BLOCK_D)
    rmask = rows < N
    st = rmask[:, None] & (dcols < D)[None, :]
    tile = rows[:, None] * BLOCK_N + rows[None, :]
    for i in tl.range(0, tl.cdiv(Bw - part, parts), num_stages=STAGES):
        win = part + i * parts
        tok = _tokens(win, rows, H, W, WH, WW, SHIFT)
        q, k, v = _load_qkv(qkv_ptr, tok, head, rows, dcols, N, C, D)
        bm = tl.load(bm_ptr + ((win % NW) * heads + head) * BLOCK_N * BLOCK_N + tile)
        s = tile_dot(q, tl.trans(k), DOT) * scale + bm.to(tl.float32)
        m = tl.reduce(s, 1, maximum)
        p = tl.exp(s - m[:, None])
        denom = tl.reduce(p, 1, add)
        o = tile_dot(p.to(v.dtype), v, DOT) / denom[:, None]
        tl.store(out_ptr + tok[:, None] * C + head * D + dcols[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=st)
        tl.store(lse_ptr + (win * heads + head) * N + rows, m + tl.log(denom), mask=rmask)


@triton.jit
def _bwd_kernel(dout_ptr, qkv_ptr, out_ptr, lse_ptr, bm_ptr, dqkv_ptr, dbias_ptr,
                Bw, scale, N: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
                heads: tl.constexpr, NW: tl.constexpr, H: tl.constexpr, W: tl.constexpr,
                WH: tl.constexpr, WW: tl.constexpr, SHIFT: tl.constexpr, WIDE: tl.constexpr,
                DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Persistent: program (part, head) walks windows part, part + parts, … (neighbours run
    side by side) and sums their score gradients into one bias partial."""
    part = tl.program_id(0)
    if WIDE:  # qkv has 2³¹ elements or more: int64 offsets
        part = part.to(tl.int64)
    head = tl.program_id(1)
    parts = tl.num_programs(0)
    scale = tl.cast(scale, tl.float32)  # see ._triton: Python floats
    rows = tl.arange(0, BLOCK_N)
    dcols = tl.arange(0, BLOCK_D)
    rmask = rows < N
    ld = rmask[:, None] & (dcols < D)[None, :]
    tile = rows[:, None] * BLOCK_N + rows[None, :]
    dbias = tl.full((BLOCK_N, BLOCK_N), 0.0, tl.float32)
    for i in range(0, tl.cdiv(Bw - part, parts)):
        win = part + i * parts
        tok = _tokens(win, rows, H, W, WH, WW, SHIFT)
        q, k, v = _load_qkv(qkv_ptr, tok, head, rows, dcols, N, C, D)
        at = tok[:, None] * C + head * D + dcols[None, :]
        do = tl.load(dout_ptr + at, mask=ld, other=0.0)
        o = tl.load(out_ptr + at, mask=ld, other=0.0)
        delta = tl.reduce(do.to(tl.float32) * o.to(tl.float32), 1, add)  # rowsum(dO ∘ O)
        lse = tl.load(lse_ptr + (win * heads + head) * N + rows, mask=rmask, other=0.0)
        bm = tl.load(bm_ptr + ((win % NW) * heads + head) * BLOCK_N * BLOCK_N + tile)
        p = tl.exp(tile_dot(q, tl.trans(k), DOT) * scale + bm.to(tl.float32) - lse[:, None])
        dv = tile_dot(tl.trans(p.to(do.dtype)), do, DOT)
        ds = p * (tile_dot(do, tl.trans(v), DOT) - delta[:, None])  # 0 on padded queries, keys
        dbias += ds
        ds_low = ds.to(q.dtype)
        dq = tile_dot(ds_low, k, DOT) * scale
        dk = tile_dot(tl.trans(ds_low), q, DOT) * scale
        grad = dqkv_ptr + tok[:, None] * 3 * C + head * D + dcols[None, :]
        ty = dqkv_ptr.dtype.element_ty
        tl.store(grad, dq.to(ty), mask=ld)
        tl.store(grad + C, dk.to(ty), mask=ld)
        tl.store(grad + 2 * C, dv.to(ty), mask=ld)
    tl.store(dbias_ptr + (part * heads + head) * BLOCK_N * BLOCK_N + tile, dbias)


# ----------------------------------------------------------------------------- custom ops

def _bias_tiles(bias: torch.Tensor, mask: Optional[torch.Tensor], dtype: torch.dtype,
                block_n: int) -> torch.Tensor:
    """bias + mask as (nW, heads, block_n, block_n) tiles in ``dtype`` (the scores' other
    addend, as SDPA takes its mask in the inputs' dtype): padded keys -inf, padded queries 0.
    One aligned, unmasked load per window and head; built per call (nW · heads tiles)."""
    N = bias.shape[-1]
    bm = bias.float()[None] if mask is None else bias.float()[None] + mask.float()[:, None]
    bm = torch.nn.functional.pad(bm, (0, block_n - N), value=float("-inf"))
    return torch.nn.functional.pad(bm, (0, 0, 0, block_n - N)).to(dtype).contiguous()


def _block_n(N: int) -> int:
    return max(16, triton.next_power_of_2(N))


def window_bias_tiles(bias: torch.Tensor, mask: Optional[torch.Tensor],
                      dtype: torch.dtype) -> torch.Tensor:
    """``bias`` (heads, N, N) + ``mask`` (nW, N, N) or None as the forward kernel reads them
    (``_bias_tiles``), built once: for a model whose bias no longer changes (a served one),
    passed to ``map_window_attention_tiles`` in place of the gather, sum and padding
    ``map_window_attention`` does at every call."""
    return _bias_tiles(bias, mask, dtype, _block_n(bias.shape[-1]))


def _prepare(qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor], heads: int,
             warps: int, geometry: list[int]) -> tuple[torch.Tensor, dict]:
    """What both kernels take besides their tensors: the bias tiles and the compile-time
    settings (``_meta``)."""
    bm = _bias_tiles(bias, mask, qkv.dtype, _block_n(bias.shape[-1]))
    return bm, _meta(qkv, bm, bias.shape[-1], heads, warps, geometry)


def _meta(qkv: torch.Tensor, bm: torch.Tensor, N: int, heads: int, warps: int,
          geometry: list[int]) -> dict:
    """The compile-time settings: the sizes (N, C, head_dim, heads), ``geometry``'s (see
    ``_tokens``) and the launch's. Constant sizes make the address arithmetic multiplies by
    constants."""
    C3, block_n = qkv.shape[-1], bm.shape[-1]
    return dict(DOT=1 if qkv.dtype == torch.float32 else 2 if INTERPRETED else 0,
                BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(C3 // 3 // heads)),
                num_stages=LAUNCH["stages"], num_warps=warps * (1 if block_n <= 64 else 2),
                N=N, C=C3 // 3, D=C3 // 3 // heads, heads=heads, NW=bm.shape[0],
                WIDE=qkv.numel() >= WIDE_ELEMENTS,
                **dict(zip(("H", "W", "WH", "WW", "SHIFT"), geometry)))


def _parts(qkv: torch.Tensor, Bw: int, heads: int, per_sm: int) -> int:
    """Programs per head of a persistent launch: ``per_sm`` programs an SM in all, each walking
    a strided set of the ``Bw`` windows; 0 programs per SM: one window each."""
    return Bw if per_sm == 0 else max(1, min(Bw, programs_cap(qkv.device, per_sm) // heads))


def _windows(qkv: torch.Tensor, bias: torch.Tensor) -> int:
    return qkv.numel() // (qkv.shape[-1] * bias.shape[-1])


@op("fasttrain::window_attention_fwd")
def _fwd(qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor], heads: int,
         scale: float, geometry: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``geometry``: (H, W, window height, window width, shift) of the token map (_tokens)."""
    Bw, N = _windows(qkv, bias), bias.shape[-1]
    out = qkv.new_empty((*qkv.shape[:-1], qkv.shape[-1] // 3))
    lse = torch.empty((Bw, heads, N), device=qkv.device, dtype=torch.float32)
    if Bw > 0:
        bm, meta = _prepare(qkv, bias, mask, heads, LAUNCH["fwd_warps"], geometry)
        _launch_fwd(qkv, bm, out, lse, Bw, heads, scale, meta)
    return out, lse


def _launch_fwd(qkv: torch.Tensor, bm: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                Bw: int, heads: int, scale: float, meta: dict) -> None:
    parts = _parts(qkv, Bw, heads, LAUNCH["fwd_programs_per_sm"])
    launch(_fwd_kernel, (parts, heads), qkv, bm, out, lse, Bw, scale,
           STAGES=LAUNCH["fwd_stages"], **meta)


@op("fasttrain::window_attention_fwd_tiles")
def _fwd_tiles(qkv: torch.Tensor, tiles: torch.Tensor, heads: int, scale: float,
               geometry: list[int]) -> torch.Tensor:
    """The forward from bias tiles built beforehand (``window_bias_tiles``); no gradient."""
    N = geometry[2] * geometry[3]
    Bw = qkv.numel() // (qkv.shape[-1] * N)
    out = qkv.new_empty((*qkv.shape[:-1], qkv.shape[-1] // 3))
    if Bw > 0:  # the kernel writes each row's log-sum-exp (for a backward), unread here
        lse = torch.empty((Bw, heads, N), device=qkv.device, dtype=torch.float32)
        meta = _meta(qkv, tiles, N, heads, LAUNCH["fwd_warps"], geometry)
        _launch_fwd(qkv, tiles, out, lse, Bw, heads, scale, meta)
    return out


@op("fasttrain::window_attention_bwd")
def _bwd(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
         bias: torch.Tensor, mask: Optional[torch.Tensor], heads: int,
         scale: float, geometry: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    Bw, N = _windows(qkv, bias), bias.shape[-1]
    dqkv = torch.empty_like(qkv)
    if Bw == 0:
        return dqkv, torch.zeros((heads, N, N), device=qkv.device, dtype=torch.float32)
    parts = _parts(qkv, Bw, heads, LAUNCH["programs_per_sm"])
    bm, meta = _prepare(qkv, bias, mask, heads, LAUNCH["bwd_warps"], geometry)
    dbias = torch.empty((parts, heads, *bm.shape[2:]), device=qkv.device, dtype=torch.float32)
    launch(_bwd_kernel, (parts, heads), dout, qkv, out, lse, bm, dqkv, dbias, Bw, scale, **meta)
    return dqkv, dbias.sum(0)[:, :N, :N]


def _setup(ctx, inputs, output) -> None:
    qkv, bias, mask, heads, scale, geometry = inputs
    ctx.heads, ctx.scale, ctx.geometry, ctx.bias_dtype = heads, scale, geometry, bias.dtype
    ctx.save_for_backward(qkv, bias, mask, output[0], output[1])


def _backward(ctx, dout, _dlse):
    qkv, bias, mask, out, lse = ctx.saved_tensors
    dqkv, dbias = torch.ops.fasttrain.window_attention_bwd(output_grad(out, dout), qkv, out, lse,
                                                           bias, mask, ctx.heads, ctx.scale,
                                                           ctx.geometry)
    return dqkv, dbias.to(ctx.bias_dtype), None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------- public API

def _check(qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor],
           heads: int) -> None:
    if qkv.dtype not in _DTYPES:
        raise ValueError(f"qkv must be float32, bfloat16 or float16, got {qkv.dtype}")
    if qkv.dim() != 3 or heads < 1 or qkv.shape[2] % (3 * heads):
        raise ValueError(f"qkv must be (windows, tokens, 3 * heads * head_dim) with {heads} "
                         f"heads, got shape {tuple(qkv.shape)}")
    Bw, N, _ = qkv.shape
    if N > MAX_TOKENS:
        raise ValueError(f"windows of {N} tokens do not fit one tile (at most {MAX_TOKENS})")
    if bias.shape != (heads, N, N) or bias.device != qkv.device:
        raise ValueError(f"bias must be ({heads}, {N}, {N}) on {qkv.device}, got "
                         f"{tuple(bias.shape)} on {bias.device}")
    if mask is not None and (mask.dim() != 3 or mask.shape[1:] != (N, N)
                             or Bw % mask.shape[0] or mask.device != qkv.device):
        raise ValueError(f"mask must be (nW, {N}, {N}) on {qkv.device} with nW dividing the "
                         f"{Bw} windows, got {tuple(mask.shape)} on {mask.device}")
    if mask is not None and mask.requires_grad:
        raise ValueError("mask is a constant: it gets no gradient (detach it)")


def window_attention(qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor],
                     heads: int, scale: float | None = None) -> torch.Tensor:
    """Attention within windows: ``qkv`` (Bw, N, 3·C) as (3, heads, C/heads) on its last dim,
    ``bias`` (heads, N, N) added to every window's scores, ``mask`` (nW, N, N) added to window
    ``b`` as ``mask[b % nW]`` (or None); ``scale`` defaults to head_dim^-½. Returns (Bw, N, C)
    with the heads side by side, in qkv's dtype."""
    _check(qkv, bias, mask, heads)
    N = qkv.shape[1]
    return _attend(qkv, bias, mask, heads, scale, [1, N, 1, N, 0])


def _check_map(qkv: torch.Tensor, window: int, shift: int) -> torch.Size:
    """qkv's shape, where it is a (B, H, W, 3·C) map that ``window`` and ``shift`` tile."""
    if qkv.dim() != 4:
        raise ValueError(f"qkv must be a (batch, height, width, 3 * channels) map, got shape "
                         f"{tuple(qkv.shape)}")
    _, H, W, _ = qkv.shape
    if window < 1 or H % window or W % window or not 0 <= shift < window:
        raise ValueError(f"a {H}x{W} map does not tile into {window}x{window} windows shifted "
                         f"by {shift} (need window | H, W and 0 <= shift < window)")
    return qkv.shape


def map_window_attention(qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor],
                         heads: int, window: int, shift: int = 0,
                         scale: float | None = None) -> torch.Tensor:
    """``window_attention`` on the token map itself: ``qkv`` (B, H, W, 3·C) unpartitioned, the
    windows those of the map rolled up-left by ``shift`` and cut into ``window`` × ``window``
    tiles (Swin's cyclic shift and window partition), ``mask`` (nW, N, N) for one image's nW
    windows. Returns (B, H, W, C) in the map's layout: what the reverse partition and shift of
    the windows' outputs give. The kernels find each window's tokens by address, so neither
    the roll nor the partition (nor their reverses, nor their backwards) touches memory."""
    _, H, W, C3 = _check_map(qkv, window, shift)
    N = window * window
    _check(qkv.reshape(-1, N, C3), bias, mask, heads)
    if mask is not None and mask.shape[0] != (H // window) * (W // window):
        raise ValueError(f"mask must have one (N, N) slice per window of an image "
                         f"({(H // window) * (W // window)}), got {mask.shape[0]}")
    return _attend(qkv, bias, mask, heads, scale, [H, W, window, window, shift])


def map_window_attention_tiles(qkv: torch.Tensor, tiles: torch.Tensor, heads: int, window: int,
                               shift: int = 0, scale: float | None = None) -> torch.Tensor:
    """``map_window_attention`` with its bias and mask already summed and padded by
    ``window_bias_tiles``: the forward alone (no gradient), for a model whose bias is fixed."""
    _, H, W, C3 = _check_map(qkv, window, shift)
    if qkv.dtype not in _DTYPES or C3 % (3 * heads):
        raise ValueError(f"qkv must be float32, bfloat16 or float16 with 3 * {heads} heads on "
                         f"its last dim, got {qkv.dtype} {tuple(qkv.shape)}")
    if window * window > MAX_TOKENS:
        raise ValueError(f"windows of {window * window} tokens do not fit one tile (at most "
                         f"{MAX_TOKENS})")
    n_win, block_n = (H // window) * (W // window), _block_n(window * window)
    if (tiles.dim() != 4 or tiles.shape[0] not in (1, n_win)
            or tuple(tiles.shape[1:]) != (heads, block_n, block_n)
            or tiles.dtype != qkv.dtype or tiles.device != qkv.device):
        raise ValueError(f"tiles must be (1 or {n_win}, {heads}, {block_n}, {block_n}) "
                         f"{qkv.dtype} on {qkv.device} (window_bias_tiles), got "
                         f"{tuple(tiles.shape)} {tiles.dtype} on {tiles.device}")
    if torch.is_grad_enabled() and qkv.requires_grad:
        raise ValueError("map_window_attention_tiles is forward only (no gradient): train "
                         "with map_window_attention")
    head_dim = C3 // (3 * heads)
    scale = head_dim ** -0.5 if scale is None else float(scale)
    return torch.ops.fasttrain.window_attention_fwd_tiles(
        qkv.contiguous(), tiles.contiguous(), heads, scale, [H, W, window, window, shift])


def _attend(qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor], heads: int,
            scale: float | None, geometry: list[int]) -> torch.Tensor:
    head_dim = qkv.shape[-1] // (3 * heads)
    scale = head_dim ** -0.5 if scale is None else float(scale)
    mask = None if mask is None else mask.contiguous()
    out, _ = torch.ops.fasttrain.window_attention_fwd(qkv.contiguous(), bias.contiguous(), mask,
                                                      heads, scale, geometry)
    return out


def window_attention_reference(qkv: torch.Tensor, bias: torch.Tensor,
                               mask: Optional[torch.Tensor], heads: int,
                               scale: float | None = None) -> torch.Tensor:
    """Plain-PyTorch ``window_attention``: bias + mask rounded to qkv's dtype before they are
    added (as the kernel, and SDPA under autocast, take them), fp32 (or wider) scores and
    softmax, the probabilities rounded to qkv's dtype as the kernel does, output in qkv's
    dtype."""
    Bw, N, C3 = qkv.shape
    head_dim = C3 // (3 * heads)
    scale = head_dim ** -0.5 if scale is None else scale
    acc = torch.promote_types(qkv.dtype, torch.float32)
    q, k, v = qkv.to(acc).view(Bw, N, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    add = bias.to(acc)[None] if mask is None else bias.to(acc)[None] + mask.to(acc)[:, None]
    add = add.to(qkv.dtype).to(acc)  # (nW, heads, N, N): window b takes add[b % nW]
    s = (q @ k.transpose(-1, -2)) * scale
    s = (s.view(-1, add.shape[0], heads, N, N) + add).view(Bw, heads, N, N)
    p = s.softmax(-1).to(qkv.dtype).to(acc)
    return (p @ v).transpose(1, 2).reshape(Bw, N, C3 // 3).to(qkv.dtype)


def map_window_attention_reference(qkv: torch.Tensor, bias: torch.Tensor,
                                   mask: Optional[torch.Tensor], heads: int, window: int,
                                   shift: int = 0, scale: float | None = None) -> torch.Tensor:
    """Plain-PyTorch ``map_window_attention``: roll, partition, attend, reverse, roll back."""
    _, H, W, _ = qkv.shape
    win = window_partition(cyclic_shift(qkv, shift), window)
    out = window_attention_reference(win, bias, mask, heads, scale)
    return cyclic_shift(window_reverse(out, window, H, W), -shift)
