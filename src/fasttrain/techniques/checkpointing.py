"""Activation checkpointing: keep fewer activations, recompute them in the backward.

``full`` recomputes each repeated block's forward in the backward (only block inputs stay
alive); ``selective`` keeps the outputs of matmuls and attention and recomputes the cheap
elementwise and norm ops in between (torch's selective-checkpoint policy), so most of the memory
saving comes at a fraction of the recompute. ``checkpoint_every=k`` wraps every k-th block only.
When it helps: activations dominate the peak (large batch, long sequences). Numerics: identical
(the same ops recomputed with the same inputs; no dropout in these workloads). Model FLOPs are
counted without the recomputation.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.nn.attention import _cur_sdpa_kernel_backends, sdpa_kernel
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from .base import Phase, Technique, TrainState

# Ops whose outputs selective checkpointing keeps: the expensive ones to recompute.
_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten.convolution.default,
         torch.ops.aten._scaled_dot_product_flash_attention.default,
         torch.ops.aten._scaled_dot_product_efficient_attention.default,
         torch.ops.aten._scaled_dot_product_cudnn_attention.default,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(selective: bool):
    """Forward and recompute contexts. The recompute runs inside backward, outside the step's
    sdpa_kernel context, so the SDPA backends of the forward are re-entered for it (else the
    recompute may pick another kernel and its saved tensors no longer match). Autocast state is
    restored by torch's checkpoint itself."""
    backends = _cur_sdpa_kernel_backends(with_priority=True)
    fwd, rec = (create_selective_checkpoint_contexts(_policy) if selective
                else (contextlib.nullcontext(), contextlib.nullcontext()))
    @contextlib.contextmanager
    def recompute():
        with sdpa_kernel(backends, set_priority=True), rec:
            yield

    return fwd, recompute()


def _wrap(block: nn.Module, selective: bool) -> None:
    inner = block.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # frozen parts and eval: nothing to save
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False,
                          context_fn=functools.partial(_contexts, selective), **kwargs)

    block.forward = forward


def _trainable(block: nn.Module) -> bool:
    return any(p.requires_grad for p in block.parameters())


def apply(state: TrainState) -> str | None:
    r = state.recipe
    blocks = [b for b in state.workload.regional_blocks(state.model) if _trainable(b)]
    if not blocks:
        state.idle("checkpointing", "no repeated trainable blocks found; nothing checkpointed")
        return None
    chosen = blocks[:: r.checkpoint_every]
    for block in chosen:
        _wrap(block, selective=r.checkpointing == "selective")
    return (f"{r.checkpointing} checkpointing of {len(chosen)}/{len(blocks)} blocks"
            + (" (matmul/attention outputs kept)" if r.checkpointing == "selective" else ""))


TECHNIQUE = Technique(
    name="checkpointing", phase=Phase.CHECKPOINTING, summary="activation checkpointing: full | selective",
    changes_numerics=False, apply=apply, active=lambda r: r.checkpointing != "none",
    example={"checkpointing": "selective"})
