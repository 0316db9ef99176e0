"""Converters for Hugging Face transformers' Llama (and Mistral and Qwen2, whose classes have the
same structure): ``LlamaRMSNorm``, ``LlamaMLP``, ``LlamaAttention``, ``LlamaDecoderLayer``,
``LlamaModel`` and ``LlamaForCausalLM``.

- ``RMSNorm`` → ``layers.norm.RMSNorm`` computing transformers' formula on the plain path
  (``kernels=rmsnorm``: the norm, and in a converted layer the residual add before it, in one
  Triton pass each way).
- ``MLP`` (SiLU gate) → ``layers.mlp.SwiGLU`` (``kernels=swiglu``).
- ``Attention`` → the same projections, RoPE through ``layers.rope.Rotary`` (``kernels=rope``:
  q and k rotated in one kernel) and causal SDPA with its own GQA.
- ``DecoderLayer`` → the residual add before the second norm inside that norm's kernel, and the
  MLP branch handed to the next layer's first norm where ``Model`` is converted too.
- ``Model`` → the training forward without a cache or a padding mask: embeddings, RoPE tables,
  the layers as one chain, the residual stream in bf16 where ``stream_dtype`` asks.
- ``ForCausalLM`` → with ``labels`` and no cache, the LM head and the shifted cross-entropy
  through ``layers.loss.LMHeadLoss`` (``kernels=loss``: the cross-entropy's kernel writes the
  logits' gradient in the forward); the output's ``logits`` are then None (call without labels
  for logits).

The model and the causal LM have no self-check of their own (it would copy the whole model):
their fast paths run only the converted, self-checked layers, and only when every layer was
converted. Every converted class keeps the library's forward for what it does not compute (a KV cache, an
attention mask, ``output_attentions``, position ids of their own): the call goes to the library
class's ``forward`` on the same module. The classes' parameter names and buffers are untouched.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import causal_gqa_attention
from ..layers.fused import TokenEmbeddingStream
from ..layers.linear import linear
from ..layers.loss import LMHeadLoss
from ..layers.mlp import SwiGLU
from ..layers.norm import RMSNorm
from ..layers.rope import Rotary
from ..layers.tied import hooked, ties, tied_lookup
from .registry import (SAMPLE_TOKENS, Converter, class_path, library_forward, remember,
                       sequence_sample, swap_keeping_library)

FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def sources(suffix: str) -> tuple[str, ...]:
    return tuple(f"transformers.models.{mod}.modeling_{mod}.{name}{suffix}"
                 for mod, name in FAMILIES.items())


RMS_NORM, MLP, ATTENTION = sources("RMSNorm"), sources("MLP"), sources("Attention")
DECODER_LAYER, MODEL, CAUSAL_LM = sources("DecoderLayer"), sources("Model"), sources("ForCausalLM")
def no_cache(kwargs: dict) -> bool:
    """No KV cache in play (training)."""
    return (kwargs.get("past_key_values") is None and kwargs.get("cache") is None
            and not kwargs.get("use_cache"))


# ----------------------------------------------------------------------------- RMSNorm

class HFRMSNorm(RMSNorm):
    """transformers' RMSNorm: fp32 statistics, normalised value rounded to the input's dtype,
    then scaled by the weight (the plain path keeps that order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return super().forward(x)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            return super().add(x, residual)
        h = x + residual
        return self.forward(h), h


def rms_norm_unsupported(m: nn.Module) -> str | None:
    if m.weight is None or m.weight.dim() != 1:
        return "an RMSNorm without a weight vector"
    return None


def swap_rms_norm(m: nn.Module) -> None:
    m.eps = float(m.variance_epsilon)
    m.normalized_shape, m.elementwise_affine = (m.weight.shape[0],), True
    m.feeds_matmul, m.fused = True, False
    m.__class__ = HFRMSNorm


# ----------------------------------------------------------------------------- MLP

def is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def mlp_unsupported(m: nn.Module) -> str | None:
    if not is_silu(m.act_fn):
        return f"activation {type(m.act_fn).__name__} is not SiLU"
    if not all(type(p) is nn.Linear for p in (m.gate_proj, m.up_proj, m.down_proj)):
        return "a projection is not a plain nn.Linear"
    return None


def swap_mlp(m: nn.Module) -> None:
    m.fused = False
    m.__class__ = SwiGLU


# ----------------------------------------------------------------------------- Attention

class HFAttention(nn.Module):
    """transformers' attention with RoPE through ``Rotary`` and causal SDPA (its own GQA)."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any):
        if (attention_mask is not None or position_embeddings is None or not no_cache(kwargs)
                or kwargs.get("output_attentions") or position_embeddings[0].shape[0] != 1
                or (self.training and self.attention_dropout > 0)):
            return library_forward(self, hidden_states, position_embeddings=position_embeddings,
                                   attention_mask=attention_mask, **kwargs)
        B, T, _ = hidden_states.shape
        D = self.head_dim
        q = self.q_proj(hidden_states).view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(hidden_states).view(B, T, -1, D).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(hidden_states).view(B, T, -1, D).transpose(1, 2)
        cos, sin = position_embeddings  # (1, T, D)
        q, k = self.rotary(q, k, cos[0], sin[0])
        out = causal_gqa_attention(q, k, v)  # (B, H, T, D)
        return linear(self.o_proj, out.transpose(1, 2).reshape(B, T, -1)), None


def attention_unsupported(m: nn.Module) -> str | None:
    if abs(m.scaling - m.head_dim ** -0.5) > 1e-12:
        return f"attention scale {m.scaling} is not head_dim^-1/2"
    window = (m.sliding_window if hasattr(m, "sliding_window")  # Qwen2: per layer
              else getattr(m.config, "sliding_window", None))  # Mistral: the config's, always
    if window:
        return f"sliding-window attention ({window} tokens) is not in the converted attention"
    if not all(type(p) is nn.Linear for p in (m.q_proj, m.k_proj, m.v_proj, m.o_proj)):
        return "a projection is not a plain nn.Linear"
    if any(hasattr(m, n) for n in ("q_norm", "k_norm")):
        return "qk-norm is not in the converted attention"
    return None


def swap_attention(m: nn.Module) -> None:
    remember(m)
    m.rotary = Rotary()
    m.__class__ = HFAttention


def attention_sample(m: nn.Module, gen: torch.Generator) -> tuple[tuple, dict]:
    C = m.q_proj.in_features
    angles = torch.rand(1, SAMPLE_TOKENS, m.head_dim // 2, generator=gen) * 6.0
    emb = torch.cat([angles, angles], dim=-1)
    return (torch.randn(1, SAMPLE_TOKENS, C, generator=gen),), {
        "position_embeddings": (emb.cos(), emb.sin()), "attention_mask": None}


# ----------------------------------------------------------------------------- DecoderLayer

class HFDecoderLayer(nn.Module):
    """A decoder layer whose second norm adds the residual in its kernel; called by a converted
    model with ``chained=True`` it takes and hands on the MLP branch (``(x, branch)``)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                *args: Any, branch: torch.Tensor | None = None, hand_on: bool = False,
                chained: bool = False, **kwargs: Any):
        pe = kwargs.get("position_embeddings")
        if (args or attention_mask is not None or pe is None or not no_cache(kwargs)
                or kwargs.get("output_attentions")):
            assert branch is None and not chained, "a converted model chains only what it can"
            return library_forward(self, hidden_states, attention_mask, *args, **kwargs)
        x = hidden_states
        if branch is None:
            y = self.input_layernorm(x)
        else:
            y, x = self.input_layernorm.add(branch, x)
        a, _ = self.self_attn(y, position_embeddings=pe)
        y, x = self.post_attention_layernorm.add(a, x)
        m = self.mlp(y)
        if hand_on:
            return x, m
        return (x + m, None) if chained else x + m


