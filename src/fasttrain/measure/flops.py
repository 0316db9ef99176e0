"""FLOP counting helpers shared by the loop and the peers."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def gqa_flop_formulas():
    """Let FlopCounterMode count grouped-query attention (HF Llama calls sdpa with 8 k/v heads for
    32 query heads, ``enable_gqa``). torch ≤ 2.12's formulas assert equal heads; count it as if
    k/v were repeated to the query heads, as torch 2.13 does. A no-op where torch already can."""
    from torch.utils import flop_counter as fc

    fwd, bwd = getattr(fc, "sdpa_flop_count", None), getattr(fc, "sdpa_backward_flop_count", None)
    try:
        needed = fwd is not None and bwd is not None and not fwd((1, 2, 3, 4), (1, 1, 3, 4), (1, 1, 3, 4))
    except AssertionError:
        needed = True

    def heads_of_q(q, kv):  # (B, H_kv, S, D) → (B, H_q, S, D)
        return (kv[0], q[1], kv[2], kv[3])

    if needed:
        fc.sdpa_flop_count = lambda q, k, v: fwd(q, heads_of_q(q, k), heads_of_q(q, v))
        fc.sdpa_backward_flop_count = lambda g, q, k, v: bwd(g, q, heads_of_q(q, k), heads_of_q(q, v))
    try:
        yield
    finally:
        if needed:
            fc.sdpa_flop_count, fc.sdpa_backward_flop_count = fwd, bwd


def flop_counter():
    """``FlopCounterMode(display=False)`` that also counts ``bmm`` with an ``out_dtype`` (16-bit
    inputs, fp32 output: ``layers.attention.gemm_attention``): torch's formula for ``bmm`` takes
    the dtype for the output's shape and raises (torch 2.11 on the H200, 2.13 here)."""
    from torch.utils import flop_counter as fc

    def bmm(a_shape, b_shape, *_dtype, out_shape=None, **kwargs):
        return fc.bmm_flop(a_shape, b_shape)

    return fc.FlopCounterMode(display=False, custom_mapping={torch.ops.aten.bmm: bmm})
