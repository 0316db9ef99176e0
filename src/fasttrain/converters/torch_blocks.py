"""A pre-norm block written in plain PyTorch, recognised by what it holds: the block structure
that a model of the user's own gives no class for.

A module of any class (not torch's, not fasttrain's) whose children are exactly, in the order
they were registered, a norm, a branch, a norm of the same kind and width, and another branch
(``norm1``, ``attn``, ``norm2``, ``mlp``, under any names), with no parameters of its own, is
a candidate for ``x = x + attn(norm1(x)); x = x + mlp(norm2(x))``. The numeric self-check
decides: the converted block must give the module's own output on a random sequence (a
post-norm block, a parallel block or one that scales its branches gives another, and stays as
it was).

What it becomes (``PreNormBlock``, its forward put before the user's class, which stays among
its bases):
- ``kernels=layernorm`` (``rmsnorm``): the attention branch's residual add inside norm2's
  kernel, one pass over the stream each way instead of an add and a norm;
- stacked in an ``nn.Sequential``, the blocks run as one chain (``layers.blocks.ChainedBlocks``):
  each block's MLP branch is added inside the next block's first norm;
- ``stream_dtype=bf16``: the residual stream in bf16 from the first block on;
- a norm whose branch starts with a linear layer (its first child) writes its output in the
  autocast dtype on the fused path, the dtype that linear layer would cast it to.

A call with any argument besides the stream, or the stream by keyword, runs the module's own
forward. The self-check runs even with ``check=False``, on a copy whose parameters are moved off
their initial values, in training and in eval mode; a block built on the meta device, or whose
forward checkpoints its activations, is refused with the reason. Classes of torch, timm,
transformers and diffusers are not candidates. The norms and the
branches' own layers are converted as they would be anywhere (torch LayerNorm, the Linear →
GELU Sequential); parameters, their names and objects are unchanged.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from ..layers.blocks import Branch, ChainLink
from .registry import (Converter, class_path, library_forward, sequence_sample,
                       swap_keeping_library)
from .torch_nn import LAYER_NORM, RMS_NORM, norm_unsupported, swap_layer_norm, swap_rms_norm

LAYOUT = "_fasttrain_pre_norm"  # instance attribute: the names of norm1, attn, norm2, mlp
NORMS = {LAYER_NORM[0]: swap_layer_norm, RMS_NORM[0]: swap_rms_norm}


class PreNormBlock(ChainLink, nn.Module):
    """A user's pre-norm block (``LAYOUT`` names its four children) on fasttrain's norms."""

    stream_dtype: torch.dtype | None = None

    def parts(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        return tuple(self._modules[name] for name in self.__dict__[LAYOUT])

    def hands_on(self) -> bool:
        return bool(getattr(self.parts()[0], "fused", False))

    def forward(self, *args, branch: Branch = None, hand_on: bool = False, chained: bool = False,
                **kwargs):
        if len(args) != 1 or kwargs:  # more than the stream, or the stream by its name
            return library_forward(self, *args, **kwargs)
        x = args[0]
        norm1, attn, norm2, mlp = self.parts()
        if self.stream_dtype is not None and not chained:
            x = x.to(self.stream_dtype)
        if branch is None:
            y = norm1(x)
        else:
            y, x = norm1.add(branch[0], x)
        y, x = norm2.add(attn(y), x)
        m = mlp(y)
        if hand_on:
            return x, (m, None)
        x = x + m
        return (x, None) if chained else x


NOT_YOURS = ("torch", "fasttrain", "timm", "transformers", "diffusers")
"""Packages whose classes are not a user's own: theirs have converters by class, or not."""


def layout(m: nn.Module) -> tuple[str, str, str, str] | None:
    """The names of ``norm1, attn, norm2, mlp`` where ``m`` holds just that, else None."""
    if type(m).__module__.split(".")[0] in NOT_YOURS or LAYOUT in m.__dict__:
        return None
    if m._parameters or m._buffers or len(m._modules) != 4 or not _takes_one(m):
        return None
    names = list(m._modules)
    n1, a, n2, b = (m._modules[n] for n in names)
    kind = class_path(n1)
    if kind not in NORMS or class_path(n2) != kind or any(
            x is None or class_path(x) in NORMS for x in (a, b)):
        return None
    if not (list(a.parameters()) and list(b.parameters())):
        return None
    return tuple(names)


def _takes_one(m: nn.Module) -> bool:
    """Whether the module's forward can be called with the stream alone."""
    try:
        inspect.signature(type(m).forward).bind(m, None)
    except (TypeError, ValueError):
        return False
    return True


def is_pre_norm_block(m: nn.Module) -> bool:
    return layout(m) is not None


def checkpoints(m: nn.Module) -> bool:
    """Whether the block's own forward recomputes itself in the backward (activation
    checkpointing), which the converted forward, not calling it, would not do."""
    try:
        source = inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return False
    return "checkpoint" in source


def block_unsupported(m: nn.Module) -> str | None:
    if checkpoints(m):
        return ("its forward checkpoints activations, which the converted block would not do "
                "(checkpoint the blocks from outside, or leave them as they are)")
    names = layout(m)
    norm1, _, norm2, _ = (m._modules[n] for n in names)
    for name in (names[1], names[3]):
        if (need := _inputs_needed(m._modules[name])) > 1:
            return (f"its branch {name!r} ({type(m._modules[name]).__name__}) needs {need} "
                    "inputs, a pre-norm block's branch takes the stream alone; left as written")
    for norm in (norm1, norm2):
        if why := norm_unsupported(norm):
            return why
    if norm1.normalized_shape != norm2.normalized_shape:
        return (f"norms of widths {tuple(norm1.normalized_shape)} and "
                f"{tuple(norm2.normalized_shape)}: not one residual stream")
    return None


def _inputs_needed(branch: nn.Module) -> int:
    """How many positional arguments ``branch``'s forward requires (nn.MultiheadAttention: 3,
    query, key and value; a branch of the pattern: 1)."""
    try:
        params = inspect.signature(branch.forward).parameters.values()
    except (TypeError, ValueError):
        return 1
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in params)


def starts_with_linear(branch: nn.Module) -> bool:
    """Whether ``branch`` is a linear layer or its first child (recursively) is one."""
    while not isinstance(branch, nn.Linear):
        children = list(branch.children())
        if not children:
            return False
        branch = children[0]
    return True


def swap_block(m: nn.Module) -> None:
    names = layout(m)
    norm1, attn, norm2, mlp = (m._modules[n] for n in names)
    for norm, branch in ((norm1, attn), (norm2, mlp)):
        NORMS[class_path(norm)](norm)
        norm.feeds_matmul = starts_with_linear(branch)
    swap_keeping_library(m, PreNormBlock)
    m.__dict__[LAYOUT] = names


def width(m: nn.Module) -> int:
    return next(iter(m._modules.values())).normalized_shape[0]


CONVERTERS = (
    Converter("your pre-norm block", (), "x + attn(norm1(x)), + mlp(norm2(·)) on fasttrain's "
              "norms: the residual adds in the norms' kernels, blocks in an nn.Sequential "
              "chained (kernels=layernorm, rmsnorm)", block_unsupported, swap_block,
              sequence_sample(width), is_pre_norm_block,
              differs="not a pre-norm block: its output is not x + attn(norm1(x)), then "
              "+ mlp(norm2(·))"),
)
