"""The one-launch AdamW's Triton launches: the step (AdamW + clip factor + EMA, every tensor in
one launch), the clip norm's sums of squares, and the copy of the tensor table from pinned host
memory. ``optim.adamw.FlatAdamW`` is the optimizer that owns the state and calls them; its
docstring says what is fused, how the table works under CUDA graphs, and the numerics.
"""
from __future__ import annotations

import math

import torch
import triton

from ._adamw_step import _adamw_step, _fetch_table, _grad_sumsq

__all__ = ["LAUNCH", "NORM_LAUNCH", "adamw_step", "fetch_table", "grad_sumsq"]

LAUNCH = {"block": 1024, "warps": 4}
"""Elements and warps per program of the step kernel: 1,024 x 4 measured fastest of
1,024/2,048/4,096 on the H200 for SD, Llama-1B and ViT-B weights
(kernels-micro-optimizer-20261121-0952)."""

NORM_LAUNCH = {"block": 1024, "chunks": 8, "warps": 4}
"""The clip norm's sums of squares: ``chunks`` blocks of ``block`` elements a program, one
after another. Over SD's master-weights gradients (mostly bf16) on an H200, CUDA-graph replay:
0.589 ms against torch's multi-tensor norm's 0.727 (Llama-1B: 0.892 against 1.099); one block a
program 0.750, one block of 8,192 0.946 (clip-norm-micro-20261122-1020)."""


def fetch_table(host: torch.Tensor, table: torch.Tensor, ptrs: list[int]) -> None:
    """Write ``ptrs`` into the pinned ``host`` table and launch the copy of it into the device
    ``table``: under a CUDA-graph capture the copy is a node that reads ``host`` at replay."""
    host.copy_(torch.tensor(ptrs, dtype=torch.int64))
    n = table.numel()
    _fetch_table[(triton.cdiv(n, 1024),)](host.data_ptr(), table, n, BLOCK=1024)


def grad_sumsq(table: torch.Tensor, n_tensors: int, norm_tensor: torch.Tensor,
               norm_start: torch.Tensor, numel: torch.Tensor, increments: torch.Tensor,
               partials: torch.Tensor, origin: torch.Tensor, anchor: torch.Tensor,
               half: bool) -> torch.Tensor:
    """fp32 sums of squares of the gradients in ``table`` over ``NORM_LAUNCH``'s blocks, one
    partial a program into ``partials`` (``programs(norm_tensor.numel())`` of them); fp32
    gradients addressed from ``origin``, bf16 ones from ``anchor``."""
    chunks = norm_tensor.numel()
    _grad_sumsq[(partials.numel(),)](
        table, n_tensors, chunks, norm_tensor, norm_start, numel, increments, partials, origin,
        anchor, HALF=half, CHUNKS=NORM_LAUNCH["chunks"], BLOCK=NORM_LAUNCH["block"],
        num_warps=NORM_LAUNCH["warps"])
    return partials


def norm_programs(chunks: int) -> int:
    """Programs of :func:`grad_sumsq` over ``chunks`` blocks."""
    return triton.cdiv(chunks, NORM_LAUNCH["chunks"])


def adamw_step(table: torch.Tensor, n_tensors: int, chunk_tensor: torch.Tensor,
               chunk_start: torch.Tensor, numel: torch.Tensor, offsets: torch.Tensor,
               steps: torch.Tensor, increments: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, ema: torch.Tensor | None, coef: torch.Tensor | None,
               master: torch.Tensor | None, origin: torch.Tensor, anchor: torch.Tensor,
               lr: torch.Tensor, betas: tuple[float, float], eps: float, weight_decay: float,
               ema_weight: float) -> None:
    """One launch over every block of every tensor (``chunk_tensor``/``chunk_start``): AdamW
    with the clip factor ``coef`` applied in registers, the EMA lerp and, with ``master``, the
    bf16 weights written back from their fp32 masters. fp32 weights and gradients are
    addressed from ``origin`` (an fp32 tensor), bf16 ones from ``anchor``. Moments in bf16
    (``exp_avg``'s dtype) are rounded stochastically. ``lr`` is a one-element fp32 device
    tensor, read by the kernel at every launch (and every replay)."""
    beta1, beta2 = betas
    dummy = origin
    _adamw_step[(chunk_tensor.numel(),)](
        table, n_tensors, chunk_tensor, chunk_start, numel, offsets, steps, increments, exp_avg,
        exp_avg_sq, ema if ema is not None else dummy, coef if coef is not None else dummy,
        master if master is not None else dummy, origin, anchor, lr, float(beta1),
        float(beta2), math.log2(beta1), math.log2(beta2), float(eps), float(weight_decay),
        ema_weight, HAS_CLIP=coef is not None, HAS_EMA=ema is not None,
        HALF=master is not None, STATE16=exp_avg.dtype == torch.bfloat16,
        BLOCK=LAUNCH["block"], num_warps=LAUNCH["warps"])
