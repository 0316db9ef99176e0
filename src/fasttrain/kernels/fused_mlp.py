"""A narrow MLP's forward in one Triton kernel: fc1 → bias → GELU → fc2, the hidden activation
kept on chip. Forward only, for inference.

What is fused
    ``mlp(x, w1, b1, w2, b2)`` computes ``gelu(x @ w1ᵀ + b1) @ w2ᵀ (+ b2)``. Each program takes
    ``BLOCK_M`` rows of ``x`` (read once) and walks the hidden width in chunks of ``BLOCK_H``:
    the chunk's fc1 product, bias and GELU in registers, rounded to x's dtype, and at once
    multiplied into the fc2 accumulator. The (rows, hidden) activation — four times as wide as
    the input in a ViT or Swin MLP — is never written; the weights are read from L2 by every
    program.

When it helps
    Where the MLP is narrow, its two GEMMs move more bytes than they compute: Swin-B's first
    stage (128 channels, 512 hidden, 200,704 tokens at batch 64) writes and reads back a 205 MB
    hidden activation through two GEMMs with K = 128 and N = 128. Wide MLPs (ViT-B's 768 →
    3,072) are compute-bound, and cuBLAS's GEMMs beat a Triton chain there; ``fits`` says which
    widths this kernel takes (``MAX_DIM``).

Numerics
    Both products accumulate in fp32; fc1's output gets its bias and the GELU in fp32 and is
    rounded to x's dtype once, before fc2 (the unfused path rounds fc1's output before the GELU
    as well); ``approximate`` picks the erf GELU or the tanh one.

torch.compile
    An opaque custom op (``_triton.op(opaque=True)``): Inductor calls it as it is, and CUDA
    graphs capture its launch; there is nothing beside it to fuse.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._triton import INTERPRETED, launch, op, tile_dot
from .activations import _gelu_and_grad

__all__ = ["LAUNCH", "MAX_DIM", "fits", "mlp", "mlp_reference"]

MAX_DIM = 256
"""The widest input and output this kernel takes: the fc2 accumulator is (BLOCK_M, out) fp32 in
registers."""
LAUNCH = {"block_m": 128, "block_m_wide": 64, "block_h": 64, "warps": 8, "stages": 2}
"""Rows a program (``block_m`` up to 128 channels, ``block_m_wide`` above), hidden units a step,
warps, and the software-pipelining stages of the hidden loop."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _mlp_fwd_kernel(x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, y_ptr, M,
                    C: tl.constexpr, HID: tl.constexpr, N: tl.constexpr,
                    HAS_B2: tl.constexpr, TANH: tl.constexpr, DOT: tl.constexpr,
                    STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program ``pid``: rows pid·BLOCK_M … of y. W1 is (HID, C), W2 (N, HID), both row-major
    (nn.Linear's weights); the chunks are loaded along their rows and transposed in the dot."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = (rows < M)[:, None]
    cols_c = tl.arange(0, C)
    cols_n = tl.arange(0, N)
    hid = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + rows[:, None] * C + cols_c[None, :], mask=rmask, other=0.0)
    acc = tl.zeros((BLOCK_M, N), tl.float32)
    for h0 in tl.range(0, HID, BLOCK_H, num_stages=STAGES):
        w1 = tl.load(w1_ptr + (h0 + hid)[:, None] * C + cols_c[None, :])  # (BLOCK_H, C)
        b1 = tl.load(b1_ptr + h0 + hid).to(tl.float32)
        h, _ = _gelu_and_grad(tile_dot(x, tl.trans(w1), DOT) + b1[None, :], TANH)
        w2 = tl.load(w2_ptr + cols_n[:, None] * HID + (h0 + hid)[None, :])  # (N, BLOCK_H)
        acc = acc + tile_dot(h.to(x.dtype), tl.trans(w2), DOT)
    if HAS_B2:
        acc = acc + tl.load(b2_ptr + cols_n).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rmask)


