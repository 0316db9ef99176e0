"""Hugging Face ``LlamaForCausalLM`` at Llama-3.2-1B shapes (sdpa), optionally with Liger-Kernel."""
from __future__ import annotations

import inspect

import torch

from .loop import PeerSpec, package_version, require

ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
LLAMA_1B = dict(  # meta-llama/Llama-3.2-1B config.json
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
    bos_token_id=128000, eos_token_id=128001,
)
TINY = dict(LLAMA_1B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2)
SHAPES = {"base": (4, 2048), "tiny": (2, 64)}  # (batch, sequence)


def llama_config(transformers, fields: dict):
    """A LlamaConfig with llama3 RoPE; transformers 5 takes ``rope_parameters``, 4.x ``rope_scaling``."""
    fields = dict(fields, use_cache=False)
    theta = fields.pop("rope_theta")
    if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:
        fields["rope_parameters"] = dict(ROPE, rope_theta=theta)
    else:
        fields.update(rope_theta=theta, rope_scaling=dict(ROPE))
    return transformers.LlamaConfig(**fields, attn_implementation="sdpa")


def build(workload: str, size: str, batch: int | None, device: torch.device, tiny: bool, recipe) -> PeerSpec:
    """LlamaForCausalLM with random weights; labels = input_ids (the model shifts them)."""
    transformers = require("transformers")
    liger = workload == "llama-liger"
    if liger:
        require("liger_kernel.transformers", "liger-kernel")
    if size != "base":
        raise ValueError(f"peer {workload} has no size {size!r} (sizes: base = Llama-3.2-1B shapes)")
    fields = TINY if tiny else LLAMA_1B
    default_batch, seq = SHAPES["tiny" if tiny else "base"]
    batch = batch or default_batch
    config = llama_config(transformers, fields)
    model = transformers.LlamaForCausalLM(config).to(device).train()
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != "sdpa":
        raise RuntimeError(f"LlamaForCausalLM chose attention {attn!r}, not sdpa")
    ids = torch.randint(0, fields["vocab_size"], (batch, seq), device=device)  # (B, T)

    def loss(mods: dict) -> torch.Tensor:
        return mods["model"](input_ids=ids, labels=ids).loss

    info = {"config": dict(fields, rope=ROPE), "seq_len": seq, "attn_implementation": attn,
            "params": sum(p.numel() for p in model.parameters()),
            "transformers": package_version("transformers")}
    prepare = None
    if liger:
        info["liger_kernel"] = package_version("liger-kernel")
        prepare = lambda: apply_liger(model)  # noqa: E731 — after FLOPs are counted on plain HF
    return PeerSpec(
        public=("transformers+liger" if liger else "transformers")
        + ":LlamaForCausalLM(Llama-3.2-1B" + (",tiny" if tiny else "") + ",sdpa)",
        trainable=model, modules={"model": model}, loss=loss, batch=batch, units=batch * seq,
        unit="tok/s", info=info, prepare=prepare,
    )


def apply_liger(model) -> dict:
    """Liger's RoPE, RMSNorm, SwiGLU and fused linear cross-entropy, patched into this model.

    Liger swaps ``modeling_llama.apply_rotary_pos_emb`` for the whole process (a fresh process per
    peer run keeps that from leaking).
    """
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    kernels = dict(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True,
                   cross_entropy=False)
    apply_liger_kernel_to_llama(model=model, **kernels)
    return {"liger_kernel": [k for k, on in kernels.items() if on]}
