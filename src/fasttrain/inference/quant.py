"""Post-training quantization of a model's linear layers for inference: fp8 (e4m3) or INT8.

What: each ``nn.Linear`` becomes an ``Fp8Linear`` or ``Int8Linear``. The weight is quantized once,
at conversion, per output channel; the activation per token (row), dynamically, at every call;
the matmul runs on 8-bit operands with a 32-bit accumulator, and the two scales are applied to
its output (``y = acc · s_x · s_w + b``). Nothing to calibrate: per-token scales follow each
input, so one outlier token costs only its own row's resolution.

When it helps: GEMM-bound inference on tensor cores with 8-bit paths — fp8 on compute
capability 8.9+ (``torch._scaled_mm``, row-wise scales), INT8 on 7.5+ (``torch._int_mm``, int32
out). The source reports INT8 1.2–1.5× over its FP16 Swin (FasterTransformer, fused
epilogues); here the quantization of the activations and the dequantization of the output are
extra memory passes, which torch.compile fuses into the neighbouring kernels: measure with
benchmarks/kernels/quant_linear_micro.py before expecting a gain.

Numerics: INT8 rounds each value to within half its row's step (``amax/127``); e4m3 keeps 3
mantissa bits (relative error ≤ 2⁻⁴, subnormals below 2⁻⁶·448 of the row's max). Accuracy is
the inference ladder's delta against fp32; ``sensitive_layers`` keeps the layers the source
found most sensitive in 16-bit.

Requirements: widths (in and out features) multiples of 16 (``_scaled_mm``'s alignment; INT8
needs 8). Elsewhere (the CPU, a GPU without the kernel) a reference path computes the same
quantization in fp32 (``backend="reference"``), so CPU tests check the math. The backend is
probed once per device when the module is built or moved, never inside the forward, so the
forward has no data-dependent branch and compiles with ``fullgraph=True``.
"""
from __future__ import annotations

