"""Shape padding for variable-length batches: pad the sequence length up to a multiple of N.

When it helps: items of varying length (documents, captions) make every batch a new shape, so a
compiled model recompiles (or falls back to dynamic shapes) and the caching allocator keeps
freeing and re-reserving blocks of new sizes. Rounding the padded length up to a multiple of N
leaves at most max_len / N shapes (N = max_len: one). Numerics: none — padded positions carry
the ignored label and sit after every real token of a causal model; the loss is divided by the
real item count. The cost is the padded positions' compute.
"""
from __future__ import annotations

import functools

from ..workloads.data import pad_collate
from .base import Phase, Technique, TrainState


def apply(state: TrainState) -> str | None:
    n, fields = state.recipe.pad_multiple, dict(state.workload.pad_fields)
    if not fields:
        state.idle("padding", f"{state.workload.name} batches have no variable-length fields; "
                              "pad_multiple ignored")
        return None
    cap = getattr(state.workload, "max_length", None)
    state.collate = functools.partial(pad_collate, fields=fields, multiple=n, max_len=cap)
    capped = f", at most {cap}" if cap is not None and cap % n else ""
    return f"{', '.join(fields)} padded to a multiple of {n} tokens{capped}"


TECHNIQUE = Technique(
    name="padding", phase=Phase.PADDING, summary="pad variable-length batches to a multiple of N",
    changes_numerics=False, apply=apply, active=lambda r: r.pad_multiple > 0,
    example={"pad_multiple": 8})
