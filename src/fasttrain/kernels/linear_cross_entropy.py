"""Linear + cross-entropy in chunks of tokens: the (tokens × vocabulary) logits never exist whole.

An LLM's last step, ``cross_entropy(hidden @ Wᵀ, labels)``, materialises logits of tokens ×
vocabulary (Llama-3.2: 8,192 × 128,256 — 2.1 GB in bf16, 4.2 GB again in fp32 for the loss) plus
their gradient. Here the tokens go through in chunks: each chunk's logits are computed, turned
into its loss and straight into the gradient of its logits (softmax − one-hot), which is
multiplied out into the gradients of the hidden states and the weight at once; then the chunk's
logits are dropped. Backward only scales the stored gradients by the incoming one. The GEMMs
are the same three as the plain path; what goes is the memory of the full logits and the
memory-bound passes over them.

Numerics: as the plain path under autocast — the logits GEMM in the compute dtype, softmax and
log-sum-exp in fp32; only the summation order of the loss and of the weight gradient differ.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

IGNORE = -100


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, dtype: torch.dtype,
                want_h: bool, want_w: bool, vocab: int):
        needs_grad = want_h or want_w
        acc = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            loss = torch.zeros((), dtype=acc, device=hidden.device)
            grad_h = torch.empty_like(hidden) if want_h else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) \
                if want_w else None
            for s in range(0, h.shape[0], chunk):
                hc, yc = h[s:s + chunk], labels[s:s + chunk]
                logits = (hc @ w.t()).to(acc)  # (c, V) — the only logits alive at a time
                if vocab < logits.shape[1]:  # padded rows of the weight: no class, no gradient
                    logits[:, vocab:] = float("-inf")
                valid = yc != IGNORE
                target = yc.masked_fill(~valid, 0).unsqueeze(1)
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, target).squeeze(1)
                loss = loss + ((lse - picked) * valid).sum()
                if needs_grad:  # d loss / d logits = softmax − one-hot, zero on ignored rows
                    g = torch.exp(logits - lse.unsqueeze(1))
                    g.scatter_add_(1, target, -valid.unsqueeze(1).to(acc))
                    g = (g * valid.unsqueeze(1)).to(dtype)
                    if want_h:
                        grad_h[s:s + chunk] = (g @ w).to(hidden.dtype)
                    if want_w:
                        grad_w += (g.t() @ hc).to(acc)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        # the scale (1 / the step's item count) multiplies in fp32, then rounds once
        dh = None if grad_h is None else (
            grad_h.to(torch.promote_types(grad_h.dtype, torch.float32)) * grad_loss
        ).to(grad_h.dtype)
        dw = None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk: int = 2048, vocab: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100`` ignored).

    ``hidden`` (..., C), ``weight`` (V, C), ``labels`` (...); ``chunk`` tokens at a time.
    ``vocab``: the classes are the first ``vocab`` rows of the weight, the rest padding."""
    if hidden.shape[-1] != weight.shape[-1] or hidden.shape[:-1] != labels.shape:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)} and labels {tuple(labels.shape)} do not match")
    if chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk must be >= 1, not {chunk}")
    vocab = weight.shape[0] if vocab is None else vocab
    if not 0 < vocab <= weight.shape[0]:
        raise ValueError(f"linear_cross_entropy: vocab {vocab} is not in 1..{weight.shape[0]}")
    grad = torch.is_grad_enabled()  # inside Function.forward grad mode is always off
    return _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk,
        _compute_dtype(hidden), grad and hidden.requires_grad, grad and weight.requires_grad,
        vocab)


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor,
                                   labels: torch.Tensor, vocab: int | None = None
                                   ) -> torch.Tensor:
    """The plain path: full logits, then fp32 cross-entropy (summed, ``-100`` ignored); with
    ``vocab``, the logits of the weight's rows past it (padding) are left out."""
    logits = F.linear(hidden, weight)[..., :vocab]
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE)
