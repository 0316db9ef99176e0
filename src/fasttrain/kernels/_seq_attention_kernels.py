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
def _fwd_update(q, k, v, cols, m, l, acc, scale2, T: tl.constexpr, DOT: tl.constexpr,
                FULL: tl.constexpr):
    """The online softmax of one tile of queries over one block of keys (k, v loaded)."""
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
def _fwd_keys(q, q2, k_ptr, seq, k0, m, l, acc, m2, l2, acc2, scale2, T: tl.constexpr,
              SB: tl.constexpr, ST: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
              FULL: tl.constexpr, EXTRA: tl.constexpr):
    """One block of keys of the online softmax, for the tile q and (EXTRA) the tile q2;
    ``k_ptr`` points at this head's k columns."""
    offs, cols = _offsets(seq, k0, SB, ST, BLOCK_N, BLOCK_D)
    k = _load(k_ptr + offs, cols, T, D, BLOCK_D, FULL)
    v = _load(k_ptr + C + offs, cols, T, D, BLOCK_D, FULL)
    m, l, acc = _fwd_update(q, k, v, cols, m, l, acc, scale2, T, DOT, FULL)
    if EXTRA > 0:
        m2, l2, acc2 = _fwd_update(q2, k, v, cols, m2, l2, acc2, scale2, T, DOT, FULL)
    return m, l, acc, m2, l2, acc2


