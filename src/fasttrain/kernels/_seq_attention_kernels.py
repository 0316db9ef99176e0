"""The Triton kernels of ``kernels/seq_attention.py`` (which documents what they compute and
the layouts they read): the forward, and the backward's dq and dk/dv kernels. Every program
takes one block of rows of one sequence and head: the full blocks of BLOCK rows, then the
partial one of TAIL rows (TB: TAIL, or BLOCK where there is none), each a branch compiled
for its own block size."""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton import add, maximum, tile_dot

_LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): the scores go through exp2

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
def _mask(rows, T: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, FULL: tl.constexpr):
    """Which elements of a BLOCK × BLOCK_D tile exist: rows < T (all of them where FULL) and
    columns < D."""
    rmask = (rows >= 0) if FULL else (rows < T)
    return rmask[:, None] & (tl.arange(0, BLOCK_D) < D)[None, :]


@triton.jit
def _load(ptrs, rows, T: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
          FULL: tl.constexpr):
    """A BLOCK × BLOCK_D tile at ``ptrs``; rows ≥ T and columns ≥ D (padding) read as 0.
    FULL: every row exists (with D == BLOCK_D, no mask at all)."""
    if FULL and D == BLOCK_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=_mask(rows, T, D, BLOCK_D, FULL), other=0.0)


@triton.jit
def _store_colsums(ptr, value, rows, T: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   FULL: tl.constexpr):
    """Store the column sums of an fp32 gradient tile's existing rows at ``ptr``: one
    program's share of the qkv projection bias's gradient."""
    if not FULL:
        value = tl.where((rows < T)[:, None], value, 0.0)
    dcols = tl.arange(0, BLOCK_D)
    tl.store(ptr + dcols, tl.reduce(value, 0, add), mask=dcols < D)


@triton.jit
def _store(ptrs, value, rows, T: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
           FULL: tl.constexpr):
    """Store ``value``'s existing rows and columns at ``ptrs`` (see ``_load``)."""
    value = value.to(ptrs.dtype.element_ty)
    if FULL and D == BLOCK_D:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=_mask(rows, T, D, BLOCK_D, FULL))


@triton.jit
def _load_rows(ptr, rows, T: tl.constexpr, other, FULL: tl.constexpr):
    """One fp32 per row (log-sum-exp, rowsum(dO ∘ O)); rows ≥ T read as ``other``."""
    if FULL:
        return tl.load(ptr + rows)
    else:
        return tl.load(ptr + rows, mask=rows < T, other=other)


@triton.jit
def _store_rows(ptr, rows, value, T: tl.constexpr, FULL: tl.constexpr):
    """Store one fp32 per existing row (see ``_load_rows``)."""
    if FULL:
        tl.store(ptr + rows, value)
    else:
        tl.store(ptr + rows, value, mask=rows < T)


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
def _scales(scale):
    """(scale, scale · log2 e) in fp32: the scores go through exp2. Python floats arrive as
    fp64 (see ._triton)."""
    scale = tl.cast(scale, tl.float32)
    return scale, scale * _LOG2E


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
    _store_rows(lse_ptr + sh * T, rows, m + tl.log2(l), T, FULL_M)


