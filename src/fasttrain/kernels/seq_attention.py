"""Self-attention over short sequences (ViT's 197 tokens) straight from the qkv projection,
one Triton kernel forward and two backward.

What is fused
    ``seq_attention(qkv, heads)`` computes, for every sequence and head,
    ``softmax(q kᵀ · scale) v`` from the qkv projection's output (B, T, 3·C), read as
    (3, heads, C/heads) on its last dim, and writes (B, T, C) with the heads side by side,
    ready for the output projection. The backward writes dq, dk and dv into one (B, T, 3·C)
    gradient, the layout the qkv projection's backward reads. So the q/k/v permutes, the
    output's transpose and the gradients' stack (a copy of the whole qkv gradient that
    Inductor emits after SDPA's backward, ``triton_poi_fused_clone_permute_stack``) are gone;
    no score matrix is in memory. ``batch_second`` takes the (T, B, 3·C) layout instead.

    Odd lengths cost little padding: keys and queries go in blocks of 64, and the last,
    partial block is a block of its own size rounded up to a power of two (197 tokens: three
    blocks of 64 and one of 16, 208 padded tokens against the 256 of 64-wide tiles).

    Forward: one program per (block of queries, sequence and head), an online softmax over
    the key blocks (flash attention); it keeps each row's log-sum-exp. Backward: the first
    kernel, one program per block of queries, recomputes the probabilities and writes dq and
    the rows' ``rowsum(dO ∘ O)``; the second, one program per block of keys, recomputes them
    transposed and writes dk and dv. No atomics, no fp32 gradient buffer to convert.

When it helps
    Sequences of a few hundred tokens at head dims 16-128 (ViT-B/16: 197 tokens, head dim
    64), where SDPA's kernels are built for long sequences and pad 197 tokens to 256. Long
    sequences work too (any length), without the tricks of kernels made for them.

Numerics
    Scores, softmax and every reduction in fp32 (exp2 of log2-scaled scores); the
    probabilities are rounded to the inputs' dtype before they multiply v, as flash attention
    does. fp32 inputs multiply in full fp32 (no TF32).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._triton import INTERPRETED, add, launch, maximum, op, output_grad, tile_dot

__all__ = ["seq_attention", "seq_attention_reference"]

WIDE_ELEMENTS = 2**31  # qkv this large indexes in int64 (the kernels' WIDE), smaller in int32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1 / math.log(2)  # scores go through exp2: scale · log2(e)
# Launch settings: rows (queries or keys) a block, warps a program, the key loop's pipelining
# stages.
LAUNCH = {"fwd_block": 64, "fwd_warps": 4, "fwd_stages": 2,
          "bwd_block": 64, "bwd_warps": 4, "bwd_stages": 2}


# ----------------------------------------------------------------------------- kernels
# Builtins of triton.language and the reductions of ._triton only: the kernels also run in
# the interpreter. Store addresses come from pointer-free helpers (see tests/kernel_writes.py).

@triton.jit
def _offsets(seq, row0, SB: tl.constexpr, ST: tl.constexpr, BLOCK: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """Rows row0 … row0 + BLOCK of sequence ``seq`` × columns 0 … BLOCK_D of one head, as
    element offsets in a (T, B) or (B, T) layout with batch stride SB and token stride ST
    (the caller adds the head's column); and the rows themselves."""
    rows = row0 + tl.arange(0, BLOCK)
    dcols = tl.arange(0, BLOCK_D)
    return seq * SB + rows[:, None] * ST + dcols[None, :], rows


@triton.jit
def _load(ptrs, rows, T: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
          FULL: tl.constexpr):
    """A BLOCK × BLOCK_D tile at ``ptrs``; rows ≥ T and columns ≥ D (padding) read as 0.
    FULL: every row exists (no row mask)."""
    dcols = tl.arange(0, BLOCK_D)
    if FULL:
        if D == BLOCK_D:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=(rows[:, None] >= 0) & (dcols < D)[None, :], other=0.0)
    else:
        return tl.load(ptrs, mask=(rows < T)[:, None] & (dcols < D)[None, :], other=0.0)


