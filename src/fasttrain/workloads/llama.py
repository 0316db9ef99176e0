"""Llama 3.2 causal language modelling (the shapes of transformers' LlamaForCausalLM).

``base`` is Llama-3.2-1B and ``large`` Llama-3.2-3B: GQA attention, SwiGLU, RMSNorm, RoPE with
Llama 3's long-context frequency adjustment, input and output embeddings tied. Parameter names
follow transformers. Items are tokens: the loss is summed over labels that are not -100.
Options: ``seq_len`` overrides the sequence length; ``vocab`` the vocabulary (50,257 for
GPT-2's, say: an odd width for the head's GEMMs, see ``gemm_pad``); ``token_dtype`` is the
element type of a user's flat token file given as ``data``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import MappingProxyType
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..layers.attention import attention, native_gqa
from ..layers.fused import TokenEmbeddingStream
from ..layers.loss import LMHeadLoss
from ..layers.mlp import SwiGLU
from ..layers.norm import RMSNorm
from ..layers.rope import Rotary
from ..layers.tied import ties, tied_lookup
from .base import Workload
from .data import TokenWindows, VariableWindows, write_token_file
from ..measure.files import cache_root


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 128256
    dim: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    hidden: int = 8192
    seq: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_factor: float = 32.0
    rope_low_freq: float = 1.0
    rope_high_freq: float = 4.0
    rope_original_max: int = 8192


CONFIGS = {
    "tiny": LlamaConfig(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, hidden=128, seq=64),
    "base": LlamaConfig(),
    "large": LlamaConfig(dim=3072, layers=28, heads=24),
}
TOKEN_DTYPES = {"uint32": np.uint32, "uint16": np.uint16}


def rope_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) in float32, adjusted like transformers' ``llama3`` rope type."""
    d = cfg.dim // cfg.heads
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    wavelen = 2 * math.pi / inv
    low_wl = cfg.rope_original_max / cfg.rope_low_freq  # longer waves: divided by the factor
    high_wl = cfg.rope_original_max / cfg.rope_high_freq  # shorter waves: kept
    smooth = (cfg.rope_original_max / wavelen - cfg.rope_low_freq) / (
        cfg.rope_high_freq - cfg.rope_low_freq)
    mid = (1 - smooth) * inv / cfg.rope_factor + smooth * inv  # in between: interpolated
    return torch.where(wavelen < high_wl, inv,
                       torch.where(wavelen > low_wl, inv / cfg.rope_factor, mid))


def rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, D) in float32 for positions 0..seq-1 (half-split layout, as transformers)."""
    freqs = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), rope_frequencies(cfg))
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    """GQA attention with RoPE (``layers.rope.Rotary``; ``kernels=rope`` rotates q and k in one
    Triton kernel)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.rotary = Rotary()
        self.q_proj = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        q, k = self.rotary(q, k, cos, sin)
        gqa = self.kv_heads != self.heads
        if gqa and not native_gqa(q):
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, T, D)
            gqa = False
        out = attention(q, k, v, causal=True, enable_gqa=gqa)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, eps=cfg.norm_eps, feeds_matmul=True)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, eps=cfg.norm_eps, feeds_matmul=True)
        self.mlp = SwiGLU(cfg.dim, cfg.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                branch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(stream, mlp_branch)``: with fused norms (``kernels=rmsnorm``) the MLP's output is
        handed on unadded, for the next norm to add in its kernel (``branch``); on the plain
        path it is added here and None handed on."""
        if branch is None:
            y = self.input_layernorm(x)
        else:
            y, x = self.input_layernorm.add(branch, x)
        y, x = self.post_attention_layernorm.add(self.self_attn(y, cos, sin), x)
        if self.post_attention_layernorm.fused:
            return x, self.mlp(y)
        return x + self.mlp(y), None


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


class Llama(TokenEmbeddingStream, nn.Module):
    reads_linear_weights = ("lm_head",)  # the head's weight goes to the loss kernel as a tensor

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, feeds_matmul=True)
        self.stream_dtype: torch.dtype | None = None  # set by the stream_dtype technique
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False, device="meta")
        self.lm_head.weight = self.embed_tokens.weight  # tied, as Llama 3.2
        self.head_loss = LMHeadLoss(vocab=cfg.vocab)  # the kernels switch fuses it
        cos, sin = rope_tables(cfg)  # on the build device
        self.register_buffer("rope_cos", cos, persistent=False)  # (T, D) float32
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(_init_weights)

    def hidden(self, input_ids: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) token ids → (B, T, C) final hidden states (after the last norm); ``x``: their
        embeddings, where the caller looked them up."""
        T = input_ids.shape[1]
        if T > self.rope_cos.shape[0]:
            raise ValueError(f"sequence of {T} tokens is longer than the model's {self.cfg.seq}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        if x is None:
            x = self.embed_tokens(input_ids)  # (B, T, C)
        if self.stream_dtype is not None:
            x = x.to(self.stream_dtype)
        branch = None  # the last block's MLP output, where the norms add it (kernels=rmsnorm)
        for layer in self.layers:
            x, branch = layer(x, cos, sin, branch)
        return self.norm(x) if branch is None else self.norm.add(branch, x)[0]

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids → (B, T, vocab) next-token logits in the compute dtype."""
        return self.lm_head(self.hidden(input_ids))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not ties(self.embed_tokens, self.lm_head.weight):  # untied, or a hooked embedding
            return self.head_loss(self.hidden(input_ids), self.lm_head.weight, labels)
        x, head = tied_lookup(self.embed_tokens.weight, input_ids)
        return self.head_loss(self.hidden(input_ids, x), head, labels)


class TokenFile(TokenWindows):
    """A user's flat token file; every id must be below ``vocab`` (one numpy pass to check)."""

    def __init__(self, path: Path, seq_len: int, vocab: int, seed: int, dtype):
        if not Path(path).is_file():
            raise FileNotFoundError(f"token file {path} does not exist: check the data path "
                                    "(a flat file of token ids)")
        super().__init__(Path(path), seq_len, seed=seed, dtype=dtype)
        top = int(self.tokens.max())
        if top >= vocab:
            raise ValueError(f"token file {path} holds id {top}, outside the vocabulary of {vocab}")


class LlamaWorkload(Workload):
    name, unit = "llama", "tok"
    count_field, ignore_index = "labels", -100

    def __init__(self, size: str, seed: int, data: str | None, seq_len: int | None,
                 token_dtype: str, varlen: bool = False, vocab: int | None = None):
        if token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"token_dtype must be 'uint32' or 'uint16', not {token_dtype!r}")
        cfg = CONFIGS[size]
        if seq_len is not None:
            if int(seq_len) < 1:
                raise ValueError(f"seq_len must be positive, not {seq_len!r}")
            cfg = replace(cfg, seq=int(seq_len))
        if vocab is not None:
            if int(vocab) < 2:
                raise ValueError(f"vocab must be at least 2, not {vocab!r}")
            cfg = replace(cfg, vocab=int(vocab))
        self.size, self.seed, self.data_path, self.cfg = size, seed, data, cfg
        self.token_dtype = TOKEN_DTYPES[token_dtype]
        self.default_batch = {"tiny": 4, "base": 4, "large": 2}[size]
        self.varlen = bool(varlen)
        self.max_length = cfg.seq  # padding never goes past the RoPE tables
        if self.varlen:  # documents of 1/8 to all of seq_len tokens, padded per batch
            self.pad_fields = MappingProxyType({"input_ids": 0, "labels": -100})

    def build_model(self) -> nn.Module:
        return Llama(self.cfg)

    def dataset(self) -> TokenWindows | VariableWindows:
        cfg = self.cfg
        if self.data_path is not None:
            windows = TokenFile(self.data_path, cfg.seq, cfg.vocab, self.seed, self.token_dtype)
        else:
            count = 256 * (cfg.seq + 1)  # 256 windows
            path = write_token_file(cache_root() / f"tokens-{count}-v{cfg.vocab}.u32", count,
                                    cfg.vocab, seed=1234)
            windows = TokenWindows(path, cfg.seq, seed=self.seed)
        return VariableWindows(windows, cfg.seq // 8, self.seed) if self.varlen else windows


def make(size: str = "tiny", seed: int = 0, data: str | None = None, seq_len: int | None = None,
         token_dtype: str = "uint32", varlen: bool = False, vocab: int | None = None
         ) -> LlamaWorkload:
    return LlamaWorkload(size, seed, data, seq_len, token_dtype, varlen, vocab)
