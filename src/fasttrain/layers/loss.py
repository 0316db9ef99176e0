"""The language-model head and its loss: ``cross_entropy(hidden @ Wᵀ, labels)``, summed.

Plain: full logits, then fp32 cross-entropy. Fused (the ``kernels=fused`` switch): chunks of
tokens through ``kernels.linear_cross_entropy``, so the tokens × vocabulary logits never exist
whole. The head's weight stays where it is (``lm_head``; tied to the embedding in Llama 3.2).
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference


class LMHeadLoss(nn.Module):
    """No parameters of its own: the model passes its head's weight at every call."""

    fused_kind = "loss"

    def __init__(self, chunk: int = 2048):
        super().__init__()
        self.chunk, self.fused = chunk, False

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return [f"linear + cross-entropy in chunks of {self.chunk} tokens"]

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return linear_cross_entropy(hidden, weight, labels, self.chunk)
        return linear_cross_entropy_reference(hidden, weight, labels)
