"""The one-kernel backward of ``kernels/seq_attention.py`` for short sequences: one program per
sequence and head writes its dq, dk and dv (and, with SUMS, their column sums).

The two-kernel backward (``_seq_attention_kernels``) recomputes the probabilities and dP twice,
once per block of queries for dq and once per block of keys for dk and dv: seven matmuls a
pair of blocks. Here one program takes every block of its sequence: for each block of keys
(outer loop, k, v, dk and dv in registers) it walks every block of queries and computes
Pᵀ, dv += Pᵀ dO, dPᵀ = v dOᵀ, dSᵀ, dk += dSᵀ q and dq += dS k: five matmuls a pair. dq of
a block of queries is summed over the blocks of keys in an fp32 scratch row block that only
this program reads and writes (no atomics; its ~50 KB stay in L2 at ViT's 197 tokens), and the
last block of keys writes it, scaled and rounded, into dqkv. A barrier between blocks of keys
makes one thread's scratch stores visible to the others. dk and dv are summed as in the
two-kernel path; dq is summed over blocks of keys in the same order, from dS taken as the
transpose of dSᵀ (the two-kernel dq kernel computes dS from q kᵀ, a product that may round
differently in its last bit).

The program first computes its rows' rowsum(dO ∘ O) into ``delta``. It needs sequences × heads
programs to fill the device (1,536 at ViT-B's batch 128); ``seq_attention`` takes this path
where there are that many and a sequence has few blocks."""
from __future__ import annotations

import triton
import triton.language as tl

from ._seq_attention_kernels import (_load, _load_rows, _offsets, _program, _scales, _store,
                                     _store_colsums, _store_rows)
from ._triton import add, tile_dot


@triton.jit
def _delta_block(dout_ptr, out_ptr, delta_ptr, seq, row0, T: tl.constexpr, OB: tl.constexpr,
                 OT: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr, FULL: tl.constexpr):
    """rowsum(dO ∘ O) of rows row0 … row0 + BLOCK_M of one head (pointers at its columns)."""
    offs, rows = _offsets(seq, row0, OB, OT, BLOCK_M, BLOCK_D)
    do = _load(dout_ptr + offs, rows, T, D, BLOCK_D, FULL)
    o = _load(out_ptr + offs, rows, T, D, BLOCK_D, FULL)
    _store_rows(delta_ptr, rows, tl.reduce(do.to(tl.float32) * o.to(tl.float32), 1, add), T,
                FULL)


@triton.jit
def _pair(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, dq_ptr, qparts_ptr, seq, q0,
          first, last, scale, scale2, T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr,
          OB: tl.constexpr, OT: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_D: tl.constexpr, DOT: tl.constexpr, FULL: tl.constexpr, SUMS: tl.constexpr):
    """One block of keys (k, v, its dk and dv) against the block of queries at row q0: dk and
    dv += its share; dq += dS k into the scratch rows at ``acc_ptr`` (``first``: the scratch is
    not read; ``last``: the sum goes, scaled, to dqkv's q columns at ``dq_ptr`` instead, and
    with SUMS its column sums to ``qparts_ptr``). Padded queries: zero rows, probability 0;
    padded keys: zero rows of k, so nothing of theirs reaches dq."""
    offs, rows = _offsets(seq, q0, SB, ST, BLOCK_M, BLOCK_D)
    q = _load(q_ptr + offs, rows, T, D, BLOCK_D, FULL)
    ooffs, _ = _offsets(seq, q0, OB, OT, BLOCK_M, BLOCK_D)
    do = _load(do_ptr + ooffs, rows, T, D, BLOCK_D, FULL)
    lse = _load_rows(lse_ptr, rows, T, float("inf"), FULL)
    delta = _load_rows(delta_ptr, rows, T, 0.0, FULL)
    pt = tl.exp2(tile_dot(k, tl.trans(q), DOT) * scale2 - lse[None, :])
    dv += tile_dot(pt.to(do.dtype), do, DOT)
    dst = (pt * (tile_dot(v, tl.trans(do), DOT) - delta[None, :])).to(q.dtype)
    dk += tile_dot(dst, q, DOT)
    dq = tile_dot(tl.trans(dst), k, DOT)
    aoffs, _ = _offsets(0, q0, 0, D, BLOCK_M, BLOCK_D)
    if not first:
        dq += _load(acc_ptr + aoffs, rows, T, D, BLOCK_D, FULL)
    if last:
        dq *= scale
        _store(dq_ptr + offs, dq, rows, T, D, BLOCK_D, FULL)
        if SUMS:
            _store_colsums(qparts_ptr, dq, rows, T, D, BLOCK_D, FULL)
    else:
        _store(acc_ptr + aoffs, dq, rows, T, D, BLOCK_D, FULL)
    return dk, dv


