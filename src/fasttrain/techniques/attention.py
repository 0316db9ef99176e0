"""Attention backend: which SDPA kernel runs, and a check of which one actually did.

When it helps: FlashAttention never materialises the (T, T) score matrix — the source's SD run
went 0.63 → 0.44 s/iter and 67 → 25 GB at batch 8. Numerics: fused kernels reorder the softmax
reduction (fp32-equivalent within rounding). Requirements: flash needs fp16/bf16 on CUDA and no
arbitrary mask; memory-efficient accepts an additive bias (Swin) and fp32; cuDNN needs Hopper-class
GPUs. A preferred backend that cannot take a call falls back to math — the probe step reports it,
with the reason SDPA gives where it gives one.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity

from ..layers.attention import GEMM_EVENT
from ..measure.quiet_profiler import quiet_profile
from .base import Phase, Technique, TrainState

BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}

# aten op seen in the profiler → backend name
KERNEL_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    GEMM_EVENT: "gemm (heads over 256, no autograd)",  # layers.attention
}


def allowed_backends(choice: str) -> list[SDPBackend] | None:
    """The ordered list given to ``sdpa_kernel``; None leaves SDPA's own choice."""
    if choice == "auto":
        return None
    if choice == "math":
        return [SDPBackend.MATH]
    return [BACKENDS[choice], SDPBackend.MATH]


def apply(state: TrainState) -> str:
    backends = allowed_backends(state.recipe.attention)
    if backends is None:
        return "SDPA chooses the kernel (all backends allowed)"
    state.step_contexts.append(functools.partial(sdpa_kernel, backends, set_priority=True))
    if state.recipe.attention == "math":
        return "math attention only (matmul + softmax + matmul)"
    return f"prefer {state.recipe.attention}, math as last resort"


def kernels_from_profile(prof) -> Counter:
    """Count SDPA kernels by backend in a torch.profiler result."""
    seen: Counter = Counter()
    for evt in prof.events():
        name = KERNEL_OPS.get(evt.name)
        if name and not evt.name.endswith("_backward"):
            seen[name] += 1
    return seen


class FallbackReasons(TorchFunctionMode):
    """Records, per distinct SDPA call signature, why flash/efficient refused it (CUDA only)."""

    def __init__(self, wanted: str):
        super().__init__()
        self.wanted, self.reasons = wanted, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.wanted in ("flash", "efficient"):
            self._probe(*args, **kwargs)
        return func(*args, **kwargs)

    def _probe(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        if not q.is_cuda:
            return
        key = (tuple(q.shape), str(q.dtype), attn_mask is not None, is_causal)
        if key in self.reasons:
            return
        check = (torch.backends.cuda.can_use_flash_attention if self.wanted == "flash"
                 else torch.backends.cuda.can_use_efficient_attention)
        try:
            params = torch.backends.cuda.SDPAParams(q, k, v, attn_mask, dropout_p, is_causal,
                                                    enable_gqa)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ok = check(params, True)
            self.reasons[key] = None if ok else "; ".join(
                str(w.message).strip() for w in caught)[:300] or "refused"
        except (RuntimeError, TypeError) as err:  # private API moved between releases
            self.reasons[key] = f"reason unavailable ({type(err).__name__})"


def verdict(choice: str, seen: Counter, reasons: dict) -> tuple[str, bool]:
    """One line on what ran, and whether it fell back to math against the recipe's wish."""
    if not seen:
        return "no scaled_dot_product_attention call seen", choice not in ("auto", "math")
    ran = ", ".join(f"{name} x{n}" for name, n in seen.most_common())
    fell_back = choice not in ("auto", "math") and "math" in seen
    if fell_back:
        why = sorted({r for r in reasons.values() if r})
        return f"ran {ran}; fell back to math" + (f": {why[0]}" if why else ""), True
    return f"ran {ran}", False


@contextlib.contextmanager
def probe(state: TrainState) -> Iterator[None]:
    """Around the probe step: which SDPA kernels ran (a CPU profile of the ops) and why flash
    or efficient refused a call; on a clean exit, one line in ``applied``, a warning where
    the recipe's backend fell back to math, and *no effect* where a backend was chosen for a
    model that never calls SDPA (a CNN)."""
    reasons = FallbackReasons(state.recipe.attention)
    with quiet_profile(activities=[ProfilerActivity.CPU]) as prof, reasons:
        yield
    seen = kernels_from_profile(prof)
    line, fell_back = verdict(state.recipe.attention, seen, reasons.reasons)
    if not seen and state.recipe.attention != "math":  # math: the plain path, not a switch
        state.idle("attention", f"{line}; attention={state.recipe.attention} changes nothing")
    elif fell_back:
        state.warn("attention", line)
    state.note("attention", line)


TECHNIQUE = Technique(
    name="attention", phase=Phase.ATTENTION,
    summary="SDPA backend selection with a check of what ran", changes_numerics=False,
    apply=apply, active=lambda r: True, probe=probe,
    example={"attention": "auto"})
