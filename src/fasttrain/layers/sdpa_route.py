"""A model's own calls of ``F.scaled_dot_product_attention`` on the Triton self-attention kernel.

What: while ``SdpaRoute.active()`` is entered, ``torch.nn.functional.scaled_dot_product_attention``
is ``routed_sdpa``, which sends a call to ``kernels/seq_attention.py`` (the kernel of
``SelfAttention``'s fused path, ``kernels=attention``) where that kernel computes it and wins, and
every other call to SDPA itself, unchanged. On exit the original function is back.

Which calls: self-attention with no mask, not causal, no dropout, q, k and v of one shape
(B, H, T, D) with T ≤ ``SEQ_ATTENTION_MAX_TOKENS`` and D ≤ ``FUSED_MAX_HEAD_DIM``, in fp32, bf16
or fp16 (under autocast, in its dtype), where q, k and v are the three slices of one packed
(B, T, 3·C) projection output — ``self.qkv(x).reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4)``
(plain ViT code) or ``self.c_attn(x).split(C, 2)`` then ``.view(B, T, H, D).transpose(1, 2)``
(nanoGPT's). Causal attention (GPT) is not the kernel's: those calls stay on SDPA, counted with
the reason, as do q, k and v from separate projections or rotated (RoPE), which would need a
copy the kernel does not win back.

How: in eager, q, k and v must be views of one contiguous tensor (``_base``) at offsets 0, C
and 2·C of each row; the kernel reads that tensor and its backward writes the projection's
gradient as one (B, T, 3·C) tensor, so nothing is copied either way (SDPA's backward leaves
dq, dk and dv for autograd to stack into it). Dynamo cannot read storage offsets, nor a graph
input's ``_base``: under torch.compile only the strides are checked when tracing, and
``seq_attention_qkv`` reads q, k and v in place where it finds them packed when it runs (a
packed copy where not: the result is right either way); its gradients come back as q's, k's
and v's, stacked by autograd as after SDPA. Measured on an H100: ``SEQ_ATTENTION_MAX_TOKENS``.

Counting: ``SdpaRoute.calls`` counts the calls the router saw, by what it did ("routed" or the
reason it left the call to SDPA). In eager that is every call; under torch.compile, every call
traced (the compiled graph does not run Python), counted when it is traced.

Requirements: code that calls ``F.scaled_dot_product_attention`` (or
``torch.nn.functional.scaled_dot_product_attention``) by attribute at call time; a name bound
earlier (``from torch.nn.functional import scaled_dot_product_attention``) keeps SDPA.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch
import torch.nn.functional as F

from ..kernels._triton import unavailable_on
from ..kernels.seq_attention import packed_views, seq_attention_of_views, seq_attention_qkv
from .attention import FUSED_MAX_HEAD_DIM, SEQ_ATTENTION_MAX_TOKENS

try:  # counts a call when dynamo traces it, without a guard on the count
    from torch._dynamo.comptime import comptime
except ImportError:  # pragma: no cover - a torch without it: traced calls go uncounted
    comptime = None

SDPA = F.scaled_dot_product_attention  # the original, whatever is installed later
ROUTED = "routed"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACTIVE: list["SdpaRoute"] = []  # the routes entered, innermost last


class SdpaRoute:
    """One route's counts, and the context in which the router is installed."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()  # "routed" or the reason it stayed on SDPA → calls

    @contextlib.contextmanager
    def active(self) -> Iterator["SdpaRoute"]:
        """``F.scaled_dot_product_attention`` is the router inside, the original after."""
        # torch.overrides caches its index of F's functions on first use (dynamo asks for it):
        # made now, it lists the original rather than the router.
        torch.overrides.get_overridable_functions()
        before = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = routed_sdpa
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.remove(self)
            F.scaled_dot_product_attention = before

    @property
    def routed(self) -> int:
        return self.calls[ROUTED]

    def summary(self) -> str:
        """``F.scaled_dot_product_attention: 24 calls to the Triton self-attention kernel,
        12 to SDPA (causal ×12)``; empty if it saw none."""
        if not self.calls:
            return ""
        left = [(why, n) for why, n in self.calls.items() if why != ROUTED]
        line = (f"F.scaled_dot_product_attention: {self.routed} calls to the Triton "
                "self-attention kernel")
        if left:
            line += (f", {sum(n for _, n in left)} to SDPA ("
                     + ", ".join(f"{why} ×{n}" for why, n in left) + ")")
        return line


