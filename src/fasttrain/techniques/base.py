"""What every technique shares: its card, the mutable state it acts on, what it reports."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from ..recipe import Recipe
from ..workloads.base import Workload


class Phase(IntEnum):
    """Where a technique runs in the fixed order (``techniques/__init__.py`` says why each comes
    where it does); lower runs first."""

    INIT = 0
    ALLOCATOR = 1
    CONVERT = 5
    CHANNELS_LAST = 10
    PRECISION = 20
    STREAM = 21
    ATTENTION = 30
    KERNELS = 32
    FP8 = 33
    GEMM_PAD = 34
    CHECKPOINTING = 35
    COMPILE = 40
    SHARDING = 50
    OPTIMIZER = 60
    EMA = 70
    DATALOADER = 80
    PADDING = 82
    CUDA_GRAPHS = 90
    GRAPH_MEMSETS = 91
    ACCUMULATION = 95


@dataclass(frozen=True)
class Technique:
    """A method card (composer style) plus the function that does the work."""

    name: str
    """The recipe switch it serves (a ``Recipe`` field), and its key in a row's ``applied``."""
    phase: Phase
    summary: str
    """One line: what it does."""
    changes_numerics: bool
    """False: the loss is unchanged up to fp32 summation order (tight parity); True: it may
    move within the precision's tolerance (bf16 rounding, float8, another kernel's order)."""
    apply: Callable[["TrainState"], str | None]
    """Does the work on the state; returns what it did in words (None: nothing to report)."""
    requires: tuple[str, ...] = ()
    """What it cannot run without: ``"cuda"``."""
    active: Callable[[Recipe], bool] = lambda r: True
    """Whether this recipe asks for it at all."""
    unmet: Callable[[Recipe, str], str | None] = lambda r, device_type: None
    """Why this recipe's use of it cannot run on a device type (beyond ``requires``), or None."""
    probe: Callable[["TrainState"], ContextManager] | None = None
    """A context around the eager probe step (one forward + backward of the model as built,
    before fused paths and compile) that records what it saw when it exits."""
    finish: Callable[["TrainState"], None] | None = None
    """Runs after the timed steps (compile: its counters, its cache saved)."""
    example: dict[str, Any] = field(default_factory=dict)
    """Recipe switches that turn it on, as a user would write them (``--set key=value``): the
    registry-driven tests run every technique this way on every tiny workload."""


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
    compile_stats: dict | None = None  # this run's graphs, breaks (and why), recompiles
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
    no_effect: dict[str, str] = field(default_factory=dict)  # technique → why it changed nothing
    restore: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def note(self, technique: str, line: str) -> None:
        """Add ``line`` to what ``technique`` reports in the row's ``applied``."""
        before = self.applied.get(technique)
        self.applied[technique] = f"{before}; {line}" if before else line

    def warn(self, technique: str, message: str) -> None:
        """A switch that matched nothing or fell back: recorded, never silent."""
        self.warnings.append(f"{technique}: {message}")

    def idle(self, technique: str, reason: str) -> None:
        """``technique`` was asked for but matched nothing in this model: recorded (with the
        reason) as a warning and in the row's ``no_effect``, so the ladder shows its rung as
        *no effect* instead of crediting it with noise."""
        self.no_effect[technique] = reason
        self.warn(technique, reason)

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