@triton.jit
def _queries(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, dq_ptr, parts_ptr, seq,
             first, last, scale, scale2, T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr,
             OB: tl.constexpr, OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
             BLOCK: tl.constexpr, TAIL: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
             STAGES: tl.constexpr, SUMS: tl.constexpr):
    """One block of keys against every block of queries: the full ones, then the partial one.
    ``parts_ptr``: the partials' row of this sequence's first block, at this head's q columns."""
    QFULL: tl.constexpr = (T // BLOCK) * BLOCK
    for q0 in tl.range(0, QFULL, BLOCK, num_stages=STAGES):
        dk, dv = _pair(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, dq_ptr,
                       parts_ptr + (q0 // BLOCK) * (3 * C), seq, q0, first, last, scale, scale2,
                       T, SB, ST, OB, OT, D, BLOCK, BLOCK_D, DOT, True, SUMS)
    if TAIL > 0:
        dk, dv = _pair(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, acc_ptr, dq_ptr,
                       parts_ptr + (T // BLOCK) * (3 * C), seq, QFULL, first, last, scale,
                       scale2, T, SB, ST, OB, OT, D, TAIL, BLOCK_D, DOT, False, SUMS)
    return dk, dv


@triton.jit
def _keys(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, acc_ptr, dqkv_ptr, parts_ptr, seq, k0, first,
          last, scale, scale2, T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr,
          OB: tl.constexpr, OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
          BLOCK_D: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr, FULL_N: tl.constexpr,
          SUMS: tl.constexpr):
    """The block of BLOCK_N keys at row k0 against all queries; writes its dk and dv (SUMS:
    and their column sums). Pointers are at this head's q columns."""
    offs, rows = _offsets(seq, k0, SB, ST, BLOCK_N, BLOCK_D)
    k = _load(qkv_ptr + C + offs, rows, T, D, BLOCK_D, FULL_N)
    v = _load(qkv_ptr + 2 * C + offs, rows, T, D, BLOCK_D, FULL_N)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dk, dv = _queries(k, v, dk, dv, qkv_ptr, dout_ptr, lse_ptr, delta_ptr, acc_ptr, dqkv_ptr,
                      parts_ptr, seq, first, last, scale, scale2, T, SB, ST, OB, OT, C, D,
                      BLOCK, TAIL, BLOCK_D, DOT, STAGES, SUMS)
    dk *= scale
    _store(dqkv_ptr + C + offs, dk, rows, T, D, BLOCK_D, FULL_N)
    _store(dqkv_ptr + 2 * C + offs, dv, rows, T, D, BLOCK_D, FULL_N)
    if SUMS:  # padded keys' rows are not 0 here (their k is, not their probabilities)
        kparts = parts_ptr + (k0 // BLOCK) * (3 * C)
        _store_colsums(kparts + C, dk, rows, T, D, BLOCK_D, FULL_N)
        _store_colsums(kparts + 2 * C, dv, rows, T, D, BLOCK_D, FULL_N)
    tl.debug_barrier()  # this block's scratch stores, visible to every thread for the next


@triton.jit
def _dqkv_kernel(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, acc_ptr, parts_ptr,
                 scale, T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr,
                 OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
                 NBLK: tl.constexpr, WIDE: tl.constexpr, DOT: tl.constexpr,
                 STAGES: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
                 TB: tl.constexpr, BLOCK_D: tl.constexpr, SUMS: tl.constexpr):
    """Program ``pid``: dq, dk and dv of sequence × head ``pid`` (all its blocks), written into
    dqkv; its rows' rowsum(dO ∘ O) into ``delta``; ``acc``: (sequences × heads, T, D) fp32
    scratch. SUMS: the column sums of every block's gradient rows into row
    ``sequence · NBLK + block`` of the (B · NBLK, 3 · C) partials of the qkv bias's gradient."""
    _, sh, seq, head, _ = _program(H, 1, WIDE, BLOCK)
    scale, scale2 = _scales(scale)
    qkv_ptr += head * D
    dqkv_ptr += head * D
    dout_ptr += head * D
    out_ptr += head * D
    lse_ptr += sh * T
    delta_ptr += sh * T
    acc_ptr += sh * (T * D)
    parts_ptr += seq * NBLK * (3 * C) + head * D
    FULL: tl.constexpr = (T // BLOCK) * BLOCK
    for r0 in tl.range(0, FULL, BLOCK):
        _delta_block(dout_ptr, out_ptr, delta_ptr, seq, r0, T, OB, OT, D, BLOCK, BLOCK_D, True)
    if TAIL > 0:
        _delta_block(dout_ptr, out_ptr, delta_ptr, seq, FULL, T, OB, OT, D, TB, BLOCK_D, False)
    tl.debug_barrier()
    for k0 in tl.range(0, FULL, BLOCK):
        _keys(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, acc_ptr, dqkv_ptr, parts_ptr, seq, k0,
              k0 == 0, k0 + BLOCK == T, scale, scale2, T, SB, ST, OB, OT, C, D, BLOCK, BLOCK,
              TAIL, BLOCK_D, DOT, STAGES, True, SUMS)
    if TAIL > 0:
        _keys(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, acc_ptr, dqkv_ptr, parts_ptr, seq, FULL,
              FULL == 0, True, scale, scale2, T, SB, ST, OB, OT, C, D, TB, BLOCK, TAIL, BLOCK_D,
              DOT, STAGES, False, SUMS)
