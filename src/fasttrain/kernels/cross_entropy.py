"""An LM head's cross-entropy and the gradient of its logits in one Triton kernel, over the
whole logits (``linear_cross_entropy_fused``).

What is fused
    The plain path, ``cross_entropy(logits.float(), labels)`` under torch.compile, reads the
    tokens × vocabulary logits (Llama-3.2-1B at 4 × 2,048 tokens: 8,192 × 128,256, 2.1 GB in
    bf16) for the log-sum-exp in the forward, then again in the backward to write their
    gradient: on an H100 1.6 ms and 1.5 ms a step (profile-hf_llama-base-20261127-112650).
    Here one program a token reads its row twice in the forward, once for the log-sum-exp (an
    online maximum and sum of exponentials, one running pair per lane) and once, from L2
    where the row is still there, to write ``softmax − one-hot`` in the logits' dtype: the
    gradient exists as soon as the loss does. The backward only multiplies: the incoming
    scale (1 / the step's token count) goes onto the small operands of the two gradient
    GEMMs, the hidden states (8,192 × 2,048) for the weight's and the GEMM's output for the
    hidden states', so the logits-sized gradient is never rewritten.

When it helps
    Language models with a large vocabulary, where the logits' passes are a few ms a step
    (Llama-1B's head + loss on an H100: 20.2 ms against compiled 21.7, and 15.9 against 16.3
    at 4,096 × 3,072 × 128,256, kernels-micro-linear-ce-20261127b-h100; the step +0.6%). It
    costs peak memory: the logits and their gradient are alive together while the kernel runs
    (the plain path keeps the logits until the backward, which writes the gradient later):
    +1.4 GiB in Llama-1B's step. ``kernels/linear_cross_entropy.py`` is the path that never holds the
    whole logits.

Numerics
    The log-sum-exp and the softmax in fp32 from the logits as the GEMM rounded them, as the
    plain path; the gradient is rounded once to the logits' dtype before the scale (the plain
    path rounds after it), and the weight's gradient sees the hidden states times the scale
    rounded to their dtype: differences of bf16's rounding, in the loss none (it is summed
    in fp32). Labels of -100 are ignored (no loss, zero gradient); any other label must lie in
    0 … vocab − 1, as ``F.cross_entropy`` requires: one outside (a padded class, a stray id)
    gets a NaN loss, so the run's loss says so (the plain path asserts on the device instead;
    neither checks on the host, which would wait for the GPU).

torch.compile
    The kernel is a ``triton_op`` (``kernels/_triton.py``), so Inductor traces it without a
    graph break; the GEMMs around it are plain matmuls it compiles as the plain path's.
"""
import torch
import triton
import triton.language as tl

from ._triton import add, launch, maximum, op, rounded
from .linear_cross_entropy import linear_cross_entropy_reference

IGNORE = -100
Tensors2 = tuple[torch.Tensor, torch.Tensor]

LAUNCH = {"block": 4096, "warps": 8}
"""Columns a loop iteration and warps of the kernel's programs (one a token row)."""