@triton.jit
def _store(ptrs, value, rows, T: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
           FULL: tl.constexpr):
    """Store ``value``'s existing rows and columns at ``ptrs`` (see ``_load``)."""
    dcols = tl.arange(0, BLOCK_D)
    value = value.to(ptrs.dtype.element_ty)
    if FULL:
        if D == BLOCK_D:
            tl.store(ptrs, value)
        else:
            tl.store(ptrs, value, mask=(rows[:, None] >= 0) & (dcols < D)[None, :])
    else:
        tl.store(ptrs, value, mask=(rows < T)[:, None] & (dcols < D)[None, :])


@triton.jit
def _rows_vec(ptr, rows, T: tl.constexpr, other, FULL: tl.constexpr):
    """One fp32 per row (log-sum-exp, rowsum(dO ∘ O)); rows ≥ T read as ``other``."""
    if FULL:
        return tl.load(ptr + rows)
    else:
        return tl.load(ptr + rows, mask=rows < T, other=other)


@triton.jit
def _program(H: tl.constexpr, NBLK: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
    """This program's (block, sequence × head, sequence, head, first row): block
    ``pid % NBLK`` of sequence × head ``pid // NBLK``, in int64 where WIDE."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    blk = pid % NBLK
    sh = pid // NBLK
    return blk, sh, sh // H, sh % H, blk * BLOCK


@triton.jit
def _fwd_keys(q, k_ptr, seq, k0, m, l, acc, scale2, T: tl.constexpr, SB: tl.constexpr,
              ST: tl.constexpr, C: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, DOT: tl.constexpr, FULL: tl.constexpr):
    """One block of keys of the online softmax; ``k_ptr`` points at this head's k columns."""
    offs, cols = _offsets(seq, k0, SB, ST, BLOCK_N, BLOCK_D)
    k = _load(k_ptr + offs, cols, T, D, BLOCK_D, FULL)
    v = _load(k_ptr + C + offs, cols, T, D, BLOCK_D, FULL)
    s = tile_dot(q, tl.trans(k), DOT) * scale2
    if not FULL:
        s = tl.where((cols < T)[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.reduce(s, 1, maximum))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.reduce(p, 1, add)
    acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT)
    return m_new, l, acc


@triton.jit
def _fwd_block(qkv_ptr, out_ptr, lse_ptr, seq, sh, head, row0, scale2, T: tl.constexpr,
               SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr, OT: tl.constexpr,
               C: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
               TAIL: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
               STAGES: tl.constexpr, FULL_M: tl.constexpr):
    """Output rows row0 … row0 + BLOCK_M of one sequence and head and their log-sum-exps
    (log2 units), over the full blocks of BLOCK keys, then the partial one of TAIL."""
    head_ptr = qkv_ptr + head * D
    offs, rows = _offsets(seq, row0, SB, ST, BLOCK_M, BLOCK_D)
    q = _load(head_ptr + offs, rows, T, D, BLOCK_D, FULL_M)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    KFULL: tl.constexpr = (T // BLOCK) * BLOCK
    for k0 in tl.range(0, KFULL, BLOCK, num_stages=STAGES):
        m, l, acc = _fwd_keys(q, head_ptr + C, seq, k0, m, l, acc, scale2, T, SB, ST, C, D,
                              BLOCK, BLOCK_D, DOT, True)
    if TAIL > 0:
        m, l, acc = _fwd_keys(q, head_ptr + C, seq, KFULL, m, l, acc, scale2, T, SB, ST, C, D,
                              TAIL, BLOCK_D, DOT, False)
    offs, rows = _offsets(seq, row0, OB, OT, BLOCK_M, BLOCK_D)
    _store(out_ptr + head * D + offs, acc / l[:, None], rows, T, D, BLOCK_D, FULL_M)
    if FULL_M:
        tl.store(lse_ptr + sh * T + rows, m + tl.log2(l))
    else:
        tl.store(lse_ptr + sh * T + rows, m + tl.log2(l), mask=rows < T)


@triton.jit
def _fwd_kernel(qkv_ptr, out_ptr, lse_ptr, scale2, T: tl.constexpr, SB: tl.constexpr,
                ST: tl.constexpr, OB: tl.constexpr, OT: tl.constexpr, C: tl.constexpr,
                D: tl.constexpr, H: tl.constexpr, NBLK: tl.constexpr, WIDE: tl.constexpr,
                DOT: tl.constexpr, STAGES: tl.constexpr, BLOCK: tl.constexpr,
                TAIL: tl.constexpr, TB: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program ``pid`` takes block ``pid % NBLK`` of queries (the full blocks of BLOCK rows,
    then a partial one of TAIL; TB is TAIL, or BLOCK where there is none) of sequence × head
    ``pid // NBLK``."""
    blk, sh, seq, head, row0 = _program(H, NBLK, WIDE, BLOCK)
    scale2 = tl.cast(scale2, tl.float32)  # see ._triton: Python floats
    if blk < T // BLOCK:
        _fwd_block(qkv_ptr, out_ptr, lse_ptr, seq, sh, head, row0, scale2, T, SB, ST, OB, OT,
                   C, D, BLOCK, BLOCK, TAIL, BLOCK_D, DOT, STAGES, True)
    else:
        _fwd_block(qkv_ptr, out_ptr, lse_ptr, seq, sh, head, row0, scale2, T, SB, ST, OB, OT,
                   C, D, TB, BLOCK, TAIL, BLOCK_D, DOT, STAGES, False)


@triton.jit
def _dq_keys(q, do, lse, delta, dq, k_ptr, seq, k0, scale2, T: tl.constexpr,
             SB: tl.constexpr, ST: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
             FULL: tl.constexpr):
    """dq += dS k over one block of keys. Padded keys are zero rows of k: they add nothing."""
    offs, cols = _offsets(seq, k0, SB, ST, BLOCK_N, BLOCK_D)
    k = _load(k_ptr + offs, cols, T, D, BLOCK_D, FULL)
    v = _load(k_ptr + C + offs, cols, T, D, BLOCK_D, FULL)
    p = tl.exp2(tile_dot(q, tl.trans(k), DOT) * scale2 - lse[:, None])
    ds = p * (tile_dot(do, tl.trans(v), DOT) - delta[:, None])
    return dq + tile_dot(ds.to(k.dtype), k, DOT)


@triton.jit
def _dq_block(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, seq, sh, head, row0,
              scale, scale2, T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr,
              OB: tl.constexpr, OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
              BLOCK_D: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr,
              FULL_M: tl.constexpr):
    """dq and rowsum(dO ∘ O) of query rows row0 … row0 + BLOCK_M. Padded rows: q and dO are 0,
    so their dS is 0."""
    head_ptr = qkv_ptr + head * D
    offs, rows = _offsets(seq, row0, SB, ST, BLOCK_M, BLOCK_D)
    q = _load(head_ptr + offs, rows, T, D, BLOCK_D, FULL_M)
    ooffs, _ = _offsets(seq, row0, OB, OT, BLOCK_M, BLOCK_D)
    do = _load(dout_ptr + head * D + ooffs, rows, T, D, BLOCK_D, FULL_M)
    o = _load(out_ptr + head * D + ooffs, rows, T, D, BLOCK_D, FULL_M)
    delta = tl.reduce(do.to(tl.float32) * o.to(tl.float32), 1, add)
    lse = _rows_vec(lse_ptr + sh * T, rows, T, 0.0, FULL_M)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    KFULL: tl.constexpr = (T // BLOCK) * BLOCK
    for k0 in tl.range(0, KFULL, BLOCK, num_stages=STAGES):
        dq = _dq_keys(q, do, lse, delta, dq, head_ptr + C, seq, k0, scale2, T, SB, ST, C, D,
                      BLOCK, BLOCK_D, DOT, True)
    if TAIL > 0:
        dq = _dq_keys(q, do, lse, delta, dq, head_ptr + C, seq, KFULL, scale2, T, SB, ST, C,
                      D, TAIL, BLOCK_D, DOT, False)
    _store(dqkv_ptr + head * D + offs, dq * scale, rows, T, D, BLOCK_D, FULL_M)
    if FULL_M:
        tl.store(delta_ptr + sh * T + rows, delta)
    else:
        tl.store(delta_ptr + sh * T + rows, delta, mask=rows < T)


@triton.jit
def _dq_kernel(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, scale, scale2,
               T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr,
               OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
               NBLK: tl.constexpr, WIDE: tl.constexpr, DOT: tl.constexpr,
               STAGES: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
               TB: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program ``pid``: dq of query block ``pid % NBLK`` of sequence × head ``pid // NBLK``,
    written into dqkv's q columns, and its rows' rowsum(dO ∘ O) for the dk/dv kernel."""
    blk, sh, seq, head, row0 = _program(H, NBLK, WIDE, BLOCK)
    scale = tl.cast(scale, tl.float32)  # see ._triton: Python floats
    scale2 = tl.cast(scale2, tl.float32)
    if blk < T // BLOCK:
        _dq_block(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, seq, sh, head, row0,
                  scale, scale2, T, SB, ST, OB, OT, C, D, BLOCK, BLOCK, TAIL, BLOCK_D, DOT,
                  STAGES, True)
    else:
        _dq_block(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, seq, sh, head, row0,
                  scale, scale2, T, SB, ST, OB, OT, C, D, TB, BLOCK, TAIL, BLOCK_D, DOT, STAGES,
                  False)


@triton.jit
def _dkv_queries(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, seq, q0, scale2,
                 T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr,
                 OT: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT: tl.constexpr, FULL: tl.constexpr):
    """dk, dv += one block of queries' share, from the transposed probabilities. Padded
    queries are zero rows with an infinite log-sum-exp: probability 0."""
    offs, rows = _offsets(seq, q0, SB, ST, BLOCK_M, BLOCK_D)
    q = _load(q_ptr + offs, rows, T, D, BLOCK_D, FULL)
    ooffs, _ = _offsets(seq, q0, OB, OT, BLOCK_M, BLOCK_D)
    do = _load(do_ptr + ooffs, rows, T, D, BLOCK_D, FULL)
    lse = _rows_vec(lse_ptr, rows, T, float("inf"), FULL)
    delta = _rows_vec(delta_ptr, rows, T, 0.0, FULL)
    pt = tl.exp2(tile_dot(k, tl.trans(q), DOT) * scale2 - lse[None, :])
    dv += tile_dot(pt.to(do.dtype), do, DOT)
    dst = pt * (tile_dot(v, tl.trans(do), DOT) - delta[None, :])
    dk += tile_dot(dst.to(q.dtype), q, DOT)
    return dk, dv


@triton.jit
def _dkv_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, seq, sh, head, row0, scale,
               scale2, T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr,
               OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK: tl.constexpr, TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
               DOT: tl.constexpr, STAGES: tl.constexpr, FULL_N: tl.constexpr):
    """dk and dv of key rows row0 … row0 + BLOCK_N of one sequence and head, over the full
    blocks of BLOCK queries, then the partial one of TAIL."""
    q_ptr = qkv_ptr + head * D
    offs, rows = _offsets(seq, row0, SB, ST, BLOCK_N, BLOCK_D)
    k = _load(q_ptr + C + offs, rows, T, D, BLOCK_D, FULL_N)
    v = _load(q_ptr + 2 * C + offs, rows, T, D, BLOCK_D, FULL_N)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    QFULL: tl.constexpr = (T // BLOCK) * BLOCK
    for q0 in tl.range(0, QFULL, BLOCK, num_stages=STAGES):
        dk, dv = _dkv_queries(k, v, dk, dv, q_ptr, dout_ptr + head * D, lse_ptr + sh * T,
                              delta_ptr + sh * T, seq, q0, scale2, T, SB, ST, OB, OT, D, BLOCK,
                              BLOCK_D, DOT, True)
    if TAIL > 0:
        dk, dv = _dkv_queries(k, v, dk, dv, q_ptr, dout_ptr + head * D, lse_ptr + sh * T,
                              delta_ptr + sh * T, seq, QFULL, scale2, T, SB, ST, OB, OT, D,
                              TAIL, BLOCK_D, DOT, False)
    _store(dqkv_ptr + C + head * D + offs, dk * scale, rows, T, D, BLOCK_D, FULL_N)
    _store(dqkv_ptr + 2 * C + head * D + offs, dv, rows, T, D, BLOCK_D, FULL_N)


@triton.jit
def _dkv_kernel(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, scale, scale2,
                T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr,
                OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
                NBLK: tl.constexpr, WIDE: tl.constexpr, DOT: tl.constexpr,
                STAGES: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
                TB: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program ``pid``: dk and dv of key block ``pid % NBLK`` of sequence × head
    ``pid // NBLK``, written into dqkv's k and v columns."""
    blk, sh, seq, head, row0 = _program(H, NBLK, WIDE, BLOCK)
    scale = tl.cast(scale, tl.float32)  # see ._triton: Python floats
    scale2 = tl.cast(scale2, tl.float32)
    if blk < T // BLOCK:
        _dkv_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, seq, sh, head, row0, scale,
                   scale2, T, SB, ST, OB, OT, C, D, BLOCK, BLOCK, TAIL, BLOCK_D, DOT, STAGES, True)
    else:
        _dkv_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, seq, sh, head, row0, scale,
                   scale2, T, SB, ST, OB, OT, C, D, TB, BLOCK, TAIL, BLOCK_D, DOT, STAGES, False)


# ----------------------------------------------------------------------------- custom ops

def _meta(qkv: torch.Tensor, heads: int, batch_second: bool,
          way: str) -> tuple[int, int, dict]:
    """(sequences × heads, blocks a sequence, the kernels' compile-time settings). Constant
    sizes and strides make the address arithmetic multiplies by constants."""
    T, B, C3 = qkv.shape if batch_second else (qkv.shape[1], qkv.shape[0], qkv.shape[2])
    C = C3 // 3
    block = LAUNCH[f"{way}_block"]
    rest = T % block
    tail = 0 if rest == 0 else max(16, triton.next_power_of_2(rest))
    nblk = T // block + (1 if tail else 0)
    SB, ST = (C3, B * C3) if batch_second else (T * C3, C3)
    OB, OT = (C, B * C) if batch_second else (T * C, C)
    meta = dict(T=T, SB=SB, ST=ST, OB=OB, OT=OT, C=C, D=C // heads, H=heads, NBLK=nblk,
                WIDE=qkv.numel() >= WIDE_ELEMENTS,
                DOT=1 if qkv.dtype == torch.float32 else 2 if INTERPRETED else 0,
                STAGES=LAUNCH[f"{way}_stages"], num_warps=LAUNCH[f"{way}_warps"],
                BLOCK=block, TAIL=tail, TB=tail or block,
                BLOCK_D=max(16, triton.next_power_of_2(C // heads)))
    return B * heads, nblk, meta


@op("fasttrain::seq_attention_fwd")
def _fwd(qkv: torch.Tensor, heads: int, scale: float,
         batch_second: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out = qkv.new_empty((*qkv.shape[:-1], qkv.shape[-1] // 3))
    sh, nblk, meta = _meta(qkv, heads, batch_second, "fwd")
    lse = torch.empty((sh, meta["T"]), device=qkv.device, dtype=torch.float32)
    if qkv.numel():
        launch(_fwd_kernel, (sh * nblk,), qkv, out, lse, scale * LOG2E, **meta)
    return out, lse


@op("fasttrain::seq_attention_bwd")
def _bwd(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
         heads: int, scale: float, batch_second: bool) -> torch.Tensor:
    dqkv = torch.empty_like(qkv)
    if qkv.numel():
        sh, nblk, meta = _meta(qkv, heads, batch_second, "bwd")
        delta = torch.empty_like(lse)
        launch(_dq_kernel, (sh * nblk,), qkv, dout, out, lse, dqkv, delta, scale,
               scale * LOG2E, **meta)
        launch(_dkv_kernel, (sh * nblk,), qkv, dout, lse, delta, dqkv, scale, scale * LOG2E,
               **meta)
    return dqkv


def _setup(ctx, inputs, output) -> None:
    qkv, heads, scale, batch_second = inputs
    ctx.heads, ctx.scale, ctx.batch_second = heads, scale, batch_second
    ctx.save_for_backward(qkv, output[0], output[1])


def _backward(ctx, dout, _dlse):
    qkv, out, lse = ctx.saved_tensors
    dqkv = torch.ops.fasttrain.seq_attention_bwd(output_grad(out, dout), qkv, out, lse,
                                                 ctx.heads, ctx.scale, ctx.batch_second)
    return dqkv, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------- public API

def _check(qkv: torch.Tensor, heads: int) -> None:
    if qkv.dtype not in _DTYPES:
        raise ValueError(f"qkv must be float32, bfloat16 or float16, got {qkv.dtype}")
    if qkv.dim() != 3 or heads < 1 or qkv.shape[2] % (3 * heads):
        raise ValueError(f"qkv must be (batch, tokens, 3 * heads * head_dim) with {heads} "
                         f"heads, got shape {tuple(qkv.shape)}")
    head_dim = qkv.shape[2] // (3 * heads)
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} is more than the kernels' 256")


def seq_attention(qkv: torch.Tensor, heads: int, scale: float | None = None,
                  batch_second: bool = False) -> torch.Tensor:
    """Self-attention of every sequence and head: ``qkv`` (B, T, 3·C) — or (T, B, 3·C) with
    ``batch_second`` — as (3, heads, C/heads) on its last dim; ``scale`` defaults to
    head_dim^-½. Returns (B, T, C) (or (T, B, C)) with the heads side by side, in qkv's
    dtype."""
    _check(qkv, heads)
    head_dim = qkv.shape[-1] // (3 * heads)
    scale = head_dim ** -0.5 if scale is None else float(scale)
    out, _ = torch.ops.fasttrain.seq_attention_fwd(qkv.contiguous(), heads, scale,
                                                   bool(batch_second))
    return out


def seq_attention_reference(qkv: torch.Tensor, heads: int, scale: float | None = None,
                            batch_second: bool = False) -> torch.Tensor:
    """Plain-PyTorch ``seq_attention``: fp32 (or wider) scores and softmax, the probabilities
    rounded to qkv's dtype as the kernel does, output in qkv's dtype."""
    x = qkv.transpose(0, 1) if batch_second else qkv
    B, T, C3 = x.shape
    head_dim = C3 // (3 * heads)
    scale = head_dim ** -0.5 if scale is None else scale
    acc = torch.promote_types(qkv.dtype, torch.float32)
    q, k, v = x.to(acc).reshape(B, T, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    p = ((q @ k.transpose(-1, -2)) * scale).softmax(-1).to(qkv.dtype).to(acc)
    out = (p @ v).transpose(1, 2).reshape(B, T, C3 // 3).to(qkv.dtype)
    return out.transpose(0, 1) if batch_second else out

