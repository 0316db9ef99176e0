"""The Triton kernels of the one-launch AdamW (``optim/adamw.py``, which documents the
layout they read): the step over every tensor's blocks, the gradients' sum of squares for the
clip norm over the same blocks, and the fetch of the pinned host table of where the weights and
gradients are."""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton import add, mix32, to_bf16, to_bf16_stochastic


@triton.jit
def _store_moments(m_ptr, v_ptr, s_offs, mask, m, v, seed, STATE16: tl.constexpr):
    """The moments back into their buffers: fp32 as they are, or (STATE16) bf16 rounded
    stochastically, each element with its own 16 bits of one hash of its state offset and
    ``seed`` (the step), so that the small per-step changes of an average survive rounding
    in expectation instead of vanishing into round-to-nearest."""
    if STATE16:
        noise = mix32(s_offs.to(tl.uint32) * 0x9E3779B1 + seed)
        tl.store(m_ptr + s_offs, to_bf16_stochastic(m, noise & 0xFFFF), mask=mask)
        tl.store(v_ptr + s_offs, to_bf16_stochastic(v, noise >> 16), mask=mask)
    else:
        tl.store(m_ptr + s_offs, m, mask=mask)
        tl.store(v_ptr + s_offs, v, mask=mask)


@triton.jit
def _update(w_ptr, w_offs, g_ptr, g_offs, copy_ptr, copy_offs, m_ptr, v_ptr, ema_ptr, coef_ptr,
            s_offs, mask, has_grad, lr, beta1, beta2, bc1, bc2_sqrt, eps, weight_decay,
            ema_weight, seed, HAS_CLIP: tl.constexpr, HAS_EMA: tl.constexpr,
            COPY: tl.constexpr, STATE16: tl.constexpr):
    """AdamW (+ EMA) on the elements at the given offsets; ``mask`` None for a whole block.
    The fp32 weight is read from and written to ``w_ptr + w_offs``: the model's weight, or the
    master copy of a bf16 one, which COPY also writes back, rounded, to ``copy_ptr +
    copy_offs``. The gradient is read in its own dtype and used in fp32; so are the moments
    (fp32, or bf16 with STATE16)."""
    p = tl.load(w_ptr + w_offs, mask=mask)
    if has_grad:
        g = tl.load(g_ptr + g_offs, mask=mask).to(tl.float32)
        if HAS_CLIP:
            g = g * tl.load(coef_ptr)
        m = tl.load(m_ptr + s_offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + s_offs, mask=mask).to(tl.float32)
        p = p - lr * weight_decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p - (lr / bc1) * m / denom
        tl.store(w_ptr + w_offs, p, mask=mask)
        if COPY:
            tl.store(copy_ptr + copy_offs, to_bf16(p), mask=mask)
        _store_moments(m_ptr, v_ptr, s_offs, mask, m, v, seed, STATE16)
    if HAS_EMA:  # every weight's EMA moves, with a gradient or without (as foreach lerp)
        e = tl.load(ema_ptr + s_offs, mask=mask)
        e = e + ema_weight * (p - e)
        tl.store(ema_ptr + s_offs, e, mask=mask)


@triton.jit
def _block(w_ptr, w_offs, g_ptr, g_offs, copy_ptr, copy_offs, m_ptr, v_ptr, ema_ptr, coef_ptr,
           s_offs, whole, mask, has_grad, lr, beta1, beta2, bc1, bc2_sqrt, eps, weight_decay,
           ema_weight, seed, HAS_CLIP: tl.constexpr, HAS_EMA: tl.constexpr,
           COPY: tl.constexpr, STATE16: tl.constexpr, W_VEC: tl.constexpr,
           G_VEC: tl.constexpr, BLOCK: tl.constexpr):
    """``_update`` on one block: a ``whole`` one (inside its tensor, every address on 16
    bytes: offsets multiples of W_VEC for the weight, G_VEC for the gradient and the copy, 16
    for the state) with unmasked vector loads, else with ``mask``."""
    if whole:
        _update(w_ptr, tl.max_contiguous(tl.multiple_of(w_offs, W_VEC), BLOCK),
                g_ptr, tl.max_contiguous(tl.multiple_of(g_offs, G_VEC), BLOCK),
                copy_ptr, tl.max_contiguous(tl.multiple_of(copy_offs, G_VEC), BLOCK),
                m_ptr, v_ptr, ema_ptr, coef_ptr,
                tl.max_contiguous(tl.multiple_of(s_offs, 16), BLOCK), None, has_grad,
                lr, beta1, beta2, bc1, bc2_sqrt, eps, weight_decay, ema_weight, seed,
                HAS_CLIP, HAS_EMA, COPY, STATE16)
    else:  # the tensor's last, partial block, or a tensor that is not 16-byte aligned
        _update(w_ptr, w_offs, g_ptr, g_offs, copy_ptr, copy_offs, m_ptr, v_ptr, ema_ptr,
                coef_ptr, s_offs, mask, has_grad, lr, beta1, beta2, bc1, bc2_sqrt, eps,
                weight_decay, ema_weight, seed, HAS_CLIP, HAS_EMA, COPY, STATE16)


