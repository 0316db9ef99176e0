"""The language-model head and its loss: ``cross_entropy(hidden @ Wᵀ, labels)``, summed.

Plain: full logits, then fp32 cross-entropy. Fused (the ``kernels=loss`` switch): the whole
logits, whose gradient the loss's Triton kernel writes in the forward
(``kernels.cross_entropy``); or, built with ``chunk=N``, chunks of N tokens through
``kernels.linear_cross_entropy``, so the tokens × vocabulary logits never exist whole (less
memory, more passes). The head's weight stays where it is (``lm_head``; tied to the embedding in
Llama 3.2).
With ``gemm_pad`` the vocabulary is padded to a multiple of N for the GEMMs (zero rows of the
weight, added at every call; their logits masked out of the loss): an odd vocabulary (50,257)
gives cuBLAS unaligned leading dimensions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cross_entropy import linear_cross_entropy_fused
from ..kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from .fused import FusedPath


class LMHeadLoss(FusedPath, nn.Module):
    """No parameters of its own: the model passes its head's weight at every call."""

    fused_kind = "loss"

    def __init__(self, chunk: int = 0, vocab: int | None = None):
        super().__init__()
        self.chunk, self.fused, self.vocab = chunk, False, vocab
        self.fused_triton = chunk == 0  # the whole-logits path is a Triton kernel
        self.pad_multiple = 0  # set by techniques/gemm_pad.py

    def gemm_widths(self) -> dict[str, int]:
        """The output widths of this layer's GEMMs that ``gemm_pad`` may pad (the vocabulary,
        where the model said it)."""
        return {} if self.vocab is None else {"vocabulary": self.vocab}

    def pad_gemm(self, multiple: int) -> None:
        self.pad_multiple = multiple

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        if self.chunk:
            return [f"linear + cross-entropy in chunks of {self.chunk} tokens"]
        return ["linear + cross-entropy, the logits' gradient written by the loss's kernel"]

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        vocab = weight.shape[0]
        extra = -vocab % self.pad_multiple if self.pad_multiple else 0
        if extra:
            weight = F.pad(weight, (0, 0, 0, extra))  # (vocab + extra, C): zero rows
        if self.fused and self.chunk:
            return linear_cross_entropy(hidden, weight, labels, self.chunk, vocab=vocab)
        if self.fused:
            return linear_cross_entropy_fused(hidden, weight, labels, vocab=vocab)
        return linear_cross_entropy_reference(hidden, weight, labels, vocab=vocab)