@triton.jit
def _ce_rows(logits_ptr, grad_ptr, labels_ptr, loss_ptr, n_cols, vocab, logits_stride,
             grad_stride, IGNORE_INDEX: tl.constexpr, BLOCK: tl.constexpr):
    """Row r: its loss ``lse − logit[label]`` (0 for an ignored label) into loss[r], and
    ``softmax − one-hot`` (zero past ``vocab`` and on an ignored row) into grad's row r. Rows
    start ``*_stride`` elements apart (padded past ``n_cols`` where the width is odd)."""
    row = tl.program_id(0).to(tl.int64)
    src = logits_ptr + row * logits_stride
    dst = grad_ptr + row * grad_stride
    label = tl.load(labels_ptr + row)
    valid = label != IGNORE_INDEX
    known = (label >= 0) & (label < vocab)
    stray = valid & (known == 0)  # no class of the vocabulary: a NaN loss, no gradient
    label = tl.where(known, label, 0)
    idx = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's running maximum
    total = tl.zeros([BLOCK], tl.float32)  # and its sum of exp(x − top)
    for start in range(0, vocab, BLOCK):
        cols = start + idx
        x = tl.load(src + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new = tl.maximum(top, x)
        # a lane that has seen only -inf (past the vocabulary) keeps a sum of 0, not NaN
        seen = new != float("-inf")
        total = tl.where(seen, total * tl.exp(top - new) + tl.exp(x - new), 0.0)
        top = new
    peak = tl.reduce(top, 0, maximum)
    lse = peak + tl.log(tl.reduce(total * tl.exp(top - peak), 0, add))
    picked = tl.load(src + tl.where(valid, label, 0)).to(tl.float32)
    loss = tl.where(valid, lse - picked, 0.0)
    tl.store(loss_ptr + row, tl.where(stray, float("nan"), loss))
    for start in range(0, n_cols, BLOCK):
        cols = start + idx
        inside = cols < n_cols
        x = tl.load(src + cols, mask=inside, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
        g = tl.where((cols < vocab) & valid & known, g, 0.0)
        tl.store(dst + cols, rounded(g, dst.dtype.element_ty), mask=inside)


@op("fasttrain::ce_loss_grad")
def _ce_loss_grad(logits: torch.Tensor, labels: torch.Tensor,
                  vocab: int) -> Tensors2:
    """(per-row loss, the gradient in rows padded to 16 bytes: slice it to the logits' width)."""
    rows, cols = logits.shape
    grad = _aligned_rows(rows, cols, logits.dtype, logits.device)
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows > 0:
        launch(_ce_rows, (rows,), logits, grad, labels, loss, cols, vocab, logits.stride(0),
               grad.stride(0), IGNORE_INDEX=IGNORE, BLOCK=LAUNCH["block"],
               num_warps=LAUNCH["warps"])
    return loss, grad


def _aligned_rows(rows: int, cols: int, dtype: torch.dtype, device: torch.device
                  ) -> torch.Tensor:
    """An empty (rows, width) tensor, width = cols rounded up so that rows start on 16 bytes:
    for an odd width (GPT-2's 50,257) the caller takes its first cols columns, rows padded in
    memory as Inductor pads its own buffers, so that the gradient GEMMs that read it get
    aligned leading dimensions (GPT-2's head + loss on an H100: 1.8× slower than compiled
    with unaligned rows, 13% slower with aligned ones, kernels-micro-linear-ce-20261127b-h100).
    The op returns the whole buffer (a custom op's output is not a view)."""
    per = 16 // torch.empty((), dtype=dtype).element_size()
    width = -(-cols // per) * per
    return torch.empty(rows, width, dtype=dtype, device=device)


class _LinearCrossEntropyFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab: int, dtype: torch.dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            logits = h @ w.t()  # (N, V) in the compute dtype
            if logits.stride(1) != 1:  # rows of the kernel: each one contiguous
                logits = logits.contiguous()
            loss, padded = torch.ops.fasttrain.ce_loss_grad(logits, labels, vocab)
            grad = padded[:, :logits.shape[1]]
        ctx.save_for_backward(h, w, grad)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        h, w, grad = ctx.saved_tensors
        dh = dw = None
        if ctx.needs_input_grad[0]:  # the scale on the GEMM's (N, C) output, in fp32
            dh = ((grad @ w).float() * grad_loss).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:  # the scale on the (N, C) hidden states before the GEMM
            dw = (grad.t() @ (h.float() * grad_loss).to(h.dtype)).to(ctx.dtypes[1])
        return dh, dw, None, None, None


def linear_cross_entropy_fused(hidden: torch.Tensor, weight: torch.Tensor,
                               labels: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100`` ignored), the
    logits' gradient written by the loss's own kernel (module docstring).

    ``hidden`` (..., C), ``weight`` (V, C), ``labels`` (...); ``vocab``: the classes are the
    first ``vocab`` rows of the weight, the rest padding. The logits are computed in autocast's
    dtype where it is on, else in ``hidden``'s."""
    if hidden.shape[-1] != weight.shape[-1] or hidden.shape[:-1] != labels.shape:
        raise ValueError(f"linear_cross_entropy_fused: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)} and labels {tuple(labels.shape)} do not match")
    vocab = weight.shape[0] if vocab is None else vocab
    if not 0 < vocab <= weight.shape[0]:
        raise ValueError(f"linear_cross_entropy_fused: vocab {vocab} is not in "
                         f"1..{weight.shape[0]}")
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return linear_cross_entropy_reference(hidden, weight, labels, vocab=vocab)  # no grad
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    return _LinearCrossEntropyFused.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                          labels.reshape(-1).contiguous(), vocab, dtype)
