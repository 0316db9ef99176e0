"""The last block on the class token alone, where the head reads nothing else.

A ViT whose head pools by its class token (timm's ``global_pool="token"``, fasttrain's ViT with
``pool="cls"``) reads one token of its last block's output: the other 196 of ViT-B/16's 197 are
computed and thrown away. In that block only the class token's query, its attention row, the
output projection, the second norm and the MLP are needed; every token's keys and values still
are. :func:`keep_head_tokens` marks the last block (``head_rows``, read by
``layers.blocks.pre_norm_block``) so that it computes the class token alone: about 83% of one
block's matmul FLOPs, 7% of ViT-B's. The logits are those of the whole model (the same
arithmetic on the token the head reads; GEMMs of another shape may round differently).

Models of other heads keep every token: an average over the tokens (Swin, ``pool="avg"``),
attention pooling, a batch-second stream, blocks not converted to fasttrain's (the ``kernels``
rung converts them), a ViT whose forward is your own (fasttrain cannot tell what its head
reads) — :func:`keep_head_tokens` says which, and changes nothing.

A marked block returns (B, 1, C): a forward hook on it sees that, and so does anything that reads
the blocks' output other than the head (timm's ``forward_features``, ``forward_intermediates``).
A timm block called with an attention mask runs timm's own path and every token.
"""
from __future__ import annotations

from torch import nn

from ..converters.registry import class_path
from ..layers.attention import SelfAttention
from ..workloads.vit import ViT

VIT = ("timm.models.vision_transformer.VisionTransformer",)


def _head_reads_class_token(model: nn.Module) -> str | None:
    """Why ``model`` (a ViT) needs every token of its last block, or None where its head reads
    the class token alone."""
    if isinstance(model, ViT):
        if model.pool != "cls":
            return f"its head averages the tokens (pool={model.pool!r})"
        if model.batch_second:
            return "its stream is batch-second"
        return None
    if getattr(model, "attn_pool", None) is not None:
        return "its head pools the tokens by attention"
    if getattr(model, "global_pool", None) != "token":
        return f"its head pools the tokens ({getattr(model, 'global_pool', None)!r})"
    return None


def _last_block(model: nn.Module) -> nn.Module | None:
    """The last block of ``model.blocks`` where it is one of fasttrain's pre-norm blocks with
    fasttrain's self-attention (a converted timm block, or fasttrain's ViT's own), else None."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)) or not len(blocks):
        return None
    last = blocks[-1]
    if not (isinstance(getattr(last, "attn", None), SelfAttention)
            and hasattr(last, "norm2") and hasattr(last, "mlp")):
        return None
    return last


def keep_head_tokens(model: nn.Module) -> dict:
    """Mark the last block of every ViT in ``model`` whose head reads the class token alone
    to compute that token only: ``{"blocks": how many were marked, "line": what it did, or
    why not, in one line}``."""
    vits = [m for m in model.modules() if class_path(m) in VIT or isinstance(m, ViT)]
    if not vits:
        return {"blocks": 0, "line": "every token kept: no ViT of timm's or fasttrain's in the "
                "model (other models, and a ViT whose forward is your own, keep every token)"}
    lines, marked = [], 0
    for vit in vits:
        why = _head_reads_class_token(vit)
        last = _last_block(vit) if why is None else None
        if why is None and last is None:
            why = "its blocks are not fasttrain's (convert them first: the kernels rung)"
        if why is not None:
            lines.append(f"every token kept: {why}")
            continue
        last.head_rows = 1
        marked += 1
        lines.append(f"the last of {len(vit.blocks)} blocks computes the class token alone "
                     "(the head reads nothing else)")
    return {"blocks": marked, "line": "; ".join(lines)}
