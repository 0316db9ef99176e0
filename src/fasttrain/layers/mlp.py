"""Feed-forward blocks: GELU MLP (ViT, Swin), SwiGLU (Llama) and GEGLU (SD), and an
``nn.Sequential`` whose Linear → GELU pairs take the GELU MLP's fused path (a plain-PyTorch MLP).

Fused paths (``kernels=gelu`` / ``kernels=swiglu``, Triton, ``kernels/activations.py``): fc1's
bias add and the GELU in one kernel each way (fc1 runs without its bias), and SiLU(gate)·up in
one kernel each way. Parameters and their names are unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import FusedPath
from .linear import bias_apart, linear


class Mlp(FusedPath, nn.Module):
    """Linear → GELU → Linear. ``approximate='tanh'`` gives the tanh-GELU variant."""

    fused_kind, fused_triton = "gelu", True

    gelu_epilogue = False
    """Set by ``use_gelu_epilogue``: without gradients, fc1's bias and GELU in its GEMM."""

    def __init__(self, dim: int, hidden: int, bias: bool = True, approximate: str = "none"):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.approximate, self.fused = approximate, False

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return ["bias + GELU in one Triton kernel"]

    def fp32_params(self) -> list[nn.Parameter]:
        """What the fused path reads outside autocast's casts: fc1's bias, added in fp32 inside
        the kernel (bf16 master weights leave it fp32, techniques/optimizer.py)."""
        fused = self.fused and bias_apart(self.fc1) and self.fc1.bias is not None
        return [self.fc1.bias] if fused else []

    def forward(self, x: torch.Tensor, fc2_bias: bool = True) -> torch.Tensor:
        """``fc2_bias=False`` leaves fc2's bias out, for the caller to add (``LayerNorm.add``);
        only an fc2 that runs apart from its bias is asked to (``bias_apart``: plain, or one of
        fasttrain's swaps, quantized ones included). A wrapped fc1 runs whole."""
        if self.gelu_epilogue and epilogue_applies(self.fc1, x):
            from ..kernels.gemm_epilogue import linear_gelu

            h = linear_gelu(x, self.fc1.weight, self.fc1.bias)
        elif self.fused and bias_apart(self.fc1):
            from ..kernels.activations import bias_gelu

            h = bias_gelu(linear(self.fc1, x, bias=False), self.fc1.bias, self.approximate)
        else:
            h = F.gelu(self.fc1(x), approximate=self.approximate)
        return linear(self.fc2, h, bias=fc2_bias)

    def epilogue_fits(self) -> bool:
        """Whether fc1 can run with its bias and GELU in the GEMM's epilogue."""
        return epilogue_fits(self.fc1)


def epilogue_fits(fc: nn.Module) -> bool:
    """Whether ``fc`` can run with its bias and a GELU in its GEMM's epilogue: a plain
    ``nn.Linear`` (not quantized or wrapped) with a bias."""
    return type(fc) is nn.Linear and fc.bias is not None


def epilogue_applies(fc: nn.Module, x: torch.Tensor) -> bool:
    """Whether this call of ``fc`` on ``x`` takes the epilogue: it fits, no gradients are
    recorded, no autocast, and ``x``, the weight and the bias are of one dtype."""
    return (epilogue_fits(fc) and not torch.is_grad_enabled()
            and x.dtype == fc.weight.dtype == fc.bias.dtype
            and not torch.is_autocast_enabled(x.device.type))


def use_gelu_epilogue(model: nn.Module) -> list[str]:
    """Forward only (inference): every :class:`Mlp` of ``model`` whose fc1 fits, and every
    :class:`GeluSequential` with a Linear → GELU pair that fits, computes that linear layer's
    bias and the GELU in its GEMM (``kernels/gemm_epilogue.py``; the tanh GELU). What it did,
    one line per kind of outcome. A call with gradients (training), under autocast, or whose
    input, weight and bias are not of one dtype keeps the module's own path."""
    mlps = [m for m in model.modules() if isinstance(m, Mlp)]
    seqs = [m for m in model.modules() if isinstance(m, GeluSequential)]
    fit = [m for m in mlps if m.epilogue_fits()]
    pairs = [m.pair_fits() for m in seqs]
    for m in fit + [m for m, p in zip(seqs, pairs) if any(p)]:
        m.gelu_epilogue = True
    fits, kept = len(fit) + sum(map(sum, pairs)), len(mlps) - len(fit)
    kept_pairs = sum(len(p) - sum(p) for p in pairs)
    lines = [f"fc1 bias + GELU (tanh) in the GEMM epilogue ×{fits}"] if fits else []
    if kept or kept_pairs:
        lines.append(f"{kept + kept_pairs} kept their path (fc1 quantized, wrapped or without a "
                     "bias)")
    return lines or ["no fasttrain MLP to fuse (convert the model first)"]


