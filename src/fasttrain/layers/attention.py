"""Attention through torch's scaled_dot_product_attention, heads too wide for its kernels, and
ViT's self-attention layer with its fused Triton path.

Which kernel SDPA picks (flash, memory-efficient, cuDNN, math) is decided by the attention
technique with ``torch.nn.attention.sdpa_kernel`` around the step, never here, so every model
gets the same switch. Inputs are (B, heads, T, head_dim).

Heads wider than 256 (the SD VAE's mid-block: one head of 512 over 4,096 positions) have no
flash or cuDNN kernel, and SDPA runs its memory-efficient kernel at ~140 TFLOP/s (1.98 ms at
batch 8). Without autograd (a frozen encoder) on a GPU, such attention is computed as SDPA's math
kernel computes it, as two GEMMs around a softmax, with the scores accumulated and kept in fp32
and the probabilities rounded to the inputs' dtype before the second GEMM (as the fused kernels
do): 0.73 ms compiled at the VAE's shape, with a largest error against an fp32 SDPA comparable
to the memory-efficient kernel's (6.0e-4 against 5.5e-4;
``benchmarks/results/kernels-micro-wide-attention-20261122-0445.jsonl``). The fp32 scores take
B·heads·Tq·Tk·4 bytes (0.5 GiB for the VAE at 512 px; the softmax's output is a second such
buffer); above 1 GiB of scores, SDPA runs instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import FusedPath
from .linear import linear

FUSED_MAX_HEAD_DIM = 256  # the widest head SDPA's flash and cuDNN kernels take
# The longest sequence the Triton self-attention kernel takes from SDPA where a layer can choose
# per call (MultiheadSelfAttention, layers/sdpa_route.py). A plain-PyTorch ViT-B attention
# (packed qkv projection, 12 heads, bf16, ~100k tokens a batch), forward + backward compiled, on
# an H100: 2.95 / 2.89 / 3.60 / 4.95 ms against SDPA's 3.50 / 3.34 / 3.87 / 5.02 at 197 / 256 /
# 512 / 1,024 tokens reading q, k and v in place (the router's eager path), 3.21 / 3.14 / 3.83 /
# 5.18 with the backward's copy (its compiled path) (sdpa-route-micro-20261126-1614); the
# H200's ViT layer: 18% faster at 197 tokens, 12% slower at 1,024
# (kernels-micro-attention-20261122-0300).
SEQ_ATTENTION_MAX_TOKENS = 512
SCORES_MAX_BYTES = 1 << 30
GEMM_EVENT = "fasttrain::gemm_attention"  # the profiler label techniques.attention counts


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              bias: torch.Tensor | None = None, causal: bool = False,
              enable_gqa: bool = False) -> torch.Tensor:
    """softmax(q kᵀ / √d + bias) v ; ``bias`` is additive (B or 1, heads or 1, Tq, Tk)."""
    if bias is None and not causal and not enable_gqa and _wide_inference(q, k, v):
        with torch.profiler.record_function(GEMM_EVENT):  # the run's attention line counts it
            return gemm_attention(q, k, v)
    if bias is not None and bias.dtype != q.dtype:
        bias = bias.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal,
                                          enable_gqa=enable_gqa)


def _wide_inference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Heads SDPA has no fused kernel for, on a GPU, in 16-bit, without autograd, within the
    scores' memory cap."""
    if q.dim() != 4:
        return False
    B, H, Tq, D = q.shape
    return (D > FUSED_MAX_HEAD_DIM and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and k.shape == v.shape == (B, H, k.shape[2], D)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
            and B * H * Tq * k.shape[2] * 4 <= SCORES_MAX_BYTES)