@op("fasttrain::mlp_fwd", opaque=True)
def _mlp_fwd(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
             b2: Optional[torch.Tensor], approximate: str) -> torch.Tensor:
    M, C = x.shape
    HID, N = w1.shape[0], w2.shape[0]
    y = x.new_empty((M, N))
    if M > 0:
        block_m = LAUNCH["block_m"] if max(C, N) <= 128 else LAUNCH["block_m_wide"]
        launch(_mlp_fwd_kernel, (triton.cdiv(M, block_m),), x, w1, b1, w2,
               w2 if b2 is None else b2, y, M, C=C, HID=HID, N=N, HAS_B2=b2 is not None,
               TANH=approximate == "tanh",
               DOT=1 if x.dtype == torch.float32 else 2 if INTERPRETED else 0,
               STAGES=LAUNCH["stages"], BLOCK_M=block_m, BLOCK_H=LAUNCH["block_h"],
               num_warps=LAUNCH["warps"], opaque=True)
    return y


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def fits(dim: int, hidden: int, out: int) -> bool:
    """Whether an MLP of these widths runs in this kernel: input and output powers of two from
    16 to ``MAX_DIM``, the hidden width a multiple of ``LAUNCH["block_h"]``."""
    return (_pow2(dim) and _pow2(out) and max(dim, out) <= MAX_DIM
            and hidden % LAUNCH["block_h"] == 0 and hidden > 0)


def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
        b2: Optional[torch.Tensor] = None, approximate: str = "none") -> torch.Tensor:
    """``gelu(x @ w1ᵀ + b1) @ w2ᵀ (+ b2)`` for x (..., C), w1 (HID, C), b1 (HID,), w2 (N, HID),
    b2 (N,) or None, all of one dtype and device; forward only (no gradient)."""
    C = x.shape[-1]
    if w1.dim() != 2 or w2.dim() != 2 or w1.shape[1] != C or w2.shape[1] != w1.shape[0]:
        raise ValueError(f"mlp: x (…, {C}), w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} do "
                         "not chain (need w1 (hidden, C) and w2 (out, hidden))")
    if b1 is None or b1.shape != w1.shape[:1] or (b2 is not None and b2.shape != w2.shape[:1]):
        raise ValueError(f"mlp: b1 must be ({w1.shape[0]},) and b2 ({w2.shape[0]},) or None")
    tensors = [t for t in (x, w1, b1, w2, b2) if t is not None]
    if x.dtype not in _DTYPES or any(t.dtype != x.dtype or t.device != x.device
                                     for t in tensors):
        raise ValueError(f"mlp: x, the weights and biases must share one float dtype and "
                         f"device, got {sorted({str(t.dtype) for t in tensors})}")
    if not fits(C, w1.shape[0], w2.shape[0]):
        raise ValueError(f"mlp: widths {C} → {w1.shape[0]} → {w2.shape[0]} do not fit the "
                         f"kernel (input and output powers of two up to {MAX_DIM}, hidden a "
                         f"multiple of {LAUNCH['block_h']})")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"mlp: approximate must be 'none' or 'tanh', not {approximate!r}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError("mlp is forward only (no gradient): train with the layers' own path")
    y = torch.ops.fasttrain.mlp_fwd(x.reshape(-1, C).contiguous(), w1.contiguous(), b1,
                                    w2.contiguous(), b2, approximate)
    return y.view(*x.shape[:-1], w2.shape[0])


def mlp_reference(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                  b2: Optional[torch.Tensor] = None, approximate: str = "none") -> torch.Tensor:
    """The same in PyTorch, in fp32, fc1's output rounded to x's dtype after the GELU."""
    h = torch.nn.functional.gelu(x.float() @ w1.float().t() + b1.float(),
                                 approximate=approximate).to(x.dtype)
    y = h.float() @ w2.float().t()
    return (y if b2 is None else y + b2.float()).to(x.dtype)
