"""Self-attention over short sequences (ViT's 197 tokens) straight from the qkv projection,
one Triton kernel forward and two backward.

What is fused
    ``seq_attention(qkv, heads)`` computes, for every sequence and head,
    ``softmax(q kᵀ · scale) v`` from the qkv projection's output (B, T, 3·C), read as
    (3, heads, C/heads) on its last dim, and writes (B, T, C) with the heads side by side,
    ready for the output projection. The backward writes dq, dk and dv into one (B, T, 3·C)
    gradient, the layout the qkv projection's backward reads. So the q/k/v permutes, the
    output's transpose and the gradients' stack (a copy of the whole qkv gradient that
    Inductor emits after SDPA's backward, ``triton_poi_fused_clone_permute_stack``) are gone;
    no score matrix is in memory. ``batch_second`` takes the (T, B, 3·C) layout instead.
    ``projected_seq_attention(x, weight, bias, heads)`` runs the qkv projection too (cuBLAS,
    its bias added in the GEMM's epilogue) and sums the bias's gradient in the backward
    kernels: each program writes the column sums of the gradient rows it wrote, so the bias
    gradient is one small ``torch.sum`` of (B · blocks, 3·C) partials instead of Inductor's
    reduction over the whole (B·T, 3·C) gradient (35 µs a layer at ViT-B's batch 128 on the
    H200, profile-vit-base-20261122-022114).

    ``seq_attention_of_views(qkv, q, k, v)`` and ``seq_attention_qkv(q, k, v)`` take the
    (B, H, T, D) q, k and v that ``scaled_dot_product_attention`` takes, for a model's own
    SDPA calls (``layers/sdpa_route.py``): the first for views of the packed ``qkv`` (checked),
    its gradient written to qkv; the second for any q, k and v, read in place where it finds
    them packed when it runs (a packed copy where not), their gradients views of one tensor.

    Odd lengths cost little padding: keys and queries go in blocks of 64, and the last,
    partial block is a block of its own size rounded up to a power of two (197 tokens: three
    blocks of 64 and one of 16, 208 padded tokens against the 256 of 64-wide tiles).

    Forward: one program per (block of queries, sequence and head), an online softmax over
    the key blocks (flash attention); it keeps each row's log-sum-exp. Backward: the first
    kernel, one program per block of queries, recomputes the probabilities and writes dq and
    the rows' ``rowsum(dO ∘ O)``; the second, one program per block of keys, recomputes them
    transposed and writes dk and dv. No atomics, no fp32 gradient buffer to convert.

When it helps
    Sequences of a few hundred tokens at head dims 16-128 (ViT-B/16: 197 tokens, head dim
    64), where SDPA's kernels are built for long sequences and pad 197 tokens to 256. Long
    sequences work too (any length), without the tricks of kernels made for them.

Numerics
    Scores, softmax and every reduction in fp32 (exp2 of log2-scaled scores); the
    probabilities are rounded to the inputs' dtype before they multiply v, as flash attention
    does. fp32 inputs multiply in full fp32 (no TF32).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
from torch._subclasses.fake_tensor import FakeTensor

from ._seq_attention_kernels import _dkv_kernel, _dq_kernel, _fwd_kernel
from ._triton import INTERPRETED, launch, op, output_grad

__all__ = ["seq_attention", "seq_attention_reference", "projected_seq_attention",
           "projected_seq_attention_reference", "packed_views", "seq_attention_of_views",
           "seq_attention_qkv"]

WIDE_ELEMENTS = 2**31  # qkv this large indexes in int64 (the kernels' WIDE), smaller in int32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Launch settings: rows (queries or keys) a block, warps a program, the inner loop's pipelining
# stages (the dk/dv kernel's its own), and register caps a thread (0: none). At 181 registers
# only two dk/dv programs fit an SM; capped at 168 (a few spills) three do: 154.3 µs against
# 194.6 at ViT-B batch 128 on the H200 with 3 stages; the forward capped at 96, 89.2 against
# 94.7 (seq-attention-maxnreg-20261125-0540). Inductor drops ``maxnreg`` from user kernels, so
# the two ops are opaque to it (``_triton.op(..., opaque=True)``).
LAUNCH = {"fwd_block": 64, "fwd_warps": 4, "fwd_stages": 2,
          "bwd_block": 64, "bwd_warps": 4, "bwd_stages": 2,
          "dkv_stages": 3, "fwd_maxnreg": 96, "dq_maxnreg": 0, "dkv_maxnreg": 168}


# ----------------------------------------------------------------------------- custom ops

def _meta(qkv: torch.Tensor, heads: int, batch_second: bool,
          way: str) -> tuple[int, int, dict]:
    """(sequences × heads, blocks a sequence, the kernels' compile-time settings). Constant
    sizes and strides make the address arithmetic multiplies by constants."""
    T, B, C3 = qkv.shape if batch_second else (qkv.shape[1], qkv.shape[0], qkv.shape[2])
    C = C3 // 3
    block = LAUNCH[f"{way}_block"]
    rest = T % block
    tail = 0 if rest == 0 else max(16, triton.next_power_of_2(rest))
    nblk = T // block + (1 if tail else 0)
    SB, ST = (C3, B * C3) if batch_second else (T * C3, C3)
    OB, OT = (C, B * C) if batch_second else (T * C, C)
    meta = dict(T=T, SB=SB, ST=ST, OB=OB, OT=OT, C=C, D=C // heads, H=heads, NBLK=nblk,
                WIDE=qkv.numel() >= WIDE_ELEMENTS,
                DOT=1 if qkv.dtype == torch.float32 else 2 if INTERPRETED else 0,
                STAGES=LAUNCH[f"{way}_stages"], num_warps=LAUNCH[f"{way}_warps"],
                BLOCK=block, TAIL=tail, TB=tail or block,
                BLOCK_D=max(16, triton.next_power_of_2(C // heads)))
    return B * heads, nblk, meta


@op("fasttrain::seq_attention_fwd", opaque=True)
def _fwd(qkv: torch.Tensor, bias: Optional[torch.Tensor], heads: int, scale: float,
         batch_second: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log-sum-exps. ``bias``: the qkv projection's, already in qkv (added by the
    projection's GEMM), taken here only for the backward to return its gradient."""
    out = qkv.new_empty((*qkv.shape[:-1], qkv.shape[-1] // 3))
    sh, nblk, meta = _meta(qkv, heads, batch_second, "fwd")
    lse = torch.empty((sh, meta["T"]), device=qkv.device, dtype=torch.float32)
    if qkv.numel():
        launch(_fwd_kernel, (sh * nblk,), qkv, out, lse, scale, opaque=True,
               maxnreg=LAUNCH["fwd_maxnreg"], **meta)
    return out, lse


@op("fasttrain::seq_attention_bwd", opaque=True)
def _bwd(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
         heads: int, scale: float, batch_second: bool, sums: bool
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """dqkv, and with ``sums`` its column sums in fp32 per (sequence, block) of rows (else
    empty), for the caller to sum: outside this opaque op Inductor's reduction takes ~5 µs at
    ViT-B where ATen's column sum in here took 20 (profile-vit-base-20261125-071717)."""
    dqkv = torch.empty_like(qkv)
    sh, nblk, meta = _meta(qkv, heads, batch_second, "bwd")
    # one row of partial column sums per (sequence, block), every one written by the kernels
    parts = torch.empty((sh // heads * nblk if sums else 0, qkv.shape[-1]),
                        device=qkv.device, dtype=torch.float32)
    if qkv.numel():
        delta = torch.empty_like(lse)
        p = parts if sums else qkv
        launch(_dq_kernel, (sh * nblk,), qkv, dout, out, lse, dqkv, delta, p, scale,
               SUMS=sums, opaque=True, maxnreg=LAUNCH["dq_maxnreg"], **meta)
        launch(_dkv_kernel, (sh * nblk,), qkv, dout, lse, delta, dqkv, p, scale, SUMS=sums,
               opaque=True, maxnreg=LAUNCH["dkv_maxnreg"],
               **{**meta, "STAGES": LAUNCH["dkv_stages"]})
    return dqkv, parts


@op("fasttrain::seq_attention_views_fwd", opaque=True)
def _views_fwd(qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               heads: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``_fwd`` of ``qkv`` after checking, on the real tensors, that q, k and v are its three
    slices (their values are read from qkv; the check is what makes that sound)."""
    real = not isinstance(qkv, FakeTensor) and qkv.device.type != "meta"
    if real and (why := packed_views(qkv, q, k, v)):
        raise ValueError(f"seq_attention_of_views: {why}")
    return torch.ops.fasttrain.seq_attention_fwd(qkv, None, heads, scale, False)


def _views_setup(ctx, inputs, output) -> None:
    qkv, _, _, _, heads, scale = inputs
    ctx.heads, ctx.scale = heads, scale
    ctx.save_for_backward(qkv, output[0], output[1])


def _views_backward(ctx, dout, _dlse):
    qkv, out, lse = ctx.saved_tensors
    dqkv, _ = torch.ops.fasttrain.seq_attention_bwd(output_grad(out, dout), qkv, out, lse,
                                                    ctx.heads, ctx.scale, False, False)
    return dqkv, None, None, None, None, None  # q, k and v are views of qkv: all of it is here


_views_fwd.register_autograd(_views_backward, setup_context=_views_setup)


def _packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, T, 3·C) qkv holding (B, H, T, D) q, k and v: a view of their memory where they are
    its slices (``packed_views``: the inputs' own storage, read only), else a packed copy."""
    B, H, T, D = q.shape
    C3 = 3 * H * D
    if isinstance(q, FakeTensor) or q.device.type == "meta":
        return q.new_empty((B, T, C3))
    if (q.storage_offset() + B * T * C3) * q.element_size() <= q.untyped_storage().nbytes():
        qkv = q.as_strided((B, T, C3), (T * C3, C3, 1))  # the rows q's storage holds from q on
        if packed_views(qkv, q, k, v) is None:
            return qkv
    return torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=2).reshape(B, T, C3)


@op("fasttrain::seq_attention_qkv_fwd", opaque=True)
def _qkv_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.fasttrain.seq_attention_fwd(_packed(q, k, v), None, q.shape[1], scale,
                                                     False)
    return out, lse


@op("fasttrain::seq_attention_qkv_bwd", opaque=True)
def _qkv_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, scale: float) -> torch.Tensor:
    dqkv, _ = torch.ops.fasttrain.seq_attention_bwd(dout, _packed(q, k, v), out, lse,
                                                    q.shape[1], scale, False, False)
    return dqkv


def _qkv_setup(ctx, inputs, output) -> None:
    q, k, v, scale = inputs
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, output[0], output[1])


def _qkv_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    B, H, T, D = q.shape
    dqkv = torch.ops.fasttrain.seq_attention_qkv_bwd(output_grad(out, dout), q, k, v, out, lse,
                                                     ctx.scale)
    dq, dk, dv = dqkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)  # views of dqkv
    return dq, dk, dv, None


_qkv_fwd.register_autograd(_qkv_backward, setup_context=_qkv_setup)


def _setup(ctx, inputs, output) -> None:
    qkv, bias, heads, scale, batch_second = inputs
    ctx.heads, ctx.scale, ctx.batch_second = heads, scale, batch_second
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(qkv, output[0], output[1])


def _backward(ctx, dout, _dlse):
    qkv, out, lse = ctx.saved_tensors
    sums = ctx.bias_dtype is not None
    dqkv, parts = torch.ops.fasttrain.seq_attention_bwd(
        output_grad(out, dout), qkv, out, lse, ctx.heads, ctx.scale, ctx.batch_second, sums)
    return dqkv, (parts.sum(0).to(ctx.bias_dtype) if sums else None), None, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------- public API

def _check(qkv: torch.Tensor, heads: int) -> None:
    if qkv.dtype not in _DTYPES:
        raise ValueError(f"qkv must be float32, bfloat16 or float16, got {qkv.dtype}")
    if qkv.dim() != 3 or heads < 1 or qkv.shape[2] % (3 * heads):
        raise ValueError(f"qkv must be (batch, tokens, 3 * heads * head_dim) with {heads} "
                         f"heads, got shape {tuple(qkv.shape)}")
    head_dim = qkv.shape[2] // (3 * heads)
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} is more than the kernels' 256")


def seq_attention(qkv: torch.Tensor, heads: int, scale: float | None = None,
                  batch_second: bool = False) -> torch.Tensor:
    """Self-attention of every sequence and head: ``qkv`` (B, T, 3·C) — or (T, B, 3·C) with
    ``batch_second`` — as (3, heads, C/heads) on its last dim; ``scale`` defaults to
    head_dim^-½. Returns (B, T, C) (or (T, B, C)) with the heads side by side, in qkv's
    dtype."""
    _check(qkv, heads)
    return _attend(qkv, None, heads, scale, batch_second)


def _attend(qkv: torch.Tensor, bias: Optional[torch.Tensor], heads: int, scale: float | None,
            batch_second: bool) -> torch.Tensor:
    head_dim = qkv.shape[-1] // (3 * heads)
    scale = head_dim ** -0.5 if scale is None else float(scale)
    out, _ = torch.ops.fasttrain.seq_attention_fwd(qkv.contiguous(), bias, heads, scale,
                                                   bool(batch_second))
    return out


def projected_seq_attention(x: torch.Tensor, weight: torch.Tensor,
                            bias: Optional[torch.Tensor], heads: int,
                            scale: float | None = None, batch_second: bool = False
                            ) -> torch.Tensor:
    """``seq_attention(F.linear(x, weight, bias), heads, …)`` — the qkv projection (cuBLAS,
    the bias added in its epilogue) and the attention — with the bias's gradient summed by the
    attention's backward kernels from the gradient tiles they write, instead of by a
    reduction over the whole (B·T, 3·C) gradient after them."""
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be a vector of the projection's {weight.shape[0]} "
                         f"outputs, got shape {tuple(bias.shape)}")
    qkv = F.linear(x, weight, None if bias is None else bias.detach())
    _check(qkv, heads)
    return _attend(qkv, bias, heads, scale, batch_second)