def gemm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d) v as two batched GEMMs and a softmax: fp32 scores (a 16-bit GEMM with
    fp32 output on a GPU, fp32 inputs elsewhere), probabilities in v's dtype."""
    B, H, Tq, D = q.shape
    q3, k3, v3 = (t.reshape(B * H, t.shape[2], D) for t in (q, k, v))
    if q.is_cuda:
        scores = torch.bmm(q3, k3.transpose(1, 2), out_dtype=torch.float32)
    else:
        scores = torch.bmm(q3.float(), k3.float().transpose(1, 2))
    probs = scores.mul_(D ** -0.5).softmax(dim=-1).to(v.dtype)  # two fp32 buffers at a time
    return torch.bmm(probs, v3).view(B, H, Tq, D)


def native_gqa(q: torch.Tensor) -> bool:
    """Whether SDPA can take fewer KV heads than query heads (``enable_gqa``) for ``q``.

    CPU and CUDA's flash and math kernels accept it; CUDA's memory-efficient kernel rejects
    unequal head counts ("No available kernel" under sdpa_kernel, torch 2.11 on an H200) and
    cuDNN's support varies by version, so where flash cannot run the KV heads are expanded with
    repeat_interleave instead.
    """
    if q.device.type != "cuda":
        return True
    return flash_enabled() and q.dtype in (torch.float16, torch.bfloat16)


def flash_enabled() -> bool:
    """``torch.backends.cuda.flash_sdp_enabled()``, read through the C function that Dynamo
    folds to a constant. The public wrapper is not on Dynamo's list of constant-folded
    functions in every version: where it is not, it returns a non-tensor from a traced call
    and breaks the graph, in every attention layer of a compiled model (and at each break,
    AOTAutograd makes the gradients that cross it contiguous: copies of q's, k's, v's and the
    output's gradients in every layer's backward)."""
    return torch._C._get_flash_sdp_enabled()


def causal_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of (B, H, T, D) queries over (B, KV, T, D) keys and values, KV dividing
    H: SDPA's own GQA where it takes it (``native_gqa``), else the KV heads repeated."""
    gqa = k.shape[1] != q.shape[1]
    if gqa and not native_gqa(q):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, T, D)
        gqa = False
    return attention(q, k, v, causal=True, enable_gqa=gqa)


