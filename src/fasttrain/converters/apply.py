"""Converting a model: every module a converter recognises, checked, swapped, reported.

``convert(model)`` walks the model from the top (a block is converted as a whole before its
children are looked at; the children of a block that cannot be converted are still tried one by
one), asks each matching converter whether the module's configuration is one it computes
exactly, runs its numeric self-check (the converted copy must give the original's output on a
random input) and only then swaps the module in place. A module that fails either stays as it
was, and the report says which and why. Then each ``nn.Sequential`` made only of converted
pre-norm blocks runs as one chain (``layers.blocks.ChainedBlocks``), so fused LayerNorms can add
one block's MLP branch inside the next block's first norm.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import FasttrainError
from ..layers.blocks import ChainedBlocks, chainable
from ..layers.fused import fused_layers, switch_fused
from ..recipe import kernel_families
from .registry import Converter, Finder, list_converters, registry, structural

CHECK_RTOL = {torch.float32: 1e-4, torch.float64: 1e-8}  # of the output's largest magnitude
CHECK_RTOL_16BIT = 2e-2


@dataclass
class ConvertReport:
    """What ``convert`` did: counts by converter, and what it left and why."""

    converted: Counter = field(default_factory=Counter)  # converter name → modules
    skipped: Counter = field(default_factory=Counter)  # (converter name, reason) → modules
    first_skipped: dict = field(default_factory=dict)  # (converter name, reason) → module path
    chained: int = 0  # nn.Sequential stacks of converted blocks now run as one chain
    kernels: Counter = field(default_factory=Counter)  # fused paths switched on (convert(kernels=))
    kernels_kept: str | None = None  # why asked-for Triton paths stayed plain

    def __bool__(self) -> bool:
        return bool(self.converted)

    def summary(self) -> str:
        """One line for a run's ``applied``: ``timm ViT Block ×12; …; 1 block stack chained``."""
        parts = [f"{name} ×{n}" for name, n in self.converted.items()]
        if self.chained:
            parts.append(f"{self.chained} block stack{'s' if self.chained > 1 else ''} chained")
        parts += [f"{what} ×{n}" for what, n in self.kernels.items()]
        if self.kernels_kept:
            parts.append(self.kernels_kept)
        return "; ".join(parts) if parts else "nothing converted"

    def skipped_lines(self) -> list[str]:
        """One line per reason: ``timm ViT Block at blocks.3 (and 11 more): layer scale …``."""
        out = []
        for (name, why), n in self.skipped.items():
            more = f" (and {n - 1} more)" if n > 1 else ""
            out.append(f"{name} at {self.first_skipped[(name, why)] or '(the model)'}{more} "
                       f"left as it was: {why}")
        return out

    def as_dict(self) -> dict:
        return {"converted": dict(self.converted), "chained": self.chained,
                "skipped": self.skipped_lines(), "kernels": dict(self.kernels),
                "kernels_kept": self.kernels_kept}


def convert(model: nn.Module, kernels: str = "none", check: bool = True,
            strict: bool = False) -> ConvertReport:
    """Convert, in place, every module of ``model`` that a converter recognises; returns the
    report. ``kernels``: then switch on the fused paths of these families, as the recipe's
    ``kernels`` switch does (``fused`` for all, or a list such as ``"layernorm,attention"``;
    Triton kernels run on CUDA, elsewhere they stay plain and the report says why); the model
    must already be on its device. ``check``: run each converter's numeric self-check first (a
    few milliseconds a module); a converter that recognises modules by structure alone (a
    pre-norm block of your own) always runs its own. ``strict``: raise ``FasttrainError`` if nothing was converted
    (the message says what was found and why it stayed)."""
    if not isinstance(model, nn.Module):
        raise FasttrainError(f"convert takes a torch.nn.Module, not {type(model).__name__}")
    families = kernel_families(kernels)
    find = Finder(registry(), structural())
    report = ConvertReport()
    for path, module in list(model.named_modules()):
        conv = find(module)
        if conv is None:
            continue
        why = conv.unsupported(module)
        # a converter that recognises modules by structure runs its check even with check=False:
        # the check is what tells the module's function
        if why is None and (check or conv.by_structure) and conv.sample is not None:
            why = self_check(conv, module)
        if why is not None:
            report.skipped[(conv.name, why)] += 1
            report.first_skipped.setdefault((conv.name, why), path)
            continue
        conv.swap(module)
        report.converted[conv.name] += 1
    report.chained = chain_stacks(model)
    if strict and not report:
        raise FasttrainError(nothing_converted(model, report))
    if families:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        report.kernels, kept, why = switch_fused(fused_layers(model), families, device)
        if kept:
            report.kernels_kept = f"{', '.join(sorted(kept))} kept plain: {why}"
    return report