def decoder_layer_unsupported(m: nn.Module) -> str | None:
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(m, name)
        if class_path(norm) not in RMS_NORM and not isinstance(norm, HFRMSNorm):
            return f"{name} is {type(norm).__name__}, not the library's RMSNorm"
    if class_path(m.mlp) not in MLP:
        return f"MLP {type(m.mlp).__name__} is not the library's"
    if why := mlp_unsupported(m.mlp):
        return f"MLP: {why}"
    if class_path(m.self_attn) not in ATTENTION:
        return f"attention {type(m.self_attn).__name__} is not the library's"
    if why := attention_unsupported(m.self_attn):
        return f"attention: {why}"
    return None


def swap_decoder_layer(m: nn.Module) -> None:
    for name in ("input_layernorm", "post_attention_layernorm"):
        if not isinstance(getattr(m, name), HFRMSNorm):
            swap_rms_norm(getattr(m, name))
    swap_mlp(m.mlp)
    swap_attention(m.self_attn)
    swap_keeping_library(m, HFDecoderLayer)


def decoder_layer_sample(m: nn.Module, gen: torch.Generator) -> tuple[tuple, dict]:
    (x,), kwargs = attention_sample(m.self_attn, gen)
    return (x,), {"position_embeddings": kwargs["position_embeddings"]}


# ----------------------------------------------------------------------------- Model