class SelfAttention(FusedPath, nn.Module):
    """Multi-head self-attention. Plain: the qkv projection viewed as (3, B, heads, T, D), SDPA,
    the heads put back side by side. Fused (``kernels=attention``): ``kernels/seq_attention.py``,
    one Triton kernel each way straight from the qkv projection's (B, T, 3·C) output, which
    writes (B, T, C) and, backward, the qkv gradient in that layout (no permutes, no stack of
    dq, dk, dv); the backward kernels also sum the qkv bias's gradient."""

    fused_kind, fused_triton, replaces_sdpa = "attention", True, True
    attention_name = "self-attention"

    def __init__(self, dim: int, heads: int, batch_second: bool = False):
        super().__init__()
        self.heads, self.batch_second, self.fused = heads, batch_second, False
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def use_fused(self, on: bool) -> list[str]:
        head_dim = self.qkv.out_features // (3 * self.heads)
        if on and head_dim > FUSED_MAX_HEAD_DIM:
            return [f"self-attention of head dim {head_dim} kept on SDPA (Triton kernel: "
                    f"≤ {FUSED_MAX_HEAD_DIM})"]
        self.fused = on
        return ["self-attention from the qkv projection's layout in one Triton kernel each way"]

    def forward(self, x: torch.Tensor, mask: None = None, proj_bias: bool = True
                ) -> torch.Tensor:
        """``proj_bias=False`` leaves the output projection's bias out, for the caller to add."""
        if self.fused:  # (B, T, C), or (T, B, C) batch second, in and out
            from ..kernels.seq_attention import projected_seq_attention, seq_attention

            if type(self.qkv) is nn.Linear:
                out = projected_seq_attention(x, self.qkv.weight, self.qkv.bias, self.heads,
                                              batch_second=self.batch_second)
            else:  # another technique's linear layer (fp8): its own forward and bias gradient
                out = seq_attention(self.qkv(x), self.heads, batch_second=self.batch_second)
        elif self.batch_second:  # (T, B, C) → heads-major (3, B, H, T, D)
            T, B, C = x.shape
            qkv = self.qkv(x).view(T, B, 3, self.heads, C // self.heads).permute(2, 1, 3, 0, 4)
            out = attention(*qkv.unbind(0))  # (B, H, T, D)
            out = out.permute(2, 0, 1, 3).reshape(T, B, C)
        else:
            B, T, C = x.shape
            qkv = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
            out = attention(*qkv.unbind(0)).transpose(1, 2).reshape(B, T, C)  # from (B, H, T, D)
        return linear(self.proj, out, bias=proj_bias)

    def first_queries(self, x: torch.Tensor, rows: int, proj_bias: bool = True) -> torch.Tensor:
        """The attention output of the first ``rows`` tokens of ``x`` (B, T, C) alone, their
        queries over every token's keys and values: (B, rows, C). What a model whose head reads
        those tokens needs of its last block; the queries of the others are not computed."""
        if self.batch_second:
            raise ValueError("first_queries takes (B, T, C), not the batch-second layout")
        B, T, C = x.shape
        D = C // self.heads
        if type(self.qkv) is nn.Linear:  # the query rows' projection apart from the keys'
            w, b = self.qkv.weight, self.qkv.bias
            q = F.linear(x[:, :rows], w[:C], None if b is None else b[:C])
            kv = F.linear(x, w[C:], None if b is None else b[C:])
        else:  # another technique's linear layer (fp8, INT8): its own forward, whole
            qkv = self.qkv(x)
            q, kv = qkv[:, :rows, :C], qkv[..., C:]
        q = q.reshape(B, rows, self.heads, D).transpose(1, 2)
        k, v = kv.reshape(B, T, 2, self.heads, D).permute(2, 0, 3, 1, 4).unbind(0)
        out = attention(q, k, v).transpose(1, 2).reshape(B, rows, C)
        return linear(self.proj, out, bias=proj_bias)


class MultiheadSelfAttention(FusedPath, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` (the same parameters: ``in_proj_weight``, ``in_proj_bias``,
    ``out_proj``) whose self-attention calls, ``mha(x, x, x, need_weights=False)`` with no mask,
    run on the fused path (``kernels=attention``) as ``SelfAttention``'s: the packed projection
    and one Triton kernel each way from its (B, T, 3·C) output (``batch_first=False``: the
    (T, B, C) layout), its bias's gradient summed by the backward kernels. Every other call (a
    mask, causal, attention weights asked for, separate query/key/value tensors, unbatched
    input, dropout in training, more than ``SEQ_ATTENTION_MAX_TOKENS`` tokens) runs
    ``nn.MultiheadAttention``'s own forward, as does the plain path."""

    fused_kind, fused_triton, replaces_sdpa = "attention", True, True
    attention_name = "multi-head self-attention"

    def use_fused(self, on: bool) -> list[str]:
        if on and self.head_dim > FUSED_MAX_HEAD_DIM:
            return [f"multi-head self-attention of head dim {self.head_dim} kept on SDPA "
                    f"(Triton kernel: ≤ {FUSED_MAX_HEAD_DIM})"]
        self.fused = on
        return ["multi-head self-attention from the packed projection in one Triton kernel "
                "each way"]

    def fuses(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              key_padding_mask, need_weights: bool, attn_mask, is_causal: bool) -> bool:
        """Whether this call is one the fused path computes."""
        return (self.fused and query is key and key is value and query.dim() == 3
                and key_padding_mask is None and attn_mask is None and not need_weights
                and not is_causal and (self.dropout == 0.0 or not self.training)
                and query.shape[1 if self.batch_first else 0] <= SEQ_ATTENTION_MAX_TOKENS)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.fuses(query, key, value, key_padding_mask, need_weights, attn_mask,
                          is_causal):
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        from ..kernels.seq_attention import projected_seq_attention

        out = projected_seq_attention(query, self.in_proj_weight, self.in_proj_bias,
                                      self.num_heads, batch_second=not self.batch_first)
        return self.out_proj(out), None  # (B, T, C), or (T, B, C)
