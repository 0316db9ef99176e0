"""The peer's training step and timed loop: plain PyTorch, as a user would write it.

One step = forward under autocast → backward → clip_grad_norm_(1.0) → AdamW step →
zero_grad(set_to_none=True) (+ EMA of the trained module where the recipe has one).
Timing follows DESIGN.md "Measurement protocol": warm-up (and compile) excluded and reported as
``warmup_s``; CUDA events around every timed step; peak memory from a reset at the window start.
"""
from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

import torch
from torch import nn

from ..errors import missing_dependency
from ..measure.steadiness import spread

LR, WEIGHT_DECAY = 1e-4, 1e-2  # HF text-to-image defaults; speed does not depend on them
GIB = 2**30


class PeerUnavailable(RuntimeError):
    """A package the peer needs is missing or broken; the message is the row's one-line error."""


def require(module: str, package: str | None = None):
    """Import ``module``; a missing package becomes a one-line ``PeerUnavailable``."""
    package = package or module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if dep := missing_dependency(module, err):  # installed, what it imports is not
            raise PeerUnavailable(f"peer needs {package}, which needs {dep} (not installed: "
                                  f"pip install {dep})") from None
        if err.name:
            raise PeerUnavailable(f"peer needs {package} (not installed)") from None
        raise PeerUnavailable(f"peer needs {package} (import failed: {err})") from None
    except ImportError as err:
        raise PeerUnavailable(f"peer needs {package} (import failed: {err})") from None


def package_version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class PeerRecipe:
    """One row of the TARGETS.md table: what "PyTorch best practice" switches on."""

    name: str
    tf32: bool
    autocast: bool  # bf16 autocast around the forward
    fused_adam: bool  # AdamW(fused=True); else the default (foreach on CUDA)
    foreach_ema: bool  # torch._foreach_lerp_ EMA; else a per-parameter loop
    compile: bool  # torch.compile each module of the step


RECIPES = {
    "fp32": PeerRecipe("fp32", tf32=False, autocast=False, fused_adam=False, foreach_ema=False,
                       compile=False),
    "tf32": PeerRecipe("tf32", tf32=True, autocast=False, fused_adam=False, foreach_ema=False,
                       compile=False),
    "bf16": PeerRecipe("bf16", tf32=True, autocast=True, fused_adam=True, foreach_ema=True, compile=False),
    "bf16+compile": PeerRecipe("bf16+compile", tf32=True, autocast=True, fused_adam=True, foreach_ema=True,
                               compile=True),
}


@dataclass
class PeerSpec:
    """A built peer: the public modules, a synthetic batch closed over by ``loss``, and units."""

    public: str  # e.g. "timm:vit_base_patch16_224"
    trainable: nn.Module
    modules: dict[str, nn.Module]  # every module the step calls; each is compiled under compile
    loss: Callable[[dict[str, nn.Module]], torch.Tensor]  # one forward → scalar loss
    batch: int
    units: int  # images or tokens per step
    unit: str  # "img/s" or "tok/s"
    info: dict = field(default_factory=dict)  # public config, for the row's recipe
    ema_decay: float | None = None
    prepare: Callable[[], dict] | None = None  # after FLOP counting, before compile (e.g. Liger)


@contextlib.contextmanager
def precision_flags(recipe: PeerRecipe):
    """Set TF32 on/off for the run and restore the process's flags afterwards."""
    old = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if recipe.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = recipe.tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old[0])
        torch.backends.cudnn.allow_tf32 = old[1]


def autocast(recipe: PeerRecipe, device: torch.device):
    if not recipe.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def count_flops(spec: PeerSpec, recipe: PeerRecipe, device: torch.device) -> int:
    """FLOPs of one forward+backward of the eager model (one extra, untimed step; grads zeroed)."""
    try:
        from ..measure.flops import flop_counter, gqa_flop_formulas

        with gqa_flop_formulas(), flop_counter() as counter:
            with autocast(recipe, device):
                loss = spec.loss(spec.modules)
            loss.backward()
    finally:
        spec.trainable.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def make_step(spec: PeerSpec, mods: dict, recipe: PeerRecipe, device: torch.device) -> Callable:
    """The training step a user writes; returns the loss as a device tensor (no sync)."""
    params = [p for p in spec.trainable.parameters() if p.requires_grad]
    opt_kwargs = {"fused": True} if recipe.fused_adam else {}
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **opt_kwargs)
    ema_update = _make_ema(params, spec.ema_decay, recipe.foreach_ema)

    def step() -> torch.Tensor:
        with autocast(recipe, device):
            loss = spec.loss(mods)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ema_update is not None:
            ema_update()
        return loss.detach()

    return step


def _make_ema(params: list, decay: float | None, foreach: bool) -> Callable | None:
    """EMA of the trained parameters in fp32 (diffusers EMAModel, fixed decay)."""
    if decay is None:
        return None
    live = [p.detach() for p in params]
    shadow = [p.clone() for p in live]
    weight = 1.0 - decay

    def update() -> None:
        if foreach:
            torch._foreach_lerp_(shadow, live, weight)
        else:
            for s, p in zip(shadow, live):
                s.lerp_(p, weight)

    return update


def timed_loop(step: Callable, steps: int, warmup: int, device: torch.device) -> dict:
    """Run warm-up then ``steps`` timed steps; losses are read back only at the end."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
        for start, end in events:
            start.record()
            losses.append(step())
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for _ in range(steps):
            t = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t)
    out = {
        "warmup_s": warmup_s,
        "step_time_s": median(times),
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "step_times_s": times,
        "spread": spread(times),
        "losses": torch.stack(losses).float().cpu().tolist(),
        "peak_allocated_gib": None,
        "peak_reserved_gib": None,
    }
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    return out


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the device (the table in fasttrain.measure.env); None on CPU or unknown GPUs."""
    from ..measure.env import device_peak

    return device_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def measure(spec: PeerSpec, recipe: PeerRecipe, device: torch.device, steps: int, warmup: int,
            compile_: bool) -> dict:
    """Count FLOPs (eager), compile, run the timed loop; return the row's measured fields."""
    try:
        flops, flops_error = count_flops(spec, recipe, device), None
    except Exception as err:  # noqa: BLE001 — the timing is still worth a row
        flops, flops_error = None, f"{type(err).__name__}: {str(err).strip()[:200]}"
    applied = spec.prepare() if spec.prepare is not None else {}
    mods = {k: torch.compile(m) if compile_ else m for k, m in spec.modules.items()}
    step = make_step(spec, mods, recipe, device)
    out = timed_loop(step, steps, warmup, device)
    t = out["step_time_s"]
    peak = peak_flops(device)
    out.update(
        throughput=spec.units / t,
        throughput_unit=spec.unit,
        model_flops=flops,
        tflops=flops / t / 1e12 if flops else None,
        mfu=flops / t / peak if flops and peak else None,
        flops_error=flops_error,
        compiled=sorted(mods) if compile_ else [],
        prepared=applied,
    )
    return out