class HFModel(TokenEmbeddingStream, nn.Module):
    """The decoder stack's training forward (no cache, no padding mask, positions 0..T-1) as one
    chain of converted layers, the stream in ``stream_dtype`` where set; anything else goes to
    the library's forward."""

    stream_dtype: torch.dtype | None = None

    def forward(self, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any):
        if not self.chains(input_ids, attention_mask, args, kwargs):
            return library_forward(self, input_ids, attention_mask, *args, **kwargs)
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.chain(self.embed_tokens(input_ids)))

    def chains(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
               args: tuple, kwargs: dict) -> bool:
        """Whether this call is one that ``chain`` computes."""
        return not (args or input_ids is None or attention_mask is not None
                    or not no_cache(kwargs)
                    or any(kwargs.get(k) is not None for k in ("inputs_embeds", "position_ids"))
                    or kwargs.get("output_attentions") or kwargs.get("output_hidden_states")
                    or not all(isinstance(layer, HFDecoderLayer)
                               for layer in self.layers[: self.config.num_hidden_layers]))

    def chain(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) token embeddings → the final norm's output."""
        from torch.distributed.fsdp import FSDPModule

        layers = list(self.layers[: self.config.num_hidden_layers])
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, T)
        # the rotary tables in fp32, as the library's from fp32 embeddings (it reads only the
        # dtype and device of its first argument): also where the embedding is stored in bf16
        pe = self.rotary_emb(x.new_empty(0, dtype=torch.float32), positions)
        if self.stream_dtype is not None:
            x = x.to(self.stream_dtype)
        branch = None
        for i, layer in enumerate(layers):
            hand_on = (i + 1 < len(layers) and layer.post_attention_layernorm.fused
                       and not isinstance(layer, FSDPModule))
            x, branch = layer(x, position_embeddings=pe, branch=branch, hand_on=hand_on,
                              chained=True)
        return self.norm(x) if branch is None else self.norm.add(branch, x)[0]


def model_unsupported(m: nn.Module) -> str | None:
    if class_path(m.norm) not in RMS_NORM and not isinstance(m.norm, HFRMSNorm):
        return f"final norm {type(m.norm).__name__} is not the library's RMSNorm"
    if not hasattr(m, "rotary_emb"):
        return "no model-level rotary embedding (an older transformers)"
    return None


def swap_model(m: nn.Module) -> None:
    if not isinstance(m.norm, HFRMSNorm):
        swap_rms_norm(m.norm)
    m.stream_dtype = None
    swap_keeping_library(m, HFModel)


# ----------------------------------------------------------------------------- ForCausalLM

class HFCausalLM(nn.Module):
    """With labels (and no cache): the LM head and the shifted cross-entropy, averaged over the
    labelled tokens as the library's loss, through ``LMHeadLoss``; ``logits`` is None."""

    reads_linear_weights = ("lm_head",)  # the head's weight goes to the loss kernel as a tensor

    def forward(self, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *args: Any,
                labels: torch.Tensor | None = None, **kwargs: Any):
        if (args or labels is None or input_ids is None or not no_cache(kwargs)
                or kwargs.get("logits_to_keep") or kwargs.get("return_dict") is False):
            return library_forward(self, input_ids, attention_mask, *args, labels=labels,
                                   **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        items = kwargs.pop("num_items_in_batch", None)
        hidden, head = self.hidden_and_head(input_ids, attention_mask, **kwargs)
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100)  # the library's shift
        total = self.head_loss(hidden, head, shifted)
        if items is None:
            items = (shifted != -100).sum()
        return CausalLMOutputWithPast(loss=total / items, logits=None)

    def hidden_and_head(self, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor | None = None, **kwargs: Any
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's last hidden states and the head's weight to multiply them by. Where
        the embedding is tied to the head and the decoder's chain computes the call (and
        neither module has hooks: their forwards are not called), the rows and the weight come
        from ``layers.tied.tied_lookup``, so that the embedding's gradient is added to the
        head's rather than built dense."""
        model, head = self.model, self.lm_head.weight
        if (isinstance(model, HFModel) and ties(model.embed_tokens, head) and not hooked(model)
                and model.chains(input_ids, attention_mask, (), kwargs)):
            x, head = tied_lookup(head, input_ids)
            return model.chain(x), head
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     **kwargs).last_hidden_state, head


def causal_lm_unsupported(m: nn.Module) -> str | None:
    if type(m.lm_head) is not nn.Linear or m.lm_head.bias is not None:
        return "the LM head is not a plain bias-free nn.Linear"
    if getattr(m.config, "final_logit_softcapping", None):
        return "logit soft-capping is not in the fused loss"
    return None


def swap_causal_lm(m: nn.Module) -> None:
    if not isinstance(getattr(m, "head_loss", None), LMHeadLoss):
        m.head_loss = LMHeadLoss(vocab=m.lm_head.out_features)
    swap_keeping_library(m, HFCausalLM)


CONVERTERS = (
    Converter("transformers CausalLM", CAUSAL_LM, "LM head + shifted cross-entropy through "
              "LMHeadLoss (kernels=loss)", causal_lm_unsupported, swap_causal_lm),
    Converter("transformers decoder Model", MODEL, "the layers as one chain, the stream in "
              "stream_dtype", model_unsupported, swap_model),
    Converter("transformers DecoderLayer", DECODER_LAYER, "decoder layer with the residual "
              "adds in the RMSNorm kernels (kernels=rmsnorm, swiglu, rope)",
              decoder_layer_unsupported, swap_decoder_layer, decoder_layer_sample),
    Converter("transformers RMSNorm", RMS_NORM, "fasttrain RMSNorm (kernels=rmsnorm)",
              rms_norm_unsupported, swap_rms_norm,
              sequence_sample(lambda m: m.weight.shape[0])),
    Converter("transformers MLP", MLP, "fasttrain SwiGLU (kernels=swiglu)", mlp_unsupported,
              swap_mlp, sequence_sample(lambda m: m.gate_proj.in_features)),
)
