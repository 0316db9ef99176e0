"""Rotary position embedding of q and k in one Triton kernel, forward and backward.

What is fused
    ``rope(q, k, cos, sin)`` returns ``(rot(q), rot(k))`` with
    ``rot(x) = x * cos + cat([-x2, x1], -1) * sin`` (x1, x2 the two halves of the head dim:
    the half-split layout of ``fasttrain.layers.rope.apply_rope`` and transformers), for
    q of shape (B, Hq, T, D) and k of shape (B, Hk, T, D) (Hk may differ from Hq: GQA). One
    launch rotates both: one program per token (b, t) loads that position's cos/sin row once
    and rotates every head of q and of k, reading each element once and writing it once,
    with no ``cat``, negation or cos/sin cast materialized. The backward is the transposed
    map (a rotation by -θ when, as in every rope table, the two halves of each cos/sin row
    are equal), one launch of the same kernel; it needs only cos and sin, not q or k.

When it helps
    In eager mode, where ``apply_rope`` runs about eight kernels per tensor (chunk, neg, cat,
    two muls, add, the casts of cos/sin) forward and as many backward. Under ``torch.compile``
    Inductor fuses it into one or two pointwise kernels already; measure before relying on it.

Layout
    q and k may have any strides, typically the non-contiguous ``proj(x).view(B, T, H, D)
    .transpose(1, 2)`` of an attention layer: the kernel reads through the strides (no copy)
    and writes outputs with the inputs' memory layout (``torch.empty_like``, which keeps the
    strides of a dense tensor; a non-dense input, e.g. a slice of a fused qkv projection,
    gets a contiguous output). Gradients are read through their strides too. cos and sin are
    (T', D) tables with T' ≥ T, of which the first T rows are used; they get no gradient.

Numerics
    The rotation is computed in fp32 from fp32 cos/sin (whatever their dtype) and rounded
    once to q's dtype, like the fp32 ``rope_reference``. ``apply_rope`` instead casts cos/sin
    to bf16 and rounds every intermediate, so in bf16 this kernel differs from it by about
    one bf16 ulp (it is closer to the exact rotation). cos/sin rows need not have equal
    halves: forward and backward implement the formula above and its exact transpose.

torch.compile
    As in ``fasttrain.kernels.norms``: ``triton_op``s with ``register_autograd`` backwards on
    a GPU, opaque ``custom_op``s under ``TRITON_INTERPRET=1``.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ._triton import launch, op

__all__ = ["rope", "rope_reference"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Tensors2 = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- kernels
# Only builtins of triton.language, not its @triton.jit library: see fasttrain.kernels.norms.

@triton.jit
def _rotate_heads(x_ptr, o_ptr, b, t, H, HALF,
                  sx_b, sx_h, sx_t, sx_d, so_b, so_h, so_t, so_d,
                  c1, c2, s1, s2, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate the H heads of token (b, t) of x into o, BLOCK_H heads at a time:
    (x1, x2) → (x1·c1 − x2·s1, x2·c2 + x1·s2)."""
    d = tl.arange(0, BLOCK_HALF)[None, :]
    x_base = x_ptr + b * sx_b + t * sx_t
    o_base = o_ptr + b * so_b + t * so_t
    for h0 in range(0, H, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)[:, None]
        mask = (h < H) & (d < HALF)
        x_off = h * sx_h + d * sx_d
        o_off = h * so_h + d * so_d
        x1 = tl.load(x_base + x_off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_base + x_off + HALF * sx_d, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_base + o_off, (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o_base + o_off + HALF * so_d, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, T, HQ, HK, HALF,
                 sq_b, sq_h, sq_t, sq_d, sqo_b, sqo_h, sqo_t, sqo_d,
                 sk_b, sk_h, sk_t, sk_d, sko_b, sko_h, sko_t, sko_d,
                 BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    b = token // T
    t = token - b * T
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = d < HALF
    row = t * (2 * HALF)  # cos/sin are contiguous (T, D)
    c1 = tl.load(cos_ptr + row + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:
        # the transpose: (g1, g2) → (g1·c1 + g2·s2, g2·c2 − g1·s1), i.e. the same rotation
        # with the sin halves swapped and negated (a rotation by −θ when s1 == s2)
        s1, s2 = -s2, -s1
    _rotate_heads(q_ptr, qo_ptr, b, t, HQ, HALF, sq_b, sq_h, sq_t, sq_d,
                  sqo_b, sqo_h, sqo_t, sqo_d, c1, c2, s1, s2, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, ko_ptr, b, t, HK, HALF, sk_b, sk_h, sk_t, sk_d,
                  sko_b, sko_h, sko_t, sko_d, c1, c2, s1, s2, BLOCK_HK, BLOCK_HALF)


# ----------------------------------------------------------------------------- launch

_TILE = 2048  # most elements of one tile of half heads: BLOCK_H heads x BLOCK_HALF pairs


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            backward: bool) -> Tensors2:
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    b, hq, t, d = q.shape
    hk, half = k.shape[1], d // 2
    block_half = triton.next_power_of_2(half)
    cap = max(1, _TILE // block_half)
    block_hq, block_hk = (min(triton.next_power_of_2(h), cap) for h in (hq, hk))
    warps = min(max(block_hq * block_half // 256, 1), 8)
    if b * t > 0:
        launch(_rope_kernel, (b * t,), q, k, cos, sin, qo, ko, t, hq, hk, half,
               *q.stride(), *qo.stride(), *k.stride(), *ko.stride(), BACKWARD=backward,
               BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, num_warps=warps)
    return qo, ko


@op("fasttrain::rope_fwd")
def _rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> Tensors2:
    return _rotate(q, k, cos, sin, backward=False)


@op("fasttrain::rope_bwd")
def _rope_bwd(dq_rot: torch.Tensor, dk_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> Tensors2:
    return _rotate(dq_rot, dk_rot, cos, sin, backward=True)


def _rope_setup(ctx, inputs, output) -> None:
    q, k, cos, sin = inputs
    ctx.shapes = (q.shape, k.shape)
    ctx.save_for_backward(cos, sin)


def _zeros(like: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """An expanded (stride-0) zero gradient: read through its strides, never materialized."""
    return like.new_zeros(()).expand(shape)


def _rope_backward(ctx, dq_rot: Optional[torch.Tensor], dk_rot: Optional[torch.Tensor]):
    cos, sin = ctx.saved_tensors
    q_shape, k_shape = ctx.shapes
    if dq_rot is None and dk_rot is None:
        return None, None, None, None
    like = dq_rot if dq_rot is not None else dk_rot
    dq_rot = _zeros(like, q_shape) if dq_rot is None else dq_rot
    dk_rot = _zeros(like, k_shape) if dk_rot is None else dk_rot
    dq, dk = torch.ops.fasttrain.rope_bwd(dq_rot, dk_rot, cos, sin)
    return dq, dk, None, None


_rope_fwd.register_autograd(_rope_backward, setup_context=_rope_setup)


# ----------------------------------------------------------------------------- public API

def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, T, D), got shapes {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    (b, _, t, d), (bk, _, tk, dk) = q.shape, k.shape
    if (bk, tk, dk) != (b, t, d) or k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"k must match q in B, T, D, dtype and device: q {tuple(q.shape)} "
                         f"{q.dtype} {q.device}, k {tuple(k.shape)} {k.dtype} {k.device}")
    if d % 2 or d == 0:
        raise ValueError(f"head dim D must be even and positive, got {d}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[0] < t or table.shape[1] != d:
            raise ValueError(f"{name} must be (T' >= {t}, {d}), got {tuple(table.shape)}")
        if table.dtype not in _DTYPES or table.device != q.device:
            raise ValueError(f"{name} must be a float tensor on {q.device}, "
                             f"got {table.dtype} on {table.device}")
        if table.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad, but rope gives cos/sin no gradient "
                             f"(detach it, or use rope_reference)")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tensors2:
    """Rotate q (B, Hq, T, D) and k (B, Hk, T, D) by position with the first T rows of the
    (T', D) tables cos and sin (half-split layout); outputs keep q's and k's dtype and memory
    layout. See the module docstring."""
    _check(q, k, cos, sin)
    t = q.shape[2]
    return torch.ops.fasttrain.rope_fwd(q, k, cos[:t].contiguous(), sin[:t].contiguous())


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> Tensors2:
    """Plain-PyTorch ``rope``: fp32 internally, outputs in q's and k's dtype."""
    t = q.shape[2]
    cos, sin = cos[:t].float(), sin[:t].float()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

    return rotate(q), rotate(k)
