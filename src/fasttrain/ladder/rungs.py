"""Named rungs. The default ladder follows the source (seeds/000): fp32 → tf32 → mixed precision
→ data loader → fused optimizer → flash attention → side-stream EMA → compile → CUDA graphs.
Each rung is the previous recipe plus its changes (cumulative)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import FasttrainError
from ..recipe import Recipe
from ..techniques.dataloader import default_workers
from ..workloads.base import Workload


@dataclass(frozen=True)
class Rung:
    name: str
    changes: dict[str, Any]
    comment: str
    when: str = "always"  # always | ema (workload keeps an EMA) | channels_last (conv-heavy)
    # | convert (a public model the converters reach)
    parity: str = "base"  # base: against the first rung | previous: the rung before | none
    parity_note: str = ""  # why a rung has no parity check


def default_rungs(workload: Workload) -> list[Rung]:
    scope = getattr(workload, "compile_scope", "model")
    return [
        Rung("fp32", {"precision": "fp32", "attention": "math", "optimizer_impl": "forloop"},
             "baseline: strict fp32, plain attention, for-loop AdamW, no loader workers"),
        Rung("tf32", {"precision": "tf32"}, "TF32 tensor-core matmuls (the source's baseline)"),
        Rung("bf16", {"precision": "bf16-mixed"}, "bf16 autocast"),
        Rung("dataloader", {"workers": default_workers(), "pin_memory": True,
                            "non_blocking": True, "device_prefetch": True},
             "loader workers, pinned memory, copies on a side stream"),
        Rung("fused-optim", {"optimizer_impl": "fused"}, "fused AdamW"),
        Rung("flash-attn", {"attention": "auto"}, "fused SDPA attention (flash where it can)"),
        Rung("ema-stream", {"ema": "side-stream"}, "foreach EMA on a side CUDA stream",
             when="ema"),
        Rung("channels-last", {"channels_last": True}, "NHWC convolutions", when="channels_last"),
        Rung("convert", {"convert": True}, "the model's classes fasttrain converts swapped for "
             "its layers (same function; the fused paths become available)", when="convert"),
        Rung("compile", {"compile": scope}, f"torch.compile ({scope})"),
        Rung("cuda-graphs", {"cuda_graphs": True}, "whole-step CUDA graph"),
    ]


def memory_rungs(workload: Workload) -> list[Rung]:
    """seeds/002's memory ladder (ViT-L): each rung cuts the peak at the same effective batch.
    The base builds the model the usual way (CPU, fp32, then moved) so init-on-device shows."""
    k = 4
    return [
        Rung("fp32", {"precision": "fp32", "init": "host", "attention": "auto"},
             "baseline: fp32, weights built on the CPU then moved"),
        Rung("bf16-mixed", {"precision": "bf16-mixed"}, "bf16 autocast"),
        Rung("bf16-true", {"precision": "bf16-true"}, "bf16 weights, gradients, optimizer state"),
        Rung("micro-batches", {"accumulation": k}, f"{k} micro-batches, same effective batch",
             parity="previous"),
        Rung("sgd", {"optimizer": "sgd", "schedule": "cosine"}, "SGD momentum + cosine: one "
             "state tensor", parity="none", parity_note="a different optimizer, by design"),
        Rung("init-device", {"init": "device"}, "weights created on the device in bf16",
             parity="none", parity_note="device RNG draws other initial weights"),
        Rung("checkpointing", {"checkpointing": "full"}, "activation checkpointing",
             parity="previous"),
        Rung("offload", {"offload": "optimizer"}, "optimizer state in pinned CPU memory",
             parity="previous"),
    ]


RUNG_SETS = {"default": default_rungs, "memory": memory_rungs}


def build_ladder(workload: Workload, names: list[str] | None, base: Recipe) -> list[tuple[Rung, Recipe]]:
    """(rung, cumulative recipe) pairs; ``names`` picks a subset in order (cumulative over it)."""
    from .traits import converts, prefers_channels_last

    wants = {"always": True, "ema": workload.has_ema,
             "channels_last": prefers_channels_last(workload), "convert": converts(workload)}
    rungs = [r for r in default_rungs(workload) if wants[r.when]]
    if names == ["none"]:  # only the peer
        return []
    if names == ["memory"]:
        rungs = memory_rungs(workload)
    elif names and names != ["default"]:
        by_name = {r.name: r for r in memory_rungs(workload) + default_rungs(workload)}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise FasttrainError(f"unknown rung {unknown[0]!r}: use {', '.join(by_name)}")
        rungs = [by_name[n] for n in names]
    out, recipe = [], base
    for rung in rungs:
        recipe = recipe.replace(**rung.changes)
        out.append((rung, recipe))
    return out
