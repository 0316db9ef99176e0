"""What every technique shares: its card, the mutable state it acts on, what it reports."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from ..recipe import Recipe
from ..workloads.base import Workload


@dataclass(frozen=True)
class Technique:
    """A method card (composer style) plus the function that does the work."""

    name: str
    phase: int  # position in techniques.ORDER; lower runs first
    summary: str
    changes_numerics: bool
    apply: Callable[["TrainState"], str | None]
    requires: tuple[str, ...] = ()  # "cuda"
    active: Callable[[Recipe], bool] = lambda r: True  # does this recipe ask for it at all
    # why this recipe's use of it cannot run on a device type (beyond ``requires``), or None
    unmet: Callable[[Recipe, str], str | None] = lambda r, device_type: None


@dataclass
class TrainState:
    """Everything the techniques configure, in the order they run, before the loop starts."""

    recipe: Recipe
    workload: Workload
    device: torch.device
    model: nn.Module
    trainable: nn.Module
    micro_batch: int
    total_steps: int = 0  # warm-up + timed steps (for schedules)
    world: int = 1  # data-parallel processes; each rank's loss is scaled by it (see sharding)
    zero1: bool = False  # the optimizer is wrapped in ZeroRedundancyOptimizer
    no_sync: Callable[[], ContextManager] | None = None  # skip gradient reduction (accumulation)
    compile_baseline: dict[str, int] = field(default_factory=dict)  # dynamo counters before
    step_contexts: list[Callable[[], ContextManager]] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None  # torch.optim.lr_scheduler, stepped after every optimizer step
    scaler: Any = None  # torch.amp.GradScaler for fp16-mixed
    ema: Any = None  # techniques.ema.Ema
    loader_kwargs: dict[str, Any] = field(default_factory=dict)
    collate: Callable[[list], Any] | None = None  # replaces the workload's collate (padding)
    non_blocking: bool = False
    device_prefetch: bool = False  # copy the next batch on a side stream during this step
    autocast_cache: bool = True  # CUDA graph capture needs the autocast cache off
    applied: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    restore: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def warn(self, technique: str, message: str) -> None:
        """A switch that matched nothing or fell back: recorded, never silent."""
        self.warnings.append(f"{technique}: {message}")

    def set_flag(self, obj: Any, attr: str, value: Any) -> None:
        """Set a global backend flag and restore it when the run ends."""
        old = getattr(obj, attr)
        setattr(obj, attr, value)
        self.restore.callback(setattr, obj, attr, old)

    def step_context(self) -> contextlib.ExitStack:
        """Enter every per-step context (autocast, SDPA backend) for one forward+loss."""
        stack = contextlib.ExitStack()
        for make in self.step_contexts:
            stack.enter_context(make())
        return stack
