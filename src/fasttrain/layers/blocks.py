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

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .linear import bias_apart

Branch = Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]
"""A block's MLP output and the bias fc2 left out (or None), not yet added to the residual
stream: for the next block's norm1 to add."""


Post = Optional[tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]]
"""What a block does to its attention and MLP branches before adding them to the stream (a
public model's layer scale and stochastic depth), or None."""


def pre_norm_block(block: nn.Module, x: torch.Tensor, branch: Branch, hand_on: bool,
                   mask: torch.Tensor | None = None, post: Post = None
                   ) -> tuple[torch.Tensor, Branch]:
    """One block with ``norm1``, ``attn(x, mask, proj_bias)``, ``norm2`` (``layers.norm.LayerNorm``)
    and ``mlp(x, fc2_bias)``. ``branch``: the previous block's, added by norm1. ``hand_on``: a
    next block follows, so on the fused path the MLP branch is returned unadded. ``post``: the
    functions applied to the attention and MLP branches before they are added; the branches
    then keep their biases (the norms still add them to the stream). A block with
    ``head_rows`` set (``inference/head_tokens.py``: the last block of a model whose head reads
    the first tokens alone) computes and returns those tokens only, (B, head_rows, C)."""
    if branch is None:
        y = block.norm1(x)
    else:
        y, x = block.norm1.add(branch[0], x, branch[1])
    fuse = biases_apart(block) and post is None
    rows = getattr(block, "head_rows", 0)
    if rows:  # only the first tokens go on: their queries over every token's keys and values
        a = block.attn.first_queries(y, rows, proj_bias=not fuse)
        x = x[:, :rows].contiguous()
    else:
        a = block.attn(y, mask, proj_bias=not fuse)
    if post is not None:
        a = post[0](a)
    y, x = block.norm2.add(a, x, block.attn.proj.bias if fuse else None)
    if post is not None:
        m = post[1](block.mlp(y))
        return (x, (m, None)) if hand_on else (x + m, None)
    if hand_on:  # run_blocks hands on only where the norms are fused
        return x, (block.mlp(y, fc2_bias=False), block.mlp.fc2.bias)
    return x + block.mlp(y), None


def biases_apart(block: nn.Module) -> bool:
    """Whether the block's fused norms add the attention projection's and fc2's biases: on the
    fused path, where both layers run their matmul apart from the bias (``bias_apart``: not a
    layer another library wrapped after the conversion, which runs whole)."""
    return (block.norm2.takes_bias() and bias_apart(block.attn.proj)
            and bias_apart(block.mlp.fc2))


def block_fp32_params(block: nn.Module, post: Post = None) -> list[nn.Parameter]:
    """The biases the fused norms add themselves, outside autocast's casts (bf16 master
    weights leave them fp32, ``techniques/optimizer.py``); none where ``post`` keeps them in
    the branches."""
    if not biases_apart(block) or post is not None:
        return []
    return [b for b in (block.attn.proj.bias, block.mlp.fc2.bias) if b is not None]


def run_blocks(blocks: Sequence[nn.Module], x: torch.Tensor, links: bool = False) -> torch.Tensor:
    """Runs blocks (``block(x, branch, hand_on) -> (x, branch)``, with a ``norm2``; with
    ``links``, :class:`ChainLink` blocks called by keyword) in order;
    each but the last hands its MLP branch on to the next where its norms are fused (elsewhere
    ``hand_on`` stays False, so that compiled blocks see one value and compile once). Not across
    FSDP-sharded blocks: a block's bias may only be read while its parameters are gathered."""
    from torch.distributed.fsdp import FSDPModule

    branch: Branch = None
    for i, blk in enumerate(blocks):
        hand_on = (i + 1 < len(blocks) and (blk.hands_on() if links else biases_apart(blk))
                   and not isinstance(blk, FSDPModule))
        if links:
            x, branch = blk(x, branch=branch, hand_on=hand_on, chained=True)
        else:
            x, branch = blk(x, branch, hand_on)
    assert branch is None, "the last block adds its own MLP branch"
    return x


class ChainLink:
    """A pre-norm block of a public model converted in place (``fasttrain.convert``): its forward
    keeps the library's signature and returns a tensor, and, called with ``chained=True``,
    takes and returns the ``branch`` as ``pre_norm_block`` does, for :class:`ChainedBlocks`."""

    def hands_on(self) -> bool:
        """Whether, followed by another block, it hands its MLP branch on unadded (where the
        next block's first norm adds it in its fused kernel)."""
        return biases_apart(self)


def chainable(module: nn.Module) -> bool:
    return isinstance(module, ChainLink)


class ChainedBlocks(nn.Sequential):
    """An ``nn.Sequential`` of :class:`ChainLink` blocks (a converted timm model's ``blocks``)
    run as ``run_blocks`` runs them: on fused norms each block's MLP branch is added by the next
    block's first norm. Carries the residual stream in ``stream_dtype`` where set (the
    ``stream_dtype`` technique). Iterating it, indexing it and its state dict are those of the
    ``nn.Sequential`` it was. Where a block has forward hooks the blocks run one by one, so each
    hook gets the block's output as the ``nn.Sequential`` gave it."""

    stream_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stream_dtype is not None:
            x = x.to(self.stream_dtype)
        if any(b._forward_hooks or b._forward_pre_hooks for b in self):
            for b in self:  # a hook sees each block's own output, as the stack gave it
                x = b(x)
            return x
        return run_blocks(self, x, links=True)
