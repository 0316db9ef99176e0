"""Rule-based advice: each finding cites the number it rests on and the switch that addresses it.

Rules read a profile (phases, kernels, memory, attention, compile) and return findings ranked by
expected gain — a rough share of the step time the switch can save, from the measured share of
what it removes. ``suggest_recipe`` applies every finding's switch to the profiled recipe, so
``fasttrain ladder --recipe suggested.toml`` measures the advice instead of trusting it.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..errors import FasttrainError
from ..techniques.dataloader import default_workers
from ..recipe import Recipe


@dataclass
class Finding:
    rule: str
    evidence: str  # the measured number, in words
    switch: dict[str, Any]  # recipe changes that address it ({} = no recipe switch)
    gain: float  # expected share of the step saved (0..1), for ranking
    env: dict[str, str] = field(default_factory=dict)  # environment settings, where that is the fix

    def to_dict(self) -> dict:
        return asdict(self)


def _share(p: dict, phase: str) -> float:
    step = p.get("step_time_s") or 0.0
    return (p.get("phases_s", {}).get(phase, 0.0) / step) if step else 0.0


def data_wait(p: dict, r: Recipe) -> Finding | None:
    share = _share(p, "data")
    if share < 0.05:
        return None
    sw = {"workers": max(r.workers, default_workers())}
    if p["device"] == "cuda":  # pinned memory and the copies' switches act on CUDA copies only
        sw.update(pin_memory=True, non_blocking=True, device_prefetch=True)
    if all(getattr(r, k) == v for k, v in sw.items()):
        sw = {}  # the recipe has all of it already: the finding stands, with no switch to offer
    return Finding("data_wait", f"data wait {share:.0%} of the step "
                   f"({p['phases_s']['data'] * 1e3:.1f} ms, {r.workers} loader workers)", sw, share)


def optimizer_unfused(p: dict, r: Recipe) -> Finding | None:
    """A for-loop or foreach AdamW taking a visible share: PyTorch's fused one. Not for fused or
    the one-launch AdamW (triton), which is faster still (kernels-micro-optimizer rows)."""
    share = _share(p, "optimizer")
    if r.optimizer_impl in ("fused", "triton") or share < 0.03:
        return None
    kernels = p.get("kernels", {}).get("gpu_ms_per_step", {}).get("optimizer")
    extra = f", {kernels:.1f} ms of optimizer kernels" if kernels else ""
    return Finding("optimizer_unfused", f"optimizer {share:.0%} of the step with the "
                   f"{r.optimizer_impl} AdamW{extra}", {"optimizer_impl": "fused"}, share * 0.7)


MOMENT_SHARE = 8 / 28
"""What bf16 moments save of the one-launch AdamW's traffic: 8 of the 28 bytes a weight (an
fp32 weight, or a bf16 one with its fp32 master, without EMA); on an H100 Llama-1B's whole
step lost 3.4 ms, the 8/28 of its 11.8 ms optimizer step
(train-hf_llama-moments-ab-20261127-h100)."""


def optimizer_moments(p: dict, r: Recipe) -> Finding | None:
    """The one-launch AdamW, fp32 moments, its kernels a visible share of the GPU's time: the
    moments in bf16 (``optimizer_state=bf16``; it changes the numerics: the ladder's parity
    gate decides)."""
    if r.optimizer != "adamw" or r.optimizer_impl != "triton" or r.optimizer_state != "fp32":
        return None
    kernels = p.get("kernels", {})
    share = kernels.get("share", {}).get("optimizer", 0.0)
    if share < 0.03:
        return None
    ms = kernels.get("gpu_ms_per_step", {}).get("optimizer")
    took = f" ({ms:.1f} ms)" if ms else ""
    return Finding("optimizer_moments", f"the one-launch AdamW {share:.1%} of GPU time{took}, "
                   "16 of its 28 bytes a weight the fp32 moments (bf16 moments round "
                   "stochastically: the parity check decides)", {"optimizer_state": "bf16"},
                   share * MOMENT_SHARE)


def attention_math(p: dict, r: Recipe) -> Finding | None:
    line = p.get("attention", "")
    m = re.search(r"math x(\d+)", line)
    if not m or p["device"] != "cuda":
        return None
    share = p.get("kernels", {}).get("share", {}).get("attention", 0.0)
    why = line.split("fell back to math:", 1)[1].strip() if "fell back" in line else (
        f"attention={r.attention}")
    return Finding("attention_math", f"attention ran the math kernel {m.group(1)} times ({why})",
                   {"attention": "auto"}, max(share, 0.1) * 0.5)


def precision_fp32(p: dict, r: Recipe) -> Finding | None:
    if r.precision not in ("fp32", "tf32") or p["device"] != "cuda":
        return None
    gemm = p.get("kernels", {}).get("share", {}).get("gemm", 0.0)
    mfu = p.get("mfu")
    ev = f"{r.precision} matmuls; GEMM {gemm:.0%} of GPU time" + (f", MFU {mfu:.0%}" if mfu else "")
    return Finding("precision", ev, {"precision": "bf16-mixed"}, max(gemm, 0.2) * 0.5)


def ema_per_tensor(p: dict, r: Recipe) -> Finding | None:
    share = _share(p, "ema")
    if "per-tensor" not in p.get("applied", {}).get("ema", "") or share < 0.02:
        return None
    return Finding("ema_per_tensor", f"EMA {share:.0%} of the step, one kernel per tensor",
                   {"ema": "foreach"}, share * 0.7)


def not_compiled(p: dict, r: Recipe) -> Finding | None:
    if r.compile != "none":
        return None
    share = p.get("kernels", {}).get("share", {})
    small = share.get("elementwise", 0.0) + share.get("norm/reduction", 0.0)
    if p["device"] == "cuda" and small < 0.15:
        return None
    ev = (f"elementwise + norm kernels {small:.0%} of GPU time" if p["device"] == "cuda"
          else "eager CPU execution")
    return Finding("not_compiled", ev + " (fusion candidates)",
                   {"compile": p.get("compile_scope", "model")}, max(small, 0.1) * 0.5)


def dtype_casts(p: dict, r: Recipe) -> Finding | None:
    """bf16 autocast over fp32 weights: the cast kernels (weights to bf16, their gradients back)
    that bf16 weights with fp32 masters in the one-launch AdamW remove. Measured: 0.65 ms (2.9%
    of GPU time) of compiled casts a Swin-B step, +2.1%; 3.2 ms (3.4%) an SD step, +3.9%
    (train-master-weights-20261121-1849, -sd-20261121-1907): roughly 0.8 of the share."""
    casts = p.get("kernels", {}).get("casts", {})
    share = casts.get("share", 0.0)
    switch = {"master_weights": True, "optimizer_impl": "triton"}
    if r.master_weights or p["device"] != "cuda" or share < 0.02:
        return None
    try:  # the recipe's own checks say where it can run (bf16-mixed, one process, ...)
        r.replace(**switch)
    except FasttrainError:
        return None
    return Finding("dtype_casts", f"{casts.get('per_step', 0):,.0f} dtype-cast kernels a step, "
                   f"{casts.get('ms_per_step', 0):.2f} ms ({share:.1%} of GPU time): autocast "
                   "casting fp32 weights and their gradients", switch, share * 0.8)


def launch_bound(p: dict, r: Recipe) -> Finding | None:
    k = p.get("kernels", {})
    idle, launches = k.get("idle_fraction", 0.0), k.get("launches_per_step", 0)
    if p["device"] != "cuda" or idle < 0.10 or launches < 300 or r.cuda_graphs:
        return None
    ok = r.precision != "fp16-mixed" and r.accumulation == 1
    return Finding("launch_bound", f"GPU idle {idle:.0%} of the window with {launches:,.0f} "
                   "kernel launches per step", {"cuda_graphs": True} if ok else {}, idle * 0.8)


# What each memset of a captured step costs, and graph_memset_kernels saves: SD's 261 went with
# +0.5% of 79.5 ms (train-graph-memsets-sd-20261125-0045), about 1.5 µs each.
MEMSET_S = 1.5e-6


def graph_memsets(p: dict, r: Recipe) -> Finding | None:
    """Memsets inside a captured step: each delays the kernel after it (cuBLAS's and cuDNN's
    workspace flags); graph_memset_kernels makes them kernel nodes."""
    n = p.get("kernels", {}).get("memsets_per_step", 0.0)
    step = p.get("step_time_s") or 0.0
    if p["device"] != "cuda" or not r.cuda_graphs or r.graph_memset_kernels or n < 50 or not step:
        return None
    return Finding("graph_memsets", f"{n:,.0f} memsets a step inside the captured graph (the "
                   "libraries' workspace flags), each delaying the kernel after it",
                   {"graph_memset_kernels": True}, n * MEMSET_S / step)


def allocator_churn(p: dict, r: Recipe) -> Finding | None:
    m = p.get("memory", {})
    mallocs, pattern = m.get("cuda_malloc_per_step", 0.0), m.get("reserved_pattern")
    if m.get("expandable_segments") or (mallocs < 1 and pattern != "saw-tooth"):
        return None
    return Finding("allocator_churn", f"{mallocs:.0f} cudaMalloc per step, reserved memory "
                   f"{pattern} ({m.get('reserved_span_mib', 0):.0f} MiB span)", {}, 0.02,
                   env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def memory_growth(p: dict, r: Recipe) -> Finding | None:
    g = p.get("memory", {}).get("growth_mib_per_step", 0.0)
    if g < 1.0:
        return None
    return Finding("memory_growth", f"allocated memory grows {g:.1f} MiB per step (tensors kept "
                   "alive across steps: losses or graphs held in Python?)", {}, 0.0)


def graph_breaks(p: dict, r: Recipe) -> Finding | None:
    """Graph breaks under compile: no switch fixes them (the model's code does), but where they
    are matters: a break in a repeated block costs every block, and the gradients crossing it
    are made contiguous (copies in the backward). The most frequent reason, cited."""
    c = p.get("compile") or {}
    n = c.get("graph_breaks", 0)
    if r.compile == "none" or not n:
        return None
    reasons = c.get("break_reasons") or {}
    top = max(reasons.items(), key=lambda kv: kv[1], default=None)
    why = f"; the most frequent ({top[1]}x): {top[0].splitlines()[0][:160]}" if top else ""
    return Finding("graph_breaks", f"{n} graph breaks, {c.get('unique_graphs', 0)} graphs "
                   f"under compile={r.compile}{why}", {}, 0.0)


RULES: list[Callable[[dict, Recipe], Finding | None]] = [
    data_wait, optimizer_unfused, optimizer_moments, attention_math, precision_fp32,
    ema_per_tensor, not_compiled, dtype_casts, launch_bound, graph_memsets, allocator_churn,
    memory_growth, graph_breaks]


def advise(profile: dict, recipe: Recipe) -> list[Finding]:
    """Findings of every rule, largest expected gain first."""
    found = [f for rule in RULES if (f := rule(profile, recipe)) is not None]
    return sorted(found, key=lambda f: -f.gain)


def suggest_recipe(recipe: Recipe, findings: list[Finding]) -> Recipe:
    """The profiled recipe with every finding's switch applied (and still valid)."""
    changes: dict[str, Any] = {}
    for f in findings:
        changes.update(f.switch)
    if changes.get("cuda_graphs") and (changes.get("precision", recipe.precision) == "fp16-mixed"):
        changes.pop("cuda_graphs")
    try:
        return recipe.replace(**changes)
    except FasttrainError:  # a combination the rules did not foresee: drop the graphs switch
        changes.pop("cuda_graphs", None)
        return recipe.replace(**changes)
