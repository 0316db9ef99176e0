"""Hugging Face causal language models as workloads: ``hf:llama``.

``transformers.LlamaForCausalLM`` at Llama-3.2-1B's shapes (``base``; ``tiny`` is a miniature of
the same classes), or the model a ``config=CONFIG.json`` describes (Llama, Mistral or Qwen2:
its ``model_type`` picks the class), with random weights or ``weights=FILE`` (a
``.safetensors`` state dict, every key checked; no download, ever). Attention through SDPA.
It trains on the reference Llama workload's token pipeline (the user's flat token file via
``--data``, else a synthetic one), next-token labels, cross-entropy summed over the tokens.

The loss is the model's decoder stack, its LM head and cross-entropy, as the library's
``ForCausalLM.forward`` computes them, written out here so that the ``kernels=loss`` switch can
run the head and the loss with the logits' gradient written by the loss's own Triton kernel
(``layers.loss.LMHeadLoss``; plain: the full logits, fp32 cross-entropy). The ``convert`` switch
turns the decoder's classes into fasttrain layers; the ladder's peer is the same model under
PyTorch best practice.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers.loss import LMHeadLoss
from ..measure.files import cache_root
from ..peers.hf_llama_peer import SHAPES, causal_lm_config
from .base import Workload
from .data import TokenWindows, write_token_file
from .weights import check_weights, load_weights


def import_transformers():
    try:
        import transformers
    except ImportError as err:
        raise ValueError(f"hf workloads need transformers (pip install transformers): {err}") \
            from None
    return transformers


class CausalLMLoss(nn.Module):
    """A transformers causal LM (``lm``) trained on (input ids, next-token labels): the decoder's
    last hidden states through the LM head into cross-entropy, summed over labelled tokens. The
    head's loss layer sits on the LM (``lm.head_loss``, no parameters), where the causal-LM
    converter finds and keeps it."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        lm.head_loss = LMHeadLoss(vocab=lm.lm_head.out_features)

    def forward(self, input_ids, labels):
        if callable(getattr(self.lm, "hidden_and_head", None)):  # converted
            hidden, head = self.lm.hidden_and_head(input_ids)
        else:
            hidden, head = self.lm.model(input_ids=input_ids).last_hidden_state, \
                self.lm.lm_head.weight
        return self.lm.head_loss(hidden, head, labels)  # hidden: (B, T, C)


class HFCausalLMWorkload(Workload):
    unit, converts = "tok", True
    count_field, ignore_index = "labels", -100

    def __init__(self, model: str, size: str, seed: int, data: str | None, config: str | None,
                 weights: str | None, seq_len: int | None):
        if model != "llama":
            raise ValueError(f"hf:{model} is not a workload: use hf:llama (with config=CONFIG.json "
                             "for a Llama, Mistral or Qwen2 of other shapes)")
        transformers = import_transformers()
        self.name, self.size, self.seed, self.data_path = "hf:llama", size, seed, data
        self.config_file, self.weights = config, weights
        self.config = causal_lm_config(transformers, size, config)
        self.seq = int(seq_len) if seq_len is not None else SHAPES["tiny" if size == "tiny" else "base"][1]
        if self.seq < 1:
            raise ValueError(f"seq_len must be positive, not {seq_len!r}")
        self.default_batch = SHAPES["tiny" if size == "tiny" else "base"][0]
        if weights is not None:
            with torch.device("meta"):
                check_weights(transformers.AutoModelForCausalLM.from_config(self.config), weights)

    def build_model(self) -> nn.Module:
        lm = import_transformers().AutoModelForCausalLM.from_config(self.config)
        if self.weights is not None:
            load_weights(lm, self.weights)
        return CausalLMLoss(lm)

    def dataset(self) -> TokenWindows:
        vocab = self.config.vocab_size
        if self.data_path is not None:
            from .llama import TokenFile, TOKEN_DTYPES

            return TokenFile(self.data_path, self.seq, vocab, self.seed, TOKEN_DTYPES["uint32"])
        count = 256 * (self.seq + 1)
        path = write_token_file(cache_root() / f"tokens-{count}-v{vocab}.u32", count, vocab,
                                seed=1234)
        return TokenWindows(path, self.seq, seed=self.seed)

    def describe(self) -> dict:
        return {**super().describe(), "model_type": self.config.model_type,
                "config": self.config_file, "weights": self.weights, "seq_len": self.seq,
                "transformers": import_transformers().__version__}


def make(model: str, size: str = "tiny", seed: int = 0, data: str | None = None,
         config: str | None = None, weights: str | None = None, seq_len: int | None = None
         ) -> HFCausalLMWorkload:
    return HFCausalLMWorkload(model, size, seed, data, config, weights, seq_len)