@triton.jit
def _adamw_step(table_ptr, n_tensors, chunk_tensor_ptr, chunk_start_ptr, numel_ptr,
                state_off_ptr, steps_ptr, have_ptr, m_ptr, v_ptr, ema_ptr, coef_ptr,
                master_ptr, f32_ptr, half_ptr, lr_ptr, beta1, beta2, log2_beta1, log2_beta2,
                eps, weight_decay, ema_weight, HAS_CLIP: tl.constexpr, HAS_EMA: tl.constexpr,
                HALF: tl.constexpr, STATE16: tl.constexpr, BLOCK: tl.constexpr):
    """One program: BLOCK elements of one tensor (chunk c of the chunk table). fp32 weights
    and gradients are addressed as element offsets from f32_ptr (any two fp32 addresses are a
    whole number of elements apart), bf16 ones from half_ptr; the moments (fp32, or bf16 with
    STATE16) and the EMA at the tensor's state offsets; the table's third part says per
    tensor whether both start on 16 bytes, which makes a whole block's loads provably aligned
    vectors, its fourth (with HALF) whether the weight is bf16 with an fp32 master copy in
    master_ptr (at the tensor's state offsets). The learning rate is read from lr_ptr (one
    fp32 on the device), so a scheduler that writes it between replays of a captured step
    reaches the replays."""
    c = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + c)
    start = tl.load(chunk_start_ptr + c)
    n = tl.load(numel_ptr + t)
    idx = tl.arange(0, BLOCK)
    p_offs = tl.load(table_ptr + t) + start + idx
    g_offs = tl.load(table_ptr + n_tensors + t) + start + idx
    s_offs = tl.load(state_off_ptr + t) + start + idx
    whole = (start + BLOCK <= n) & (tl.load(table_ptr + 2 * n_tensors + t) != 0)
    mask = start + idx < n
    lr = tl.load(lr_ptr)
    beta1, beta2 = tl.cast(beta1, tl.float32), tl.cast(beta2, tl.float32)
    eps, weight_decay = tl.cast(eps, tl.float32), tl.cast(weight_decay, tl.float32)
    ema_weight = tl.cast(ema_weight, tl.float32)
    step = tl.load(steps_ptr + t)
    seed = step.to(tl.uint32) * 0x85EBCA77  # a new draw of rounding noise every step
    bc1 = 1.0 - tl.exp2(step * tl.cast(log2_beta1, tl.float32))
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.cast(log2_beta2, tl.float32)))
    has_grad = tl.load(have_ptr + t) != 0
    half = False  # without HALF a compile-time False: only the fp32 path is compiled
    if HALF:
        half = tl.load(table_ptr + 3 * n_tensors + t) != 0
    if half:  # bf16 weight: step its fp32 master
        _block(master_ptr, s_offs, half_ptr, g_offs, half_ptr, p_offs, m_ptr, v_ptr, ema_ptr,
               coef_ptr, s_offs, whole, mask, has_grad, lr, beta1, beta2, bc1, bc2_sqrt, eps,
               weight_decay, ema_weight, seed, HAS_CLIP, HAS_EMA, True, STATE16, 16, 8, BLOCK)
    else:
        _block(f32_ptr, p_offs, f32_ptr, g_offs, f32_ptr, p_offs, m_ptr, v_ptr, ema_ptr,
               coef_ptr, s_offs, whole, mask, has_grad, lr, beta1, beta2, bc1, bc2_sqrt, eps,
               weight_decay, ema_weight, seed, HAS_CLIP, HAS_EMA, False, STATE16, 4, 4, BLOCK)


@triton.jit
def _sumsq(ptr, offs, whole, mask, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """The fp32 sum of squares of one block of a gradient (``whole``: unmasked vector loads)."""
    if whole:
        g = tl.load(ptr + tl.max_contiguous(tl.multiple_of(offs, VEC), BLOCK))
    else:
        g = tl.load(ptr + offs, mask=mask, other=0.0)
    g = g.to(tl.float32)
    return tl.reduce(g * g, 0, add)


@triton.jit
def _grad_sumsq(table_ptr, n_tensors, n_chunks, chunk_tensor_ptr, chunk_start_ptr, numel_ptr,
                have_ptr, out_ptr, f32_ptr, half_ptr, HALF: tl.constexpr, CHUNKS: tl.constexpr,
                BLOCK: tl.constexpr):
    """Program p: the fp32 sum of squares of the gradients' elements in chunks p·CHUNKS …
    (p + 1)·CHUNKS of a chunk table of BLOCK-element blocks, into out[p] (0 for a tensor
    without a gradient). Gradients are addressed as in ``_adamw_step``."""
    p = tl.program_id(0)
    acc = tl.cast(0.0, tl.float32)
    idx = tl.arange(0, BLOCK)
    for k in tl.static_range(CHUNKS):
        c = p * CHUNKS + k
        if c < n_chunks:
            t = tl.load(chunk_tensor_ptr + c)
            if tl.load(have_ptr + t) != 0:
                start = tl.load(chunk_start_ptr + c)
                n = tl.load(numel_ptr + t)
                offs = tl.load(table_ptr + n_tensors + t) + start + idx
                whole = (start + BLOCK <= n) & (tl.load(table_ptr + 2 * n_tensors + t) != 0)
                mask = start + idx < n
                half = False
                if HALF:
                    half = tl.load(table_ptr + 3 * n_tensors + t) != 0
                if half:
                    acc += _sumsq(half_ptr, offs, whole, mask, 8, BLOCK)
                else:
                    acc += _sumsq(f32_ptr, offs, whole, mask, 4, BLOCK)
    tl.store(out_ptr + p, acc)


@triton.jit
def _fetch_table(src_addr, dst_ptr, n, BLOCK: tl.constexpr):
    """Copy n int64 from pinned host memory (read in place over the bus: its address is valid on
    the device) into the device table. A kernel, not a memcpy, so a CUDA-graph capture records
    it without involving the pinned-memory allocator."""
    src = src_addr.to(tl.pointer_type(tl.int64))
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src + i, mask=i < n), mask=i < n)