def convertible(model: nn.Module) -> bool:
    """Whether ``convert`` would find something to convert in ``model``: a module a converter
    recognises, is about and computes as configured (``unsupported`` says nothing against it;
    the numeric self-check is not run)."""
    find = Finder(registry(), structural())
    for module in model.modules():
        conv = find(module)
        if conv is not None and conv.unsupported(module) is None:
            return True
    return False


def nothing_converted(model: nn.Module, report: ConvertReport) -> str:
    """One line: why ``model`` has nothing to convert."""
    if report.skipped:
        return f"{type(model).__name__}: nothing converted; {report.skipped_lines()[0]}"
    known = ", ".join(list_converters())
    return (f"{type(model).__name__} has no module fasttrain converts (it converts: {known}); "
            "for a model of your own, use fasttrain's layers (docs/guide.md)")


def chain_stacks(model: nn.Module) -> int:
    """Each plain ``nn.Sequential`` whose items are all chainable blocks becomes a
    ``ChainedBlocks``; returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Sequential and len(m) and all(chainable(b) for b in m):
            m.__class__ = ChainedBlocks
            m.stream_dtype = None
            n += 1
    return n


def self_check(conv: Converter, module: nn.Module) -> str | None:
    """Run the original and a converted copy on the converter's sample (no autograd, the module's
    device and dtype); a reason if the copy cannot be made, fails, or differs.

    A converter that recognises modules by structure alone (``Converter.sources`` empty) has
    nothing else that tells what the module computes, so its check is stricter: it runs on a
    copy whose parameters are moved off their initial values (two norms at their default init
    are the same function, and a zero-initialised projection hides a branch), in training and
    in eval mode, and the module must return what the converted one does (a tensor, not a
    tuple). Without parameters to compute with (meta), such a module is refused."""
    first = next(iter(module.parameters()), None)
    if first is None or first.device.type == "meta":
        if conv.by_structure:
            return ("recognised by its children only, and the numeric self-check that decides "
                    "cannot run without its parameters' values (built on the meta device)")
        return None  # nothing to compute with: the parameters are not materialised yet
    try:
        gen = torch.Generator().manual_seed(0)
        dtype = first.dtype if first.is_floating_point() else torch.float32
        sample = conv.sample(module, gen)
        if sample is None:
            return None  # nothing to check it with: its input is not known
        args, kwargs = _to(sample[0], first.device, dtype), _to(sample[1], first.device, dtype)
        subject = _moved(copy.deepcopy(module), gen) if conv.by_structure else module
        twin = copy.deepcopy(subject)
        conv.swap(twin)
        cuda = [first.device.index or 0] if first.device.type == "cuda" else []
        pairs = []
        for mode in ((True, False) if conv.by_structure else (module.training,)):
            subject.train(mode)
            twin.train(mode)
            with torch.no_grad(), torch.random.fork_rng(devices=cuda):  # the caller's RNG kept
                torch.manual_seed(0)  # the same random draws (stochastic depth) on both sides
                want = subject(*args, **kwargs)
                torch.manual_seed(0)
                pairs.append((want, twin(*args, **kwargs)))
    except Exception as err:  # noqa: BLE001 — a failed check keeps the module, with the reason
        return f"numeric self-check failed ({type(err).__name__}: {str(err).splitlines()[0][:120]})"
    for want, got in pairs:
        if why := _differs(conv, want, got):
            return why
    return None


def _moved(module: nn.Module, gen: torch.Generator) -> nn.Module:
    """``module`` with random offsets added to its floating parameters (in place)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=gen).to(p.device, p.dtype), alpha=0.3)
    return module


def _differs(conv: Converter, want, got) -> str | None:
    """Why the converted module's output ``got`` is not the original's ``want``, or None."""
    if conv.by_structure and type(got) is not type(want):  # the module as it is: same type
        return f"{conv.differs} (it returns {type(want).__name__})"
    want, got = _output(want), _output(got)
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return (f"numeric self-check failed (output {type(got).__name__}, the library's "
                f"{type(want).__name__})")
    if got.shape != want.shape:
        return f"numeric self-check failed (output {tuple(got.shape)} ≠ {tuple(want.shape)})"
    scale = max(float(want.abs().max()), 1.0)
    diff = float((got.float() - want.float()).abs().max())
    tol = CHECK_RTOL.get(want.dtype, CHECK_RTOL_16BIT) * scale
    if not diff <= tol:  # also catches NaN
        return f"{conv.differs} (largest difference {diff:.3g} > {tol:.3g})"
    return None


def _to(value, device: torch.device, dtype: torch.dtype):
    """Floating tensors in ``value`` (nested in tuples and dicts) moved to device and dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if value.is_floating_point() else value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    return value


def _output(value):
    """The tensor a module returned: itself, the first item of a tuple, or a model output's
    first field (``last_hidden_state``, ``loss``)."""
    if isinstance(value, tuple) and value and not hasattr(value, "keys"):
        return value[0]
    if hasattr(value, "to_tuple"):  # transformers' ModelOutput
        return value.to_tuple()[0]
    return value
