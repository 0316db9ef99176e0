"""Hugging Face ``LlamaForCausalLM`` at Llama-3.2-1B shapes (sdpa), optionally with Liger-Kernel."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

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


def causal_lm_config(transformers, size: str, config_file: str | None = None):
    """The config of the ``hf:llama`` workload and its peer: Llama-3.2-1B's shapes (``base``) or
    their miniature (``tiny``), or a ``config.json`` of a Llama, Mistral or Qwen2 model (its
    ``model_type`` picks the class); attention through SDPA, no KV cache."""
    if config_file is None:
        if size not in ("base", "tiny"):
            raise ValueError(f"hf:llama comes in sizes base (Llama-3.2-1B shapes) and tiny, "
                             f"not {size!r}")
        return llama_config(transformers, TINY if size == "tiny" else LLAMA_1B)
    path = Path(config_file)
    if not path.is_file():
        raise FileNotFoundError(f"config {config_file}: no such file")
    fields = json.loads(path.read_text())
    kind = fields.pop("model_type", None)
    if kind not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"config {config_file}: model_type {kind!r} is not llama, mistral or "
                         "qwen2")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        fields.pop(key, None)
    return transformers.AutoConfig.for_model(kind, **dict(fields, use_cache=False),
                                             attn_implementation="sdpa")


def build(workload: str, size: str, batch: int | None, device: torch.device, tiny: bool, recipe,
          options: dict | None = None) -> PeerSpec:
    """LlamaForCausalLM with random weights; labels = input_ids (the model shifts them). The
    ``hf:llama`` workload's peer takes its ``config`` option (a config.json) as well."""
    transformers = require("transformers")
    liger = workload == "llama-liger"
    if liger:
        require("liger_kernel.transformers", "liger-kernel")
    if size != "base":
        raise ValueError(f"peer {workload} has no size {size!r} (sizes: base = Llama-3.2-1B shapes)")
    config_file = (options or {}).get("config")
    config = causal_lm_config(transformers, "tiny" if tiny else "base", config_file)
    fields = config.to_diff_dict() if config_file else (TINY if tiny else LLAMA_1B)
    default_batch, seq = SHAPES["tiny" if tiny else "base"]
    seq = int((options or {}).get("seq_len") or seq)
    batch = batch or default_batch
    model = transformers.AutoModelForCausalLM.from_config(config).to(device).train()
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != "sdpa":
        raise RuntimeError(f"LlamaForCausalLM chose attention {attn!r}, not sdpa")
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)  # (B, T)

    def loss(mods: dict) -> torch.Tensor:
        return mods["model"](input_ids=ids, labels=ids).loss

    info = {"config": dict(fields, rope=ROPE) if not config_file else fields, "seq_len": seq, "attn_implementation": attn,
            "params": sum(p.numel() for p in model.parameters()),
            "transformers": package_version("transformers")}
    prepare = None
    if liger:
        info["liger_kernel"] = package_version("liger-kernel")
        prepare = lambda: apply_liger(model)  # noqa: E731 — after FLOPs are counted on plain HF
    return PeerSpec(
        public=("transformers+liger" if liger else "transformers") + f":{type(model).__name__}("
        + (Path(config_file).name if config_file else "Llama-3.2-1B") + (",tiny" if tiny else "")
        + ",sdpa)",
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
