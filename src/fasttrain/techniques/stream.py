"""The residual stream of transformer blocks carried in bf16 (``stream_dtype=bf16``).

Under bf16 autocast a pre-norm model's residual stream stays fp32: the embedding (plus fp32
position embeddings) starts it in fp32, and every ``x + branch`` promotes the bf16 branch back
to fp32. Every residual add and norm then reads and writes 4-byte activations, and the
backward carries an fp32 gradient along the stream. With ``stream_dtype=bf16`` the model casts
the stream to bf16 where it starts (after the embeddings), so the adds, the fused
add + LayerNorm kernels and their backwards move half the bytes; the norms still compute their
statistics in fp32. Megatron-LM trains this way by default (``--fp32-residual-connection`` is
its opt-in), as does every run whose parameters are bf16 (FSDP2's ``param_dtype=bf16``).

When it helps: transformer models whose non-matmul time is the residual adds and norms (ViT-B
on an H200: the fused add + LayerNorm forward and backward move a third fewer bytes).
Numerics: the stream is rounded to bf16 (8 mantissa bits) after every add, so the loss curve
moves within bf16's rounding; the parity gate checks it. Needs precision=bf16-mixed; with
bf16-true the stream is bf16 already. Models say whether they carry a stream
(``stream_dtype`` attribute: ViT, Swin, Llama); others are left as they are, with a warning.
"""
from __future__ import annotations

import torch

from ..layers.fused import StreamCarrier
from .base import Phase, Technique, TrainState


def apply(state: TrainState) -> str | None:
    # the recipe's validation allows bf16 only with bf16-mixed or bf16-true
    if state.recipe.precision == "bf16-true":
        state.idle("stream_dtype", "bf16-true keeps the whole model in bf16; the residual "
                   "stream is bf16 already")
        return None
    carriers = [m for m in state.model.modules() if isinstance(m, StreamCarrier)]
    if not carriers:
        hint = ("; set convert=true to swap its public classes for fasttrain's layers"
                if state.workload.converts and not state.recipe.convert else "")
        state.idle("stream_dtype", f"{type(state.model).__name__} has no residual stream that "
                   f"fasttrain carries (ViT, Swin and Llama do); nothing changed{hint}")
        return None
    for m in carriers:
        m.stream_dtype = torch.bfloat16
    names = ", ".join(sorted({type(m).__name__ for m in carriers}))
    return f"the residual stream of {names} in bf16 from the embeddings on (norms in fp32)"


TECHNIQUE = Technique(
    name="stream_dtype", phase=Phase.STREAM, summary="the residual stream in bf16 under bf16-mixed",
    changes_numerics=True, apply=apply, active=lambda r: r.stream_dtype != "auto",
    example={"precision": "bf16-mixed", "stream_dtype": "bf16"})
