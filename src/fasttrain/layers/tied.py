"""An input embedding tied to the output layer, looked up so that its two gradients meet in one
place.

Where one weight is both the token embedding and the LM head (Llama 3.2, GPT-2), autograd sums
two gradients into it: the head's, a dense GEMM, and the embedding's, the output gradient of each
token's row added at that token's id. Compiled, Inductor builds the second one dense (a
vocabulary × width buffer zeroed, the rows added in fp32, the whole cast to the weight's dtype)
and then lets the head's weight-gradient GEMM add itself to a copy of it: at Llama-3.2-1B's
128,256 × 2,048 three passes over half a GiB, about 0.9 ms a step on an H100.

``tied_lookup(weight, ids)`` returns the rows and the weight again, for the head, from one
autograd node. Its backward receives the head's gradient and adds the rows' gradients to it
in place of the dense buffer: tokens with the same id summed first in fp32 (sorted, one sum
each), then one add a distinct id. Compiled with the head (the whole model, bf16 on a Hopper
GPU or fp32), Inductor lets the head's GEMM write the weight's gradient and adds the rows into
that buffer: nothing is copied. Eager, or compiled apart from the head, the out-of-place add
copies the head's gradient once, as the plain path's sum does. Eager, the adds are the
sort-based, deterministic kind; compiled, Inductor makes them atomic fp32 adds, as it does in
the dense path.

The embedding module's forward is not called, so a lookup whose module carries hooks (a
profiler's, an offloading library's, a technique's) keeps the plain path (``ties``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _TiedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor):
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight), weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor, grad_weight: torch.Tensor):
        (ids,) = ctx.saved_tensors
        flat = ids.reshape(-1)
        return add_rows(grad_weight, flat, grad_rows.reshape(-1, grad_weight.shape[1])), None


def tied_lookup(weight: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.embedding(ids, weight), weight)``, the second for the output layer: the same values
    and gradients as using ``weight`` twice, the embedding's gradient added to the head's rather
    than built dense (see the module's docstring)."""
    return _TiedLookup.apply(weight, ids)


def ties(embedding: nn.Module, weight: torch.Tensor) -> bool:
    """Whether ``weight`` (an output layer's) is ``embedding``'s own and the embedding a plain
    lookup (no padding row kept out of the gradient, no max norm, no scaling by frequency, not
    sparse) without hooks, as ``tied_lookup`` computes it."""
    return (type(embedding) is nn.Embedding and weight is embedding.weight
            and embedding.padding_idx is None and embedding.max_norm is None
            and not embedding.scale_grad_by_freq and not embedding.sparse
            and not hooked(embedding))


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` has forward or backward hooks of its own (a call that goes around its
    forward would skip them)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def add_rows(dense: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``dense`` (V, C) with each ``rows[i]`` (N, C) added at row ``ids[i]``, out of place.

    Equal ids are summed in fp32 first (the ids sorted, each run one segment), then each
    segment's sum is added once in ``dense``'s dtype. The N segment slots past the last distinct
    id hold zeros and point at rows ``k mod V``, spread so that adding their zeros queues no
    atomic adds on one row."""
    n, vocab = ids.numel(), dense.shape[0]
    sorted_ids, order = ids.sort()
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    segment = starts.cumsum(0) - 1  # (N,) the segment of each sorted row
    sums = rows.new_zeros(n, rows.shape[1], dtype=torch.float32)
    sums.index_put_((segment,), rows[order].float(), accumulate=True)
    slots = torch.arange(n, device=ids.device) % vocab
    targets = slots.scatter(0, segment, sorted_ids.to(slots.dtype))  # equal values per segment
    return dense.index_put((targets,), sums.to(dense.dtype), accumulate=True)