import functools
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import BiasApart

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(E4M3).max
INT8_MAX = 127.0  # symmetric: -128 is never used
ALIGN = 16  # both widths: _scaled_mm needs K and N divisible by 16 (_int_mm: 8)
INT_MM_MIN_ROWS, INT_MM_PAD_ROWS = 17, 32  # CUDA _int_mm: M > 16; fewer rows are zero-padded
MODES = ("fp8", "int8")
_TINY = 1e-12  # an all-zero row gets this amax: its codes are zeros, its scale finite


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) → ``(q, scale)``: q (R, C) e4m3, scale (R, 1) fp32, ``x ≈ q.float() · scale``;
    each row's absolute max maps to e4m3's largest finite value, 448."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / FP8_MAX  # (R, 1)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3), scale


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) → ``(q, scale)``: q (R, C) int8 in [-127, 127], scale (R, 1) fp32,
    ``|x - q.float() · scale| ≤ scale / 2``."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / INT8_MAX  # (R, 1)
    return torch.round(xf / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def _try(fn: Callable[[], object]) -> bool:
    try:
        fn()
        return True
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def scaled_mm_works(device: str, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise scales, a bias and ``out_dtype`` runs on
    ``device`` (CUDA 8.9+; some builds output bf16 only; a bias must have the output's dtype)."""
    a = torch.ones(16, 32, device=device).to(E4M3)
    b = torch.ones(32, 32, device=device).to(E4M3)  # symmetric: its .t() is column-major
    return _try(lambda: torch._scaled_mm(
        a, b.t(), scale_a=torch.ones(16, 1, device=device), bias=torch.zeros(
            32, device=device, dtype=out_dtype), scale_b=torch.ones(1, 32, device=device),
        out_dtype=out_dtype))


@functools.lru_cache(maxsize=None)
def int_mm_works(device: str) -> bool:
    """Whether ``torch._int_mm`` (int8 × int8 → int32) runs on ``device``."""
    a = torch.ones(INT_MM_PAD_ROWS, 32, device=device, dtype=torch.int8)
    return _try(lambda: torch._int_mm(a, a.t()))


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) int8 row-major @ b (K, N) int8 column-major → (M, N) int32. CUDA's kernel takes
    only M > 16: fewer rows are padded with zero rows to 32 (on every device, so the CPU tests
    run this path), and the padding's outputs are dropped. A shape-only branch: compile guards
    on it (or specialises), no data-dependent control flow."""
    M = a.shape[0]
    if M < INT_MM_MIN_ROWS:
        return torch._int_mm(F.pad(a, (0, 0, 0, INT_MM_PAD_ROWS - M)), b)[:M]
    return torch._int_mm(a, b)


class _QuantLinear(BiasApart, nn.Module):
    """The state and glue both quantized linear layers share. Buffers, no parameters:
    ``qweight`` (N, K) row-major — so ``qweight.t()`` is the column-major (K, N) operand the
    8-bit GEMMs take —, ``weight_scale`` (1, N) fp32, ``bias`` (N,) in the layer's dtype or None.
    ``backend``: the kernel or ``"reference"``, probed for the buffers' device when built and
    after every ``.to()``/``.cuda()``/``.half()``, which move these buffers but keep their dtypes.
    A ``BiasApart`` layer: inside fasttrain's converted layers, ``unbiased`` runs the 8-bit
    matmul without the bias, which the fused kernel beside it adds (bias + GELU, the blocks'
    fused norms)."""

    mode = ""
    kernel = ""  # the backend name when the device runs the 8-bit GEMM

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)  # (N, K)
        self.register_buffer("weight_scale", weight_scale)  # (1, N) fp32
        self.register_buffer("bias", bias)  # (N,) or None
        self._pick_backend()

    @staticmethod
    def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> _QuantLinear:
        """The quantized copy of ``linear`` (its weight per output channel), on its device."""
        with torch.no_grad():
            q, scale = cls.quantize_rows(linear.weight)  # (N, K), (N, 1)
            bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale.t().contiguous(), bias)

    def _pick_backend(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        # nn.Module.half()/.to(dtype) cast every floating buffer, float8 included: the codes
        # and scales follow the device only (the bias follows both, as a Linear's would)
        fixed = {"qweight": self.qweight, "weight_scale": self.weight_scale}
        super()._apply(fn, recurse)
        for name, t in fixed.items():
            setattr(self, name, t.to(getattr(self, name).device))
        self._pick_backend()
        return self

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (M, K) → (M, N) in x's dtype, plus ``bias`` where given."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (..., K) → (..., N), x's dtype
        return self._rows(x, self.bias)

    def unbiased(self, x: torch.Tensor) -> torch.Tensor:
        return self._rows(x, None)

    def _rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features), bias)  # (M, N)
        return y.view(*x.shape[:-1], self.out_features)

    def _dequantize(self, acc: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype,
                    bias: torch.Tensor | None):
        """acc (M, N) → ``acc · s_x · s_w + bias`` in fp32, cast to ``dtype``."""
        y = acc.float() * sx * self.weight_scale
        if bias is not None:
            y = y + bias.float()
        return y.to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, mode={self.mode}, backend={self.backend}")


class Fp8Linear(_QuantLinear):
    """A linear layer in float8 e4m3: weights per output channel (``amax/448``), activations per
    token, each call; ``torch._scaled_mm`` with row-wise scales on CUDA (8.9+), fp32
    accumulation. Output in the input's dtype: where the build's row-wise kernel cannot write
    that dtype (or fp32, which takes no bias) it writes bf16, cast after — far below e4m3's own
    rounding. ``fast_accum``: Hopper's faster accumulation, as the training fp8 path's forward
(a class default; an instance attribute overrides it)."""

    mode, kernel = "fp8", "scaled_mm"
    quantize_rows = staticmethod(quantize_fp8_rows)
    fast_accum = True  # set per module to False for cuBLAS's exact fp32 accumulation

    def _pick_backend(self) -> None:
        device = str(self.qweight.device)
        on_cuda = self.qweight.is_cuda
        self.native_out = tuple(dt for dt in (torch.bfloat16, torch.float16)
                                if on_cuda and scaled_mm_works(device, dt))
        self.backend = self.kernel if torch.bfloat16 in self.native_out else "reference"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xq, sx = quantize_fp8_rows(x)  # (M, K) e4m3, (M, 1)
        if self.backend == self.kernel:
            out = x.dtype if x.dtype in self.native_out else torch.bfloat16
            bias = None if bias is None else bias.to(out)
            y = torch._scaled_mm(xq, self.qweight.t(), scale_a=sx, scale_b=self.weight_scale,
                                 bias=bias, out_dtype=out, use_fast_accum=self.fast_accum)
            return y.to(x.dtype)
        # the kernel's arithmetic: exact products of e4m3 codes, fp32 sums, scales after
        return self._dequantize(xq.float() @ self.qweight.float().t(), sx, x.dtype, bias)


class Int8Linear(_QuantLinear):
    """A linear layer in INT8: symmetric weights per output channel (``amax/127``), activations
    per token, each call; ``torch._int_mm`` (int32 accumulator) then ``acc · s_x · s_w + b`` in
    fp32, cast to the input's dtype. Where ``_int_mm`` is missing the integer product runs in
    fp32 (exact while K·127² < 2²⁴, i.e. K ≤ 1,040; beyond, within fp32 rounding)."""

    mode, kernel = "int8", "int_mm"
    quantize_rows = staticmethod(quantize_int8_rows)

    def _pick_backend(self) -> None:
        self.backend = (self.kernel if int_mm_works(str(self.qweight.device))
                        else "reference")

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xq, sx = quantize_int8_rows(x)  # (M, K) int8, (M, 1)
        if self.backend == self.kernel:
            acc = int_mm(xq, self.qweight.t())  # (M, N) int32
        else:
            acc = xq.float() @ self.qweight.float().t()
        return self._dequantize(acc, sx, x.dtype, bias)


QUANTIZED = {"fp8": Fp8Linear, "int8": Int8Linear}


@dataclass
class QuantReport:
    """What ``quantize_linears`` did, by module name (``model.named_modules()``'s)."""

    mode: str
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # name → why it stays 16-bit (keep())
    skipped: dict[str, str] = field(default_factory=dict)  # name → why it cannot be quantized
    backends: Counter = field(default_factory=Counter)  # backend → quantized modules

    def __bool__(self) -> bool:
        return bool(self.quantized)

    def line(self) -> str:
        """``int8: 36 linear layers quantized; 12 kept in 16-bit; 1 skipped (…)``."""
        if not (self.quantized or self.kept or self.skipped):
            return f"{self.mode}: matched nothing (no nn.Linear in the model); nothing quantized"
        parts = [f"{self.mode}: {len(self.quantized)} linear layers quantized"]
        for what, names in (("kept in 16-bit", self.kept), ("skipped", self.skipped)):
            if names:
                why = "; ".join(f"{r} ×{n}" for r, n in Counter(names.values()).most_common())
                parts.append(f"{len(names)} {what} ({why})")
        if self.backends.get("reference"):
            parts.append(f"{self.backends['reference']} on the reference path (no 8-bit kernel "
                         "on this device: an fp32 emulation, for checks, not speed)")
        return "; ".join(parts)

    def summary(self) -> dict:
        """For a result row's ``applied``: counts, reasons with counts, and the line."""
        return {"mode": self.mode, "quantized": len(self.quantized), "kept": len(self.kept),
                "skipped": len(self.skipped), "kept_why": dict(Counter(self.kept.values())),
                "skipped_why": dict(Counter(self.skipped.values())),
                "backends": dict(self.backends), "line": self.line()}


def _linear_slots(model: nn.Module):
    """(name, parent, attribute, linear) for every ``nn.Linear`` child, along every path."""
    for prefix, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent._modules.items():  # named_children() drops repeats
            if isinstance(child, nn.Linear):
                yield (f"{prefix}.{attr}" if prefix else attr), parent, attr, child


def _cannot(parent: nn.Module, attr: str, m: nn.Linear) -> str | None:
    """Why ``m`` (``parent.<attr>``) cannot become a quantized module, or None. fasttrain's
    layers call their linear layers, or ``layers.linear.linear`` (a quantized layer is a
    ``BiasApart``), except where a module names the children whose weights it reads itself
    (``reads_linear_weights``: the language models' tied head)."""
    if type(m).forward is not nn.Linear.forward:
        return f"{type(m).__name__} has its own forward"
    if isinstance(parent, nn.MultiheadAttention) or attr in getattr(
            parent, "reads_linear_weights", ()):
        return f"its parent {type(parent).__name__} reads its weight directly"
    if type(m.weight) not in (torch.Tensor, nn.Parameter):
        return f"its weight is a {type(m.weight).__name__}, not a plain tensor"
    if m.in_features % ALIGN or m.out_features % ALIGN:
        return f"{m.in_features}→{m.out_features}: widths must be multiples of {ALIGN}"
    return None


def quantize_linears(model: nn.Module, mode: Literal["fp8", "int8"],
                     keep: Callable[[str, nn.Linear], bool | str] | None = None
                     ) -> QuantReport:
    """Replace, in place, each ``nn.Linear`` of ``model`` (subclasses too, where their forward
    is nn.Linear's) by an ``Fp8Linear`` or ``Int8Linear`` on the same device, except those for
    which ``keep(name, module)`` is truthy (kept in 16-bit; a string is recorded as the reason)
    and those that cannot be (skipped, with the reason). A model with no linear layer is a
    warning, not an error. Call after the model is on its device and in its inference dtype."""
    if mode not in QUANTIZED:
        raise ValueError(f"unknown quantization mode {mode!r}: use one of {', '.join(MODES)}")
    report, done = QuantReport(mode), {}  # id(linear) → its replacement, for shared layers
    if isinstance(model, nn.Linear):
        report.skipped["(the model)"] = "the model itself is an nn.Linear: pass its parent"
    for name, parent, attr, m in list(_linear_slots(model)):
        if id(m) in done:  # the same layer under a second name: same decision
            if done[id(m)] is not None:
                setattr(parent, attr, done[id(m)])
                report.quantized.append(name)
            continue
        done[id(m)] = None
        why = keep(name, m) if keep is not None else False
        if why:
            report.kept[name] = why if isinstance(why, str) else "keep() chose 16-bit"
        elif (why := _cannot(parent, attr, m)) is not None:
            report.skipped[name] = why
        else:
            done[id(m)] = QUANTIZED[mode].from_linear(m)
            setattr(parent, attr, done[id(m)])
            report.quantized.append(name)
            report.backends[done[id(m)].backend] += 1
    if not report.quantized:
        warnings.warn(f"quantize_linears: {report.line()}", stacklevel=2)
    return report


_KEEP_RULES = (
    # (the rule, the reason recorded): timm's names for ViT and Swin
    (lambda parts: parts[-2:] == ["mlp", "fc2"],
     "MLP fc2: its input (after GELU) is long-tailed; the source keeps it 16-bit"),
    (lambda parts: "reduction" in parts[-1],
     "patch merging: the source keeps it 16-bit"),
    (lambda parts: parts[0] == "head",
     "classifier head: the logits' precision, a tiny share of the FLOPs"),
)


def sensitive_layers(model: nn.Module) -> Callable[[str, nn.Linear], bool | str]:
    """``keep`` for ``quantize_linears``: the layers the source keeps in 16-bit in its INT8
    post-training quantization of Swin (FasterTransformer), in timm's names — each MLP's
    second linear (``….mlp.fc2``), the patch-merging reduction (``….downsample.reduction``) —
    and, as usual, the classifier head (``head``, ``head.fc``); qkv, proj and fc1 quantized.

    Why: PTQ of Swin-Large lost many points with every matmul in INT8; the source disables
    INT8 for FC2 and PatchMerge (and keeps int32 output in front of them), which "markedly"
    restores its PTQ accuracy (the task's reading of the source's table: −0.35 top-1 with this
    choice; the transcript we hold gives no number), while QAT stays within 0.5%. FC2's input is
    GELU's output, one-sided and heavy-tailed, which a symmetric per-token scale resolves worst;
    the reduction mixes 4 tokens' channels (4C → 2C) once per stage. The returned callable
    gives the reason as a string (``QuantReport.kept``)."""
    chosen = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name:
            chosen.update({name: why for rule, why in _KEEP_RULES if rule(name.split("."))})

    def keep(name: str, module: nn.Linear) -> bool | str:
        return chosen.get(name, False)

    return keep