@triton.jit
def _fwd_init(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Running max, sum and output of an online softmax over ROWS queries."""
    return (tl.full((ROWS,), float("-inf"), tl.float32), tl.zeros((ROWS,), tl.float32),
            tl.zeros((ROWS, BLOCK_D), tl.float32))


@triton.jit
def _fwd_store(out_ptr, lse_ptr, seq, row0, m, l, acc, T: tl.constexpr, OB: tl.constexpr,
               OT: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
               FULL: tl.constexpr):
    """Output rows row0 … row0 + ROWS and their log-sum-exps (log2 units)."""
    offs, rows = _offsets(seq, row0, OB, OT, ROWS, BLOCK_D)
    _store(out_ptr + offs, acc / l[:, None], rows, T, D, BLOCK_D, FULL)
    _store_rows(lse_ptr, rows, m + tl.log2(l), T, FULL)


@triton.jit
def _fwd_block(qkv_ptr, out_ptr, lse_ptr, seq, sh, head, row0, scale2, T: tl.constexpr,
               SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr, OT: tl.constexpr,
               C: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
               TAIL: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
               STAGES: tl.constexpr, FULL_M: tl.constexpr, EXTRA: tl.constexpr):
    """Output rows row0 … row0 + BLOCK_M of one sequence and head and their log-sum-exps
    (log2 units), over the full blocks of BLOCK keys, then the partial one of TAIL. EXTRA:
    the partial block of EXTRA rows after them too, alongside (each block of keys loaded once
    for both)."""
    head_ptr = qkv_ptr + head * D
    offs, rows = _offsets(seq, row0, SB, ST, BLOCK_M, BLOCK_D)
    q = _load(head_ptr + offs, rows, T, D, BLOCK_D, FULL_M)
    m, l, acc = _fwd_init(BLOCK_M, BLOCK_D)
    if EXTRA > 0:
        offs2, rows2 = _offsets(seq, row0 + BLOCK_M, SB, ST, EXTRA, BLOCK_D)
        q2 = _load(head_ptr + offs2, rows2, T, D, BLOCK_D, False)
        m2, l2, acc2 = _fwd_init(EXTRA, BLOCK_D)
    else:
        q2, m2, l2, acc2 = q, m, l, acc
    KFULL: tl.constexpr = (T // BLOCK) * BLOCK
    for k0 in tl.range(0, KFULL, BLOCK, num_stages=STAGES):
        m, l, acc, m2, l2, acc2 = _fwd_keys(q, q2, head_ptr + C, seq, k0, m, l, acc, m2, l2,
                                            acc2, scale2, T, SB, ST, C, D, BLOCK, BLOCK_D, DOT,
                                            True, EXTRA)
    if TAIL > 0:
        m, l, acc, m2, l2, acc2 = _fwd_keys(q, q2, head_ptr + C, seq, KFULL, m, l, acc, m2, l2,
                                            acc2, scale2, T, SB, ST, C, D, TAIL, BLOCK_D, DOT,
                                            False, EXTRA)
    _fwd_store(out_ptr + head * D, lse_ptr + sh * T, seq, row0, m, l, acc, T, OB, OT, D,
               BLOCK_M, BLOCK_D, FULL_M)
    if EXTRA > 0:
        _fwd_store(out_ptr + head * D, lse_ptr + sh * T, seq, row0 + BLOCK_M, m2, l2, acc2, T,
                   OB, OT, D, EXTRA, BLOCK_D, False)


@triton.jit
def _fwd_kernel(qkv_ptr, out_ptr, lse_ptr, scale, T: tl.constexpr, SB: tl.constexpr,
                ST: tl.constexpr, OB: tl.constexpr, OT: tl.constexpr, C: tl.constexpr,
                D: tl.constexpr, H: tl.constexpr, NBLK: tl.constexpr, WIDE: tl.constexpr,
                DOT: tl.constexpr, STAGES: tl.constexpr, BLOCK: tl.constexpr,
                TAIL: tl.constexpr, TB: tl.constexpr, BLOCK_D: tl.constexpr,
                NPROG: tl.constexpr):
    """Program ``pid`` takes block ``pid % NPROG`` of queries (the full blocks of BLOCK rows,
    then a partial one of TAIL; TB is TAIL, or BLOCK where there is none) of sequence × head
    ``pid // NPROG``. NPROG = NBLK - 1: the program of the last full block takes the partial
    one too (a second tile of rows against the same loads of keys); else NPROG = NBLK."""
    blk, sh, seq, head, row0 = _program(H, NPROG, WIDE, BLOCK)
    _, scale2 = _scales(scale)
    if NPROG < NBLK:  # the last full block's program takes the partial one too
        if blk < NPROG - 1:
            _fwd_block(qkv_ptr, out_ptr, lse_ptr, seq, sh, head, row0, scale2, T, SB, ST, OB,
                       OT, C, D, BLOCK, BLOCK, TAIL, BLOCK_D, DOT, STAGES, True, 0)
        else:
            _fwd_block(qkv_ptr, out_ptr, lse_ptr, seq, sh, head, row0, scale2, T, SB, ST, OB,
                       OT, C, D, BLOCK, BLOCK, TAIL, BLOCK_D, DOT, STAGES, True, TAIL)
    elif blk < T // BLOCK:
        _fwd_block(qkv_ptr, out_ptr, lse_ptr, seq, sh, head, row0, scale2, T, SB, ST, OB, OT,
                   C, D, BLOCK, BLOCK, TAIL, BLOCK_D, DOT, STAGES, True, 0)
    else:
        _fwd_block(qkv_ptr, out_ptr, lse_ptr, seq, sh, head, row0, scale2, T, SB, ST, OB, OT,
                   C, D, TB, BLOCK, TAIL, BLOCK_D, DOT, STAGES, False, 0)


@triton.jit
def _dq_update(q, do, lse, delta, dq, k, v, scale2, DOT: tl.constexpr):
    """dq += dS k for one tile of queries over one block of keys (k, v loaded)."""
    p = tl.exp2(tile_dot(q, tl.trans(k), DOT) * scale2 - lse[:, None])
    ds = p * (tile_dot(do, tl.trans(v), DOT) - delta[:, None])
    return dq + tile_dot(ds.to(k.dtype), k, DOT)


@triton.jit
def _dq_keys(q, do, lse, delta, dq, q2, do2, lse2, delta2, dq2, k_ptr, seq, k0, scale2,
             T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr, C: tl.constexpr,
             D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             DOT: tl.constexpr, FULL: tl.constexpr, EXTRA: tl.constexpr):
    """dq += dS k over one block of keys (EXTRA: dq2 too, for the second tile). Padded keys
    are zero rows of k: they add nothing."""
    offs, cols = _offsets(seq, k0, SB, ST, BLOCK_N, BLOCK_D)
    k = _load(k_ptr + offs, cols, T, D, BLOCK_D, FULL)
    v = _load(k_ptr + C + offs, cols, T, D, BLOCK_D, FULL)
    dq = _dq_update(q, do, lse, delta, dq, k, v, scale2, DOT)
    if EXTRA > 0:
        dq2 = _dq_update(q2, do2, lse2, delta2, dq2, k, v, scale2, DOT)
    return dq, dq2


@triton.jit
def _dq_rows(qkv_ptr, dout_ptr, out_ptr, lse_ptr, seq, row0, T: tl.constexpr,
             SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr, OT: tl.constexpr,
             D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, FULL: tl.constexpr):
    """q, dO, log-sum-exps and rowsum(dO ∘ O) of query rows row0 … row0 + ROWS (pointers at
    this head's columns), and the rows."""
    offs, rows = _offsets(seq, row0, SB, ST, ROWS, BLOCK_D)
    q = _load(qkv_ptr + offs, rows, T, D, BLOCK_D, FULL)
    ooffs, _ = _offsets(seq, row0, OB, OT, ROWS, BLOCK_D)
    do = _load(dout_ptr + ooffs, rows, T, D, BLOCK_D, FULL)
    o = _load(out_ptr + ooffs, rows, T, D, BLOCK_D, FULL)
    delta = tl.reduce(do.to(tl.float32) * o.to(tl.float32), 1, add)
    lse = _load_rows(lse_ptr, rows, T, 0.0, FULL)
    return q, do, lse, delta


@triton.jit
def _dq_store(dqkv_ptr, delta_ptr, parts_ptr, seq, row0, dq, delta, scale, T: tl.constexpr,
              SB: tl.constexpr, ST: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_D: tl.constexpr, FULL: tl.constexpr, SUMS: tl.constexpr):
    """dq (scaled) and rowsum(dO ∘ O) of rows row0 … row0 + ROWS; SUMS: dq's column sums."""
    offs, rows = _offsets(seq, row0, SB, ST, ROWS, BLOCK_D)
    dq *= scale
    _store(dqkv_ptr + offs, dq, rows, T, D, BLOCK_D, FULL)
    _store_rows(delta_ptr, rows, delta, T, FULL)
    if SUMS:
        _store_colsums(parts_ptr, dq, rows, T, D, BLOCK_D, FULL)


@triton.jit
def _dq_block(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, parts_ptr, seq, sh,
              head, row0, scale, scale2, T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr,
              OB: tl.constexpr, OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
              BLOCK_D: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr,
              FULL_M: tl.constexpr, SUMS: tl.constexpr, EXTRA: tl.constexpr):
    """dq and rowsum(dO ∘ O) of query rows row0 … row0 + BLOCK_M (SUMS: and dq's column sums
    at ``parts_ptr``); EXTRA: of the partial block of EXTRA rows after them too (its sums in
    the partials' next row). Padded rows: q and dO are 0, so their dS is 0."""
    head_ptr = qkv_ptr + head * D
    q, do, lse, delta = _dq_rows(head_ptr, dout_ptr + head * D, out_ptr + head * D,
                                 lse_ptr + sh * T, seq, row0, T, SB, ST, OB, OT, D, BLOCK_M,
                                 BLOCK_D, FULL_M)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if EXTRA > 0:
        q2, do2, lse2, delta2 = _dq_rows(head_ptr, dout_ptr + head * D, out_ptr + head * D,
                                         lse_ptr + sh * T, seq, row0 + BLOCK_M, T, SB, ST, OB,
                                         OT, D, EXTRA, BLOCK_D, False)
        dq2 = tl.zeros((EXTRA, BLOCK_D), tl.float32)
    else:
        q2, do2, lse2, delta2, dq2 = q, do, lse, delta, dq
    KFULL: tl.constexpr = (T // BLOCK) * BLOCK
    for k0 in tl.range(0, KFULL, BLOCK, num_stages=STAGES):
        dq, dq2 = _dq_keys(q, do, lse, delta, dq, q2, do2, lse2, delta2, dq2, head_ptr + C,
                           seq, k0, scale2, T, SB, ST, C, D, BLOCK, BLOCK_D, DOT, True, EXTRA)
    if TAIL > 0:
        dq, dq2 = _dq_keys(q, do, lse, delta, dq, q2, do2, lse2, delta2, dq2, head_ptr + C,
                           seq, KFULL, scale2, T, SB, ST, C, D, TAIL, BLOCK_D, DOT, False,
                           EXTRA)
    _dq_store(dqkv_ptr + head * D, delta_ptr + sh * T, parts_ptr + head * D, seq, row0, dq,
              delta, scale, T, SB, ST, D, BLOCK_M, BLOCK_D, FULL_M, SUMS)
    if EXTRA > 0:
        _dq_store(dqkv_ptr + head * D, delta_ptr + sh * T, parts_ptr + 3 * C + head * D, seq,
                  row0 + BLOCK_M, dq2, delta2, scale, T, SB, ST, D, EXTRA, BLOCK_D, False,
                  SUMS)


@triton.jit
def _dq_kernel(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, parts_ptr, scale,
               T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr,
               OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
               NBLK: tl.constexpr, WIDE: tl.constexpr, DOT: tl.constexpr,
               STAGES: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
               TB: tl.constexpr, BLOCK_D: tl.constexpr, SUMS: tl.constexpr,
               NPROG: tl.constexpr):
    """Program ``pid``: dq of query block ``pid % NPROG`` of sequence × head ``pid // NPROG``
    (NPROG as in ``_fwd_kernel``), written into dqkv's q columns, and its rows'
    rowsum(dO ∘ O) for the dk/dv kernel. SUMS: dq's column sums too, into row
    ``sequence · NBLK + block`` of the (B · NBLK, 3 · C) partials of the qkv bias's
    gradient."""
    blk, sh, seq, head, row0 = _program(H, NPROG, WIDE, BLOCK)
    scale, scale2 = _scales(scale)
    parts_ptr += (seq * NBLK + blk) * (3 * C)
    if NPROG < NBLK:  # the last full block's program takes the partial one too
        if blk < NPROG - 1:
            _dq_block(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, parts_ptr, seq,
                      sh, head, row0, scale, scale2, T, SB, ST, OB, OT, C, D, BLOCK, BLOCK,
                      TAIL, BLOCK_D, DOT, STAGES, True, SUMS, 0)
        else:
            _dq_block(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, parts_ptr, seq,
                      sh, head, row0, scale, scale2, T, SB, ST, OB, OT, C, D, BLOCK, BLOCK,
                      TAIL, BLOCK_D, DOT, STAGES, True, SUMS, TAIL)
    elif blk < T // BLOCK:
        _dq_block(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, parts_ptr, seq, sh,
                  head, row0, scale, scale2, T, SB, ST, OB, OT, C, D, BLOCK, BLOCK, TAIL,
                  BLOCK_D, DOT, STAGES, True, SUMS, 0)
    else:
        _dq_block(qkv_ptr, dout_ptr, out_ptr, lse_ptr, dqkv_ptr, delta_ptr, parts_ptr, seq, sh,
                  head, row0, scale, scale2, T, SB, ST, OB, OT, C, D, TB, BLOCK, TAIL, BLOCK_D,
                  DOT, STAGES, False, SUMS, 0)


@triton.jit
def _dkv_update(k, v, dk, dv, q, do, lse, delta, scale2, DOT: tl.constexpr):
    """dk, dv += one tile of queries' share for one tile of keys, from the transposed
    probabilities."""
    pt = tl.exp2(tile_dot(k, tl.trans(q), DOT) * scale2 - lse[None, :])
    dv += tile_dot(pt.to(do.dtype), do, DOT)
    dst = pt * (tile_dot(v, tl.trans(do), DOT) - delta[None, :])
    dk += tile_dot(dst.to(q.dtype), q, DOT)
    return dk, dv


@triton.jit
def _dkv_queries(k, v, dk, dv, k2, v2, dk2, dv2, q_ptr, do_ptr, lse_ptr, delta_ptr, seq, q0,
                 scale2, T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr,
                 OB: tl.constexpr, OT: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT: tl.constexpr, FULL: tl.constexpr,
                 EXTRA: tl.constexpr):
    """dk, dv (EXTRA: and dk2, dv2 of the second tile of keys) += one block of queries'
    share. Padded queries are zero rows with an infinite log-sum-exp: probability 0."""
    offs, rows = _offsets(seq, q0, SB, ST, BLOCK_M, BLOCK_D)
    q = _load(q_ptr + offs, rows, T, D, BLOCK_D, FULL)
    ooffs, _ = _offsets(seq, q0, OB, OT, BLOCK_M, BLOCK_D)
    do = _load(do_ptr + ooffs, rows, T, D, BLOCK_D, FULL)
    lse = _load_rows(lse_ptr, rows, T, float("inf"), FULL)
    delta = _load_rows(delta_ptr, rows, T, 0.0, FULL)
    dk, dv = _dkv_update(k, v, dk, dv, q, do, lse, delta, scale2, DOT)
    if EXTRA > 0:
        dk2, dv2 = _dkv_update(k2, v2, dk2, dv2, q, do, lse, delta, scale2, DOT)
    return dk, dv, dk2, dv2


@triton.jit
def _dkv_store(dqkv_ptr, parts_ptr, seq, row0, dk, dv, scale, T: tl.constexpr,
               SB: tl.constexpr, ST: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
               ROWS: tl.constexpr, BLOCK_D: tl.constexpr, FULL: tl.constexpr,
               SUMS: tl.constexpr):
    """dk (scaled) and dv of key rows row0 … row0 + ROWS (pointers at this head's q
    columns); SUMS: their column sums."""
    offs, rows = _offsets(seq, row0, SB, ST, ROWS, BLOCK_D)
    dk *= scale
    _store(dqkv_ptr + C + offs, dk, rows, T, D, BLOCK_D, FULL)
    _store(dqkv_ptr + 2 * C + offs, dv, rows, T, D, BLOCK_D, FULL)
    if SUMS:  # padded keys' rows are not 0 here (their k is, not their probabilities)
        _store_colsums(parts_ptr + C, dk, rows, T, D, BLOCK_D, FULL)
        _store_colsums(parts_ptr + 2 * C, dv, rows, T, D, BLOCK_D, FULL)


@triton.jit
def _dkv_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, parts_ptr, seq, sh, head,
               row0, scale, scale2, T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr,
               OB: tl.constexpr, OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
               BLOCK_D: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr,
               FULL_N: tl.constexpr, SUMS: tl.constexpr, EXTRA: tl.constexpr):
    """dk and dv of key rows row0 … row0 + BLOCK_N of one sequence and head, over the full
    blocks of BLOCK queries, then the partial one of TAIL (SUMS: and their column sums at
    ``parts_ptr``); EXTRA: of the partial block of EXTRA keys after them too (its sums in the
    partials' next row)."""
    q_ptr = qkv_ptr + head * D
    offs, rows = _offsets(seq, row0, SB, ST, BLOCK_N, BLOCK_D)
    k = _load(q_ptr + C + offs, rows, T, D, BLOCK_D, FULL_N)
    v = _load(q_ptr + 2 * C + offs, rows, T, D, BLOCK_D, FULL_N)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    if EXTRA > 0:
        offs2, rows2 = _offsets(seq, row0 + BLOCK_N, SB, ST, EXTRA, BLOCK_D)
        k2 = _load(q_ptr + C + offs2, rows2, T, D, BLOCK_D, False)
        v2 = _load(q_ptr + 2 * C + offs2, rows2, T, D, BLOCK_D, False)
        dk2 = tl.zeros((EXTRA, BLOCK_D), tl.float32)
        dv2 = tl.zeros((EXTRA, BLOCK_D), tl.float32)
    else:
        k2, v2, dk2, dv2 = k, v, dk, dv
    QFULL: tl.constexpr = (T // BLOCK) * BLOCK
    for q0 in tl.range(0, QFULL, BLOCK, num_stages=STAGES):
        dk, dv, dk2, dv2 = _dkv_queries(k, v, dk, dv, k2, v2, dk2, dv2, q_ptr,
                                        dout_ptr + head * D, lse_ptr + sh * T,
                                        delta_ptr + sh * T, seq, q0, scale2, T, SB, ST, OB, OT,
                                        D, BLOCK, BLOCK_D, DOT, True, EXTRA)
    if TAIL > 0:
        dk, dv, dk2, dv2 = _dkv_queries(k, v, dk, dv, k2, v2, dk2, dv2, q_ptr,
                                        dout_ptr + head * D, lse_ptr + sh * T,
                                        delta_ptr + sh * T, seq, QFULL, scale2, T, SB, ST, OB,
                                        OT, D, TAIL, BLOCK_D, DOT, False, EXTRA)
    _dkv_store(dqkv_ptr + head * D, parts_ptr + head * D, seq, row0, dk, dv, scale,
               T, SB, ST, C, D, BLOCK_N, BLOCK_D, FULL_N, SUMS)
    if EXTRA > 0:
        _dkv_store(dqkv_ptr + head * D, parts_ptr + 3 * C + head * D, seq,
                   row0 + BLOCK_N, dk2, dv2, scale, T, SB, ST, C, D, EXTRA, BLOCK_D, False,
                   SUMS)


@triton.jit
def _dkv_kernel(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, parts_ptr, scale,
                T: tl.constexpr, SB: tl.constexpr, ST: tl.constexpr, OB: tl.constexpr,
                OT: tl.constexpr, C: tl.constexpr, D: tl.constexpr, H: tl.constexpr,
                NBLK: tl.constexpr, WIDE: tl.constexpr, DOT: tl.constexpr,
                STAGES: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
                TB: tl.constexpr, BLOCK_D: tl.constexpr, SUMS: tl.constexpr,
                NPROG: tl.constexpr):
    """Program ``pid``: dk and dv of key block ``pid % NPROG`` of sequence × head
    ``pid // NPROG`` (NPROG as in ``_fwd_kernel``), written into dqkv's k and v columns (SUMS:
    as in ``_dq_kernel``)."""
    blk, sh, seq, head, row0 = _program(H, NPROG, WIDE, BLOCK)
    scale, scale2 = _scales(scale)
    parts_ptr += (seq * NBLK + blk) * (3 * C)
    if NPROG < NBLK:  # the last full block's program takes the partial one too
        if blk < NPROG - 1:
            _dkv_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, parts_ptr, seq, sh,
                       head, row0, scale, scale2, T, SB, ST, OB, OT, C, D, BLOCK, BLOCK, TAIL,
                       BLOCK_D, DOT, STAGES, True, SUMS, 0)
        else:
            _dkv_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, parts_ptr, seq, sh,
                       head, row0, scale, scale2, T, SB, ST, OB, OT, C, D, BLOCK, BLOCK, TAIL,
                       BLOCK_D, DOT, STAGES, True, SUMS, TAIL)
    elif blk < T // BLOCK:
        _dkv_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, parts_ptr, seq, sh, head,
                   row0, scale, scale2, T, SB, ST, OB, OT, C, D, BLOCK, BLOCK, TAIL, BLOCK_D,
                   DOT, STAGES, True, SUMS, 0)
    else:
        _dkv_block(qkv_ptr, dout_ptr, lse_ptr, delta_ptr, dqkv_ptr, parts_ptr, seq, sh, head,
                   row0, scale, scale2, T, SB, ST, OB, OT, C, D, TB, BLOCK, TAIL, BLOCK_D, DOT,
                   STAGES, False, SUMS, 0)