def gelu_pairs(modules: list[nn.Module]) -> list[int]:
    """Indices i where ``modules[i]`` is a linear layer ``linear`` can run without its bias (a
    plain ``nn.Linear``, or a ``BiasApart`` one: the fp8 or gemm_pad switches', the inference
    path's 8-bit layers) and ``modules[i + 1]`` an ``nn.GELU``: the pairs the bias + GELU
    kernel computes, none overlapping."""
    out: list[int] = []
    for i in range(len(modules) - 1):
        if (bias_apart(modules[i]) and type(modules[i + 1]) is nn.GELU
                and (not out or out[-1] != i - 1)):
            out.append(i)
    return out


class GeluSequential(FusedPath, nn.Sequential):
    """``nn.Sequential`` (the same children, indices and state dict) whose Linear → GELU pairs
    run, on the fused path, as ``Mlp``'s fc1 does: the matmul without its bias, then bias + GELU
    in one Triton kernel each way; every other child runs as in ``nn.Sequential``. The plain
    path is ``nn.Sequential``'s own forward."""

    fused_kind, fused_triton = "gelu", True

    gelu_epilogue = False
    """Set by ``use_gelu_epilogue``: without gradients, each pair's bias and GELU in its GEMM."""

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return ["bias + GELU in one Triton kernel"]  # Mlp's words: the report counts them together

    def pair_fits(self) -> list[bool]:
        """For each Linear → GELU pair, whether its linear can run with its bias and the GELU
        in the GEMM's epilogue."""
        mods = list(self)
        return [epilogue_fits(mods[i]) for i in gelu_pairs(mods)]

    def fp32_params(self) -> list[nn.Parameter]:
        """The pairs' linear biases, added in fp32 inside the kernel (as ``Mlp.fp32_params``)."""
        if not self.fused:
            return []
        mods = list(self)
        return [mods[i].bias for i in gelu_pairs(mods) if mods[i].bias is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        epilogue = self.gelu_epilogue and not torch.is_grad_enabled()
        if not (self.fused or epilogue):
            return super().forward(x)
        mods = list(self)
        pairs = gelu_pairs(mods)
        i = 0
        while i < len(mods):
            if i in pairs and epilogue and epilogue_applies(mods[i], x):  # bias + GELU in the GEMM
                from ..kernels.gemm_epilogue import linear_gelu

                x = linear_gelu(x, mods[i].weight, mods[i].bias)
                i += 2
            elif i in pairs and self.fused:  # the matmul, then bias and GELU in one kernel
                from ..kernels.activations import bias_gelu

                x = bias_gelu(linear(mods[i], x, bias=False), mods[i].bias, mods[i + 1].approximate)
                i += 2
            else:
                x = mods[i](x)
                i += 1
        return x


class SwiGLU(FusedPath, nn.Module):
    """down(silu(gate(x)) * up(x)), no biases (Llama)."""

    fused_kind, fused_triton = "swiglu", True

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.fused = False

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return ["SiLU(gate) · up in one Triton kernel"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from ..kernels.activations import swiglu

            return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GEGLU(FusedPath, nn.Module):
    """``h · gelu(gate)`` of the two halves of one projection. Fused (``kernels=gelu``): the
    projection runs without its bias and one Triton kernel each way reads its output in place,
    adds the bias and, backward, sums the bias gradient (``kernels/geglu.py``); Inductor's
    backward computed GELU's derivative for both halves of its gradient (0.30 ms a call at
    64 × 64 latents: profile-sd-base-20261122-035033) and the bias gradient in a pass of its own
    (0.07 ms: profile-sd-base-20261122-081837)."""

    fused_kind, fused_triton = "gelu", True

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)
        self.fused = False

    def use_fused(self, on: bool) -> list[str]:
        self.fused = on
        return ["GEGLU (bias, h · gelu(gate)) in one Triton kernel each way"]

    def fp32_params(self) -> list[nn.Parameter]:
        """What the fused path reads outside autocast's casts: the projection's bias, added in
        fp32 in the kernel (bf16 master weights leave it fp32, techniques/optimizer.py)."""
        return [self.proj.bias] if self.fused and bias_apart(self.proj) else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and bias_apart(self.proj):  # else (a LoRA-wrapped proj) the plain path
            from ..kernels.geglu import geglu

            return geglu(linear(self.proj, x, bias=False), self.proj.bias)
        h, gate = self.proj(x).chunk(2, dim=-1)
        return h * F.gelu(gate)