def _strides(shape, strides) -> tuple[int, ...]:
    """The strides, 0 on dims of size 1 (any stride reads the same there)."""
    return tuple(s if n > 1 else 0 for n, s in zip(shape, strides))


def packed_views(qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> str | None:
    """Why (B, H, T, D) ``q``, ``k`` and ``v`` are not the three slices of the contiguous
    (B, T, 3·H·D) ``qkv`` that ``seq_attention(qkv, H)`` reads as q, k and v, in that order
    (``qkv(x).split(C, 2)`` or ``.reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4)``, each seen as
    (B, H, T, D)); None if they are. Eager tensors only (it reads storage offsets)."""
    if q.dim() != 4 or not q.shape == k.shape == v.shape:
        return "q, k and v are not (B, H, T, D) of one shape"
    B, H, T, D = q.shape
    C = H * D
    if qkv.shape != (B, T, 3 * C) or not qkv.is_contiguous():
        return f"qkv is not a contiguous ({B}, {T}, {3 * C})"
    want = _strides(q.shape, (T * 3 * C, D, 3 * C, 1))
    if any(_strides(t.shape, t.stride()) != want for t in (q, k, v)):
        return "q, k or v is not a (B, H, T, D) view of the packed (B, T, 3·C) layout"
    if any(t.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()
           for t in (q, k, v)):
        return "q, k or v is not in qkv's memory"
    base = qkv.storage_offset()
    offsets = tuple(t.storage_offset() - base for t in (q, k, v))
    if offsets != (0, C, 2 * C):
        return f"q, k and v start at {offsets} of each row, not (0, {C}, {2 * C})"
    return None


def seq_attention_of_views(qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, scale=scale)`` for (B, H, T, D) q, k and v that
    are the three slices of the packed (B, T, 3·C) ``qkv`` (``packed_views``), computed by
    ``seq_attention(qkv, H)`` with nothing copied: the output is (B, H, T, D) as SDPA's is (a
    view of the kernel's (B, T, C)), and the backward's one (B, T, 3·C) gradient goes to qkv.
    The caller checks the layout (``packed_views``; eager: dynamo cannot read storage
    offsets); the op checks it again when it runs (a ValueError if q, k and v are not those
    slices, whose values it would not read)."""
    B, H, T, D = q.shape
    _check(qkv, H)
    scale = D ** -0.5 if scale is None else float(scale)
    out, _ = torch.ops.fasttrain.seq_attention_views_fwd(qkv, q, k, v, H, scale)
    return out.view(B, T, H, D).transpose(1, 2)


def seq_attention_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, scale=scale)`` for any (B, H, T, D) q, k and v
    of one shape, dtype and device: where they are the three slices of one packed (B, T, 3·C)
    buffer (checked on the real tensors when the op runs) the kernels read it in place, else
    they get a packed copy; the gradients come back as q's, k's and v's (views of one
    (B, T, 3·C) tensor). Output (B, H, T, D), a view of the kernel's (B, T, C)."""
    if (q.dim() != 4 or not q.shape == k.shape == v.shape or q.dtype not in _DTYPES
            or not q.dtype == k.dtype == v.dtype or q.shape[3] > 256):
        raise ValueError(f"q, k and v must be (B, H, T, D ≤ 256) of one shape and one of "
                         f"{_DTYPES}, got {tuple(q.shape)} {q.dtype}, {tuple(k.shape)} "
                         f"{k.dtype}, {tuple(v.shape)} {v.dtype}")
    B, H, T, D = q.shape
    scale = D ** -0.5 if scale is None else float(scale)
    out, _ = torch.ops.fasttrain.seq_attention_qkv_fwd(q, k, v, scale)
    return out.view(B, T, H, D).transpose(1, 2)


def seq_attention_reference(qkv: torch.Tensor, heads: int, scale: float | None = None,
                            batch_second: bool = False) -> torch.Tensor:
    """Plain-PyTorch ``seq_attention``: fp32 (or wider) scores and softmax, the probabilities
    rounded to qkv's dtype as the kernel does, output in qkv's dtype."""
    x = qkv.transpose(0, 1) if batch_second else qkv
    B, T, C3 = x.shape
    head_dim = C3 // (3 * heads)
    scale = head_dim ** -0.5 if scale is None else scale
    acc = torch.promote_types(qkv.dtype, torch.float32)
    q, k, v = x.to(acc).reshape(B, T, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    p = ((q @ k.transpose(-1, -2)) * scale).softmax(-1).to(qkv.dtype).to(acc)
    out = (p @ v).transpose(1, 2).reshape(B, T, C3 // 3).to(qkv.dtype)
    return out.transpose(0, 1) if batch_second else out


def projected_seq_attention_reference(x: torch.Tensor, weight: torch.Tensor,
                                      bias: Optional[torch.Tensor], heads: int,
                                      scale: float | None = None, batch_second: bool = False
                                      ) -> torch.Tensor:
    """Plain-PyTorch ``projected_seq_attention``."""
    return seq_attention_reference(F.linear(x, weight, bias), heads, scale, batch_second)

