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

IGNORE = -100


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, dtype: torch.dtype):
        needs_grad = hidden.requires_grad or weight.requires_grad
        acc = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            loss = torch.zeros((), dtype=acc, device=hidden.device)
            grad_h = torch.empty_like(hidden) if needs_grad else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) \
                if needs_grad else None
            for s in range(0, h.shape[0], chunk):
                hc, yc = h[s:s + chunk], labels[s:s + chunk]
                logits = (hc @ w.t()).to(acc)  # (c, V) — the only logits alive at a time
                valid = yc != IGNORE
                target = yc.masked_fill(~valid, 0).unsqueeze(1)
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, target).squeeze(1)
                loss = loss + ((lse - picked) * valid).sum()
                if needs_grad:  # d loss / d logits = softmax − one-hot, zero on ignored rows
                    g = torch.exp(logits - lse.unsqueeze(1))
                    g.scatter_add_(1, target, -valid.unsqueeze(1).to(acc))
                    g = (g * valid.unsqueeze(1)).to(dtype)
                    grad_h[s:s + chunk] = (g @ w).to(hidden.dtype)
                    grad_w += (g.t() @ hc).to(acc)
        if needs_grad:
            ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_loss.to(grad_h.dtype), (grad_w * grad_loss).to(ctx.weight_dtype),
                None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk: int = 2048) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100`` ignored).

    ``hidden`` (..., C), ``weight`` (V, C), ``labels`` (...); ``chunk`` tokens at a time."""
    if hidden.shape[-1] != weight.shape[-1] or hidden.shape[:-1] != labels.shape:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)} and labels {tuple(labels.shape)} do not match")
    if chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk must be >= 1, not {chunk}")
    return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                            labels.reshape(-1), chunk, _compute_dtype(hidden))


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor,
                                   labels: torch.Tensor) -> torch.Tensor:
    """The plain path: full logits, then fp32 cross-entropy (summed, ``-100`` ignored)."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE)
