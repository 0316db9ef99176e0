"""Your model, served by one rung of the inference ladder, in your own process.

``fasttrain.serve(model, rung="captured")`` does to ``model`` what the ladder's rung does to a
workload's model (``model.prepare``): dtype and device, fused attention, fasttrain's layers in
place of the library's, fp8 or INT8 linears, fc1's bias and GELU in its GEMM, ``torch.compile``
and fasttrain's own CUDA graphs. It returns a :class:`Served` forward whose ``applied`` says what
each step did, in the words of the ladder's rows.

The model is changed in place (cast, converted, its parameters frozen under inference mode):
serve a copy of a model you still train. A call takes one tensor, a batch: a floating-point
input is cast to the rung's dtype, any other (uint8 images, token ids) is passed as it is, and
both are moved to the rung's device. Which rung pays on your model, and what it costs in
accuracy, is what ``fasttrain infer`` measures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..errors import FasttrainError
from .model import check_device, prepare
from .spec import RUNGS, InferRung, nothing_added


@dataclass
class Served:
    """A prepared forward: ``served(x)`` runs it under ``torch.inference_mode``."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    rung: InferRung
    applied: dict[str, Any]
    """What each step of the rung did (filled in further by the first call at a new shape,
    for ``capture``)."""
    device: torch.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise FasttrainError(f"a served model takes one tensor (a batch), not "
                                 f"{type(x).__name__}")
        dtype = getattr(torch, self.rung.dtype) if x.is_floating_point() else x.dtype
        with torch.inference_mode():
            return self.forward(x.to(self.device, dtype, non_blocking=True))


def _rung(rung: str | InferRung) -> InferRung:
    if isinstance(rung, InferRung):
        return rung
    if rung not in RUNGS:
        raise FasttrainError(f"unknown inference rung {rung!r}: use one of {', '.join(RUNGS)}")
    return RUNGS[rung]


def serve(model: nn.Module, rung: str | InferRung = "captured",
          device: str | torch.device | None = None) -> Served:
    """``model`` prepared in place as ``rung`` asks (a name of the ladder's rungs, or your own
    :class:`InferRung`), on ``device`` (default: the GPU where there is one)."""
    if not isinstance(model, nn.Module):
        raise FasttrainError(f"serve takes a torch.nn.Module, not {type(model).__name__}")
    r = _rung(rung)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise FasttrainError(f"device {dev}: this machine has no CUDA GPU; serve on "
                                 "device='cpu'")
        if dev.index is None:  # pinned now, not whichever GPU is current at each call
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise FasttrainError(f"device {dev}: this machine has {torch.cuda.device_count()} "
                                 "GPU(s), numbered from 0")
    why = check_device(r, dev)
    if why is not None:
        raise FasttrainError(f"rung {r.name} cannot serve on {dev}: {why}; pick a rung that "
                             "runs there (eager-fp32, eager-fp16 or sdpa run anywhere)")
    with torch.inference_mode():
        forward, applied = prepare(model.eval(), r, dev)
    if why := nothing_added(r, applied):
        raise FasttrainError(f"rung {r.name} adds nothing to {type(model).__name__} ({why}); "
                             "serve it with the rung before (the model was already cast and "
                             "converted in place: build it again)")
    return Served(forward, r, applied, dev)
