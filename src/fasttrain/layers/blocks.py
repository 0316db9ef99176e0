"""Pre-norm transformer blocks (ViT, Swin): ``x + attn(norm1(x))``, then ``+ mlp(norm2(·))``.

With fused LayerNorms (``kernels=layernorm``) the residual adds and the biases of the two
branches' last linear layers move into the norms' kernels (``LayerNorm.add(x, residual,
x_bias)``): the attention projection runs without its bias and norm2 adds it with the residual;
the MLP's fc2 runs without its bias and the *next* block's norm1 adds its output, the bias and
the residual before normalizing. Each way that is one pass over the stream instead of an add
kernel, a norm kernel and a bias-gradient reduction over the activations. On the plain path the
blocks compute what they always did. Parameters and their names are unchanged.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

Branch = Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]
"""A block's MLP output and the bias fc2 left out (or None), not yet added to the residual
stream: for the next block's norm1 to add."""


def pre_norm_block(block: nn.Module, x: torch.Tensor, branch: Branch, hand_on: bool,
                   mask: torch.Tensor | None = None) -> tuple[torch.Tensor, Branch]:
    """One block with ``norm1``, ``attn(x, mask, proj_bias)``, ``norm2`` (``layers.norm.LayerNorm``)
    and ``mlp(x, fc2_bias)``. ``branch``: the previous block's, added by norm1. ``hand_on``: a
    next block follows, so on the fused path the MLP branch is returned unadded."""
    if branch is None:
        y = block.norm1(x)
    else:
        y, x = block.norm1.add(branch[0], x, branch[1])
    fuse = block.norm2.takes_bias()
    a = block.attn(y, mask, proj_bias=not fuse)
    y, x = block.norm2.add(a, x, block.attn.proj.bias if fuse else None)
    if hand_on:  # run_blocks hands on only where the norms are fused
        return x, (block.mlp(y, fc2_bias=False), block.mlp.fc2.bias)
    return x + block.mlp(y), None


def block_fp32_params(block: nn.Module) -> list[nn.Parameter]:
    """The biases the fused norms add themselves, outside autocast's casts (bf16 master
    weights leave them fp32, ``techniques/optimizer.py``)."""
    if not block.norm2.takes_bias():
        return []
    return [b for b in (block.attn.proj.bias, block.mlp.fc2.bias) if b is not None]


def run_blocks(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Runs blocks (``block(x, branch, hand_on) -> (x, branch)``, with a ``norm2``) in order;
    each but the last hands its MLP branch on to the next where its norms are fused (elsewhere
    ``hand_on`` stays False, so that compiled blocks see one value and compile once). Not across
    FSDP-sharded blocks: a block's bias may only be read while its parameters are gathered."""
    from torch.distributed.fsdp import FSDPModule

    branch: Branch = None
    for i, blk in enumerate(blocks):
        hand_on = (i + 1 < len(blocks) and blk.norm2.takes_bias()
                   and not isinstance(blk, FSDPModule))
        x, branch = blk(x, branch, hand_on)
    assert branch is None, "the last block adds its own MLP branch"
    return x
