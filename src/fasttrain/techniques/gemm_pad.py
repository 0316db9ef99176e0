"""GEMM-friendly widths (``gemm_pad=N``): output widths that are not a multiple of N padded up.

What: every plain ``nn.Linear`` whose ``out_features`` is not a multiple of N becomes a
``layers.linear.PaddedLinear`` (class swap: same parameters, names and hooks), whose forward
pads the weight (and bias) with zero rows to the next multiple and slices the extra outputs
off; a layer that computes an LM head's loss from the weight itself (``LMHeadLoss``) pads the
vocabulary the same way and masks the padded logits out of the softmax. The parameters keep
their shapes, so checkpoints, optimizer state and sharding see the model unchanged.

When it helps: tensor-core GEMMs want leading dimensions that are multiples of 8 elements
(16 bytes in bf16) and tiles of 64-256; a 50,257-token vocabulary (GPT-2's) or 1,000 classes
give cuBLAS narrower or masked tiles for the largest GEMM of an LLM (nanoGPT pads its
vocabulary to 50,304 for this). Widths already multiples of N are left alone, and so are
widths the padding would grow by more than 1/16 (``MAX_EXTRA``): the reference workloads change
nothing at N=8 (ViT's and Swin's 1,000 classes, Llama-3.2's 128,256 tokens); at N=64 ViT's and
Swin's heads go to 1,024.
Numerics: none — the padded rows are zeros, their outputs are never read and their
gradients are dropped by the padding's backward. The cost is the padding's extra columns of
compute and, without compile, a copy of the weight at every forward (under compile it fuses
into autocast's cast of the weight). Input widths are not padded: that would copy the
activations. Applied after the FLOP probe (model FLOPs are the unpadded model's) and fp8
(which leaves heads and embeddings alone), before checkpointing and compile.
"""
from __future__ import annotations

from torch import nn

from ..layers.linear import PaddedLinear
from .base import Phase, Technique, TrainState


MAX_EXTRA = 1 / 16
"""The most padding worth its compute, as a share of the width: 1,000 → 1,024 (2.4%) and
50,257 → 50,304 (0.1%) are padded; 96 → 128 (33%) or a width below the multiple is not."""


def _worth(width: int, multiple: int) -> bool:
    return 0 < -width % multiple <= width * MAX_EXTRA


def odd_widths(model: nn.Module, multiple: int) -> list[tuple[str, nn.Module, int]]:
    """(label, layer, width) of every GEMM output width off the multiple that is worth padding
    (``MAX_EXTRA``): plain ``nn.Linear`` layers, and layers that name GEMM widths of their own
    (``gemm_widths``: an LM head's loss, which computes the head's matmul itself)."""
    out = []
    for name, m in model.named_modules():
        name = name or type(m).__name__
        if type(m) is nn.Linear and _worth(m.out_features, multiple):
            out.append((name, m, m.out_features))
        elif callable(getattr(m, "gemm_widths", None)):
            out += [(f"{name} {k}", m, v) for k, v in m.gemm_widths().items()
                    if _worth(v, multiple)]
    return out


def pad_linears(model: nn.Module, multiple: int) -> list[str]:
    """Pad every width ``odd_widths`` finds: a linear layer becomes a ``PaddedLinear``, a layer
    with widths of its own is told to pad them (``pad_gemm``). What was padded."""
    done = []
    for label, m, width in odd_widths(model, multiple):
        padded = width + -width % multiple
        if type(m) is nn.Linear:
            m.__class__ = PaddedLinear
            m.padded = padded
        else:
            m.pad_gemm(multiple)
        done.append(f"{label} {width} → {padded}")
    return done


def apply(state: TrainState) -> str | None:
    n = state.recipe.gemm_pad
    done = pad_linears(state.model, n)
    if not done:
        state.idle("gemm_pad", f"no linear output width of {state.workload.name} is off a "
                               f"multiple of {n} by at most 1/16 of itself; nothing padded")
        return None
    more = f", {len(done) - 4} more" if len(done) > 4 else ""
    return f"output widths padded to a multiple of {n}: {', '.join(done[:4])}{more}"


TECHNIQUE = Technique(
    name="gemm_pad", phase=Phase.GEMM_PAD, summary="pad odd GEMM output widths to a multiple of N",
    changes_numerics=False, apply=apply, active=lambda r: r.gemm_pad > 0,
    example={"gemm_pad": 8})