@triton.jit
def _fwd_kernel(qkv_ptr, out_ptr, lse_ptr, scale, T: tl.constexpr, SB: tl.constexpr,
                ST: tl.constexpr, OB: tl.constexpr, OT: tl.constexpr, C: tl.constexpr,
                D: tl.constexpr, H: tl.constexpr, NBLK: tl.constexpr, WIDE: tl.constexpr,
                DOT: tl.constexpr, STAGES: tl.constexpr, BLOCK: tl.constexpr,
                TAIL: tl.constexpr, TB: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program ``pid`` takes block ``pid % NBLK`` of queries (the full blocks of BLOCK rows,
    then a partial one of TAIL; TB is TAIL, or BLOCK where there is none) of sequence × head
    ``pid // NBLK``."""
    blk, sh, seq, head, row0 = _program(H, NBLK, WIDE, BLOCK)
    _, scale2 = _scales(scale)
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
def _dq_block(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, parts_ptr, seq, sh,
              head, row0, scale, scale2, T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr,
              OB: tl.constexpr, OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
              BLOCK_D: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr,
              FULL_M: tl.constexpr, SUMS: tl.constexpr):
    """dq and rowsum(dO ∘ O) of query rows row0 … row0 + BLOCK_M (SUMS: and dq's column sums
    at ``parts_ptr``). Padded rows: q and dO are 0, so their dS is 0."""
    head_ptr = qkv_ptr + head * D
    offs, rows = _offsets(seq, row0, SB, ST, BLOCK_M, BLOCK_D)
    q = _load(head_ptr + offs, rows, T, D, BLOCK_D, FULL_M)
    ooffs, _ = _offsets(seq, row0, OB, OT, BLOCK_M, BLOCK_D)
    do = _load(dout_ptr + head * D + ooffs, rows, T, D, BLOCK_D, FULL_M)
    o = _load(out_ptr + head * D + ooffs, rows, T, D, BLOCK_D, FULL_M)
    delta = tl.reduce(do.to(tl.float32) * o.to(tl.float32), 1, add)
    lse = _load_rows(lse_ptr + sh * T, rows, T, 0.0, FULL_M)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    KFULL: tl.constexpr = (T // BLOCK) * BLOCK
    for k0 in tl.range(0, KFULL, BLOCK, num_stages=STAGES):
        dq = _dq_keys(q, do, lse, delta, dq, head_ptr + C, seq, k0, scale2, T, SB, ST, C, D,
                      BLOCK, BLOCK_D, DOT, True)
    if TAIL > 0:
        dq = _dq_keys(q, do, lse, delta, dq, head_ptr + C, seq, KFULL, scale2, T, SB, ST, C,
                      D, TAIL, BLOCK_D, DOT, False)
    dq *= scale
    _store(dqkv_ptr + head * D + offs, dq, rows, T, D, BLOCK_D, FULL_M)
    _store_rows(delta_ptr + sh * T, rows, delta, T, FULL_M)
    if SUMS:
        _store_colsums(parts_ptr + head * D, dq, rows, T, D, BLOCK_D, FULL_M)


@triton.jit
def _dq_kernel(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, parts_ptr, scale,
               T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr,
               OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
               NBLK: tl.constexpr, WIDE: tl.constexpr, DOT: tl.constexpr,
               STAGES: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
               TB: tl.constexpr, BLOCK_D: tl.constexpr, SUMS: tl.constexpr):
    """Program ``pid``: dq of query block ``pid % NBLK`` of sequence × head ``pid // NBLK``,
    written into dqkv's q columns, and its rows' rowsum(dO ∘ O) for the dk/dv kernel.
    SUMS: dq's column sums too, into row ``sequence · NBLK + block`` of the (B · NBLK, 3 · C)
    partials of the qkv bias's gradient."""
    blk, sh, seq, head, row0 = _program(H, NBLK, WIDE, BLOCK)
    scale, scale2 = _scales(scale)
    parts_ptr += (seq * NBLK + blk) * (3 * C)
    if blk < T // BLOCK:
        _dq_block(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, parts_ptr, seq, sh,
                  head, row0, scale, scale2, T, SB, ST, OB, OT, C, D, BLOCK, BLOCK, TAIL,
                  BLOCK_D, DOT, STAGES, True, SUMS)
    else:
        _dq_block(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, parts_ptr, seq, sh,
                  head, row0, scale, scale2, T, SB, ST, OB, OT, C, D, TB, BLOCK, TAIL, BLOCK_D,
                  DOT, STAGES, False, SUMS)


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
    lse = _load_rows(lse_ptr, rows, T, float("inf"), FULL)
    delta = _load_rows(delta_ptr, rows, T, 0.0, FULL)
    pt = tl.exp2(tile_dot(k, tl.trans(q), DOT) * scale2 - lse[None, :])
    dv += tile_dot(pt.to(do.dtype), do, DOT)
    dst = pt * (tile_dot(v, tl.trans(do), DOT) - delta[None, :])
    dk += tile_dot(dst.to(q.dtype), q, DOT)
    return dk, dv


@triton.jit
def _dkv_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, parts_ptr, seq, sh, head,
               row0, scale, scale2, T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr,
               OB: tl.constexpr, OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
               BLOCK_D: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr,
               FULL_N: tl.constexpr, SUMS: tl.constexpr):
    """dk and dv of key rows row0 … row0 + BLOCK_N of one sequence and head, over the full
    blocks of BLOCK queries, then the partial one of TAIL (SUMS: and their column sums at
    ``parts_ptr``)."""
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
    dk *= scale
    _store(dqkv_ptr + C + head * D + offs, dk, rows, T, D, BLOCK_D, FULL_N)
    _store(dqkv_ptr + 2 * C + head * D + offs, dv, rows, T, D, BLOCK_D, FULL_N)
    if SUMS:  # padded keys' rows are not 0 here (their k is, not their probabilities)
        _store_colsums(parts_ptr + C + head * D, dk, rows, T, D, BLOCK_D, FULL_N)
        _store_colsums(parts_ptr + 2 * C + head * D, dv, rows, T, D, BLOCK_D, FULL_N)


@triton.jit
def _dkv_kernel(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, parts_ptr, scale,
                T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr,
                OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
                NBLK: tl.constexpr, WIDE: tl.constexpr, DOT: tl.constexpr,
                STAGES: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
                TB: tl.constexpr, BLOCK_D: tl.constexpr, SUMS: tl.constexpr):
    """Program ``pid``: dk and dv of key block ``pid % NBLK`` of sequence × head
    ``pid // NBLK``, written into dqkv's k and v columns (SUMS: as in ``_dq_kernel``)."""
    blk, sh, seq, head, row0 = _program(H, NBLK, WIDE, BLOCK)
    scale, scale2 = _scales(scale)
    parts_ptr += (seq * NBLK + blk) * (3 * C)
    if blk < T // BLOCK:
        _dkv_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, parts_ptr, seq, sh, head,
                   row0, scale, scale2, T, SB, ST, OB, OT, C, D, BLOCK, BLOCK, TAIL, BLOCK_D,
                   DOT, STAGES, True, SUMS)
    else:
        _dkv_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, parts_ptr, seq, sh, head,
                   row0, scale, scale2, T, SB, ST, OB, OT, C, D, TB, BLOCK, TAIL, BLOCK_D, DOT,
                   STAGES, False, SUMS)