def routed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                **more) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s signature; the Triton kernel where ``refusal``
    finds nothing against it, SDPA otherwise."""
    why = "an argument newer than this router" if more else refusal(
        query, key, value, attn_mask, dropout_p, is_causal)
    _note(why)
    if why is not None:
        return SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **more)
    if torch.compiler.is_compiling():  # q, k and v read in place where the op finds them packed
        return seq_attention_qkv(query, key, value, scale)  # (B, H, T, D)
    B, H, T, D = query.shape
    qkv = query._base.view(B, T, 3 * H * D)  # (B, T, 3·C): what the projection wrote
    return seq_attention_of_views(qkv, query, key, value, scale)  # its gradient goes to qkv


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, dropout_p: float,
            is_causal: bool) -> str | None:
    """Why the kernel does not take this call, or None. Fixed phrases: under torch.compile
    each is a constant of the trace (shapes, dtypes and flags only)."""
    if attn_mask is not None:
        return "a mask"
    if is_causal:
        return "causal"
    if dropout_p:
        return "dropout"
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return "a tensor subclass"
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        return "not (B, H, T, D) self-attention"
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return "a dtype the kernel does not take"
    dev = q.device.type
    if torch.is_autocast_enabled(dev) and q.dtype != torch.get_autocast_dtype(dev):
        return "autocast would compute it in another dtype"
    if q.shape[3] > FUSED_MAX_HEAD_DIM:
        return f"head dim over {FUSED_MAX_HEAD_DIM}"
    if q.shape[2] > SEQ_ATTENTION_MAX_TOKENS:
        return f"over {SEQ_ATTENTION_MAX_TOKENS} tokens (SDPA's kernels win there)"
    if unavailable_on(dev) is not None:
        return f"no Triton kernels on {dev}"
    return _unpacked(q, k, v)


UNPACKED = "q, k and v are not slices of one packed projection (separate ones, or rotated)"


def _unpacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why q, k and v are not the slices of one packed projection output, or None. Under
    torch.compile only their strides are known (the op finds the rest when it runs); in eager,
    whether they are views of one contiguous tensor at offsets 0, C and 2·C of each row."""
    B, H, T, D = q.shape
    C = H * D
    want = tuple(s if n > 1 else 0 for n, s in zip(q.shape, (T * 3 * C, D, 3 * C, 1)))
    for t in (q, k, v):
        if tuple(s if n > 1 else 0 for n, s in zip(t.shape, t.stride())) != want:
            return UNPACKED
    if torch.compiler.is_compiling():
        return None
    base = q._base
    if (base is None or k._base is not base or v._base is not base
            or not base.is_contiguous() or base.numel() != B * T * 3 * C
            or packed_views(base.view(B, T, 3 * C), q, k, v) is not None):
        return UNPACKED
    return None


def _note(why: str | None) -> None:
    """Count this call for the innermost active route: now in eager, when traced under
    torch.compile (a count read by the traced code would be a guard, and a recompile a call)."""
    if torch.compiler.is_compiling():
        if comptime is not None:
            comptime(_note_traced)
    elif _ACTIVE:
        _ACTIVE[-1].calls[why or ROUTED] += 1


def _note_traced(ctx) -> None:
    if _ACTIVE:
        _ACTIVE[-1].calls[ctx.get_local("why").as_python_constant() or ROUTED] += 1
