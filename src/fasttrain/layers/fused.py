"""What a layer with a fused path offers, and what a model carrying a bf16 residual stream or
channels-last image inputs offers: the small typed protocols through which techniques switch
fused paths on, so that the choice of kernel stays inside ``layers/``.

A layer with a fused path (``FusedLayer``) names its family in ``fused_kind`` (the ``kernels``
switch's names, ``recipe.KERNEL_FAMILIES``), says whether that path is a Triton kernel
(``fused_triton``: it needs CUDA or Triton's interpreter) and whether it takes attention away
from SDPA (``replaces_sdpa``, with ``attention_name`` for the run's attention line), and switches
with ``use_fused(on)``, which returns what it did in words. ``FusedPath`` gives the defaults.
"""
from __future__ import annotations

import importlib.util
from collections import Counter
from typing import ClassVar, Protocol, runtime_checkable

import torch


@runtime_checkable
class FusedLayer(Protocol):
    """A layer whose forward has a plain path and a fused one."""

    fused_kind: str
    fused_triton: bool
    replaces_sdpa: bool
    attention_name: str
    fused: bool

    def use_fused(self, on: bool) -> list[str]:
        """Switch the fused path on or off; what was switched, in words."""


class FusedPath:
    """Defaults of :class:`FusedLayer` for a layer class to inherit before ``nn.Module``."""

    fused_kind: ClassVar[str]
    fused_triton: ClassVar[bool] = False
    replaces_sdpa: ClassVar[bool] = False
    fused: bool = False

    @property
    def attention_name(self) -> str:
        return f"{self.fused_kind} attention"


@runtime_checkable
class StreamCarrier(Protocol):
    """A model whose residual stream can be carried in another dtype from the embeddings on
    (``stream_dtype`` technique); None keeps the dtype the embeddings produce."""

    stream_dtype: torch.dtype | None


class TokenEmbeddingStream:
    """For a StreamCarrier whose stream starts at its token embedding ``embed_tokens``, cast
    straight into ``stream_dtype``: that embedding, once the dtype is set
    (``stream_embeddings``), so that master_weights may store it in 16 bits (the cast would
    give the same rows)."""

    def stream_embeddings(self) -> list[torch.nn.Module]:
        return [self.embed_tokens] if self.stream_dtype is not None else []


@runtime_checkable
class ImageInput(Protocol):
    """A model that converts its image inputs itself, to channels-last where asked."""

    channels_last: bool


def fused_layers(model: torch.nn.Module) -> list[FusedLayer]:
    """The layers of ``model`` with a fused path."""
    return [m for m in model.modules() if isinstance(m, FusedLayer)]


def partial_fused_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Layers that offer ``use_fused`` without the rest of :class:`FusedLayer` (a layer of a
    user's written before the protocol): they are not switched, and the caller says so."""
    return [m for m in model.modules()
            if callable(getattr(m, "use_fused", None)) and not isinstance(m, FusedLayer)]


def triton_unavailable(device: torch.device) -> str | None:
    """Why fasttrain's Triton kernels cannot run on ``device`` here, or None if they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    from ..kernels._triton import unavailable_on

    return unavailable_on(device.type)


def switch_fused(layers: list[FusedLayer], families: frozenset[str], device: torch.device
                 ) -> tuple[Counter, set[str], str | None]:
    """Switch on the fused path of each layer whose family is in ``families``: what was switched
    (``use_fused``'s words, counted), the families kept plain because their Triton kernels
    cannot run on ``device``, and why."""
    no_triton = triton_unavailable(device)
    done: Counter = Counter()
    kept: set[str] = set()
    for module in layers:
        if module.fused_kind not in families:
            continue
        if no_triton and module.fused_triton:
            kept.add(module.fused_kind)
            continue
        done.update(module.use_fused(True))
    return done, kept, no_triton
