"""The timed training loop: build, apply the recipe's techniques, warm up, measure.

One call of :func:`train` is one measured run: the model is built on the target device under the
recipe's seed, the techniques are applied in phase order, an eager *probe step* counts the model
FLOPs (FlopCounterMode) and records which attention kernel ran, then ``warmup`` steps (compile,
capture, allocator warm-up) and ``steps`` timed steps follow. Phases are timed with CUDA events
(no per-op synchronisation); losses stay on the device until the end.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch

from ..measure.env import device_peak
from ..errors import FasttrainError
from ..measure.flops import flop_counter, gqa_flop_formulas
from ..measure.parity import unrecovered
from ..recipe import Recipe
from ..distributed import env as dist_env
from ..distributed.watchdog import StepWatchdog
from ..techniques import (TrainState, apply_after_probe, apply_before_probe, build_model,
                          finish_all, prepare_process, probe_contexts, unmet_requirements)
from ..workloads.base import UNITS, Batch, Workload
from . import checkpoint, scaler_skips
from .saving import Saver
from .data import DevicePrefetcher, HostBatches, SlotPrefetcher, make_loader, to_device
from .graphs import GraphedStep
from ..measure.timer import PhaseTimer
from ..measure.steadiness import spread

GIB = 1024 ** 3


@dataclass
class RunResult:
    """What one run measured: the row of DESIGN.md minus workload/rung/env/parity."""

    batch: int
    steps: int
    step_time_s: float
    step_time_min_s: float
    step_time_max_s: float
    throughput: float
    throughput_unit: str
    peak_allocated_gib: float | None
    peak_reserved_gib: float | None
    model_flops: float | None
    tflops: float | None
    mfu: float | None
    warmup_s: float
    losses: list[float]
    phases_s: dict[str, float]
    data_wait_host_s: float
    applied: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    compile: dict[str, int] | None = None
    step_times_s: list[float] = field(default_factory=list)
    phase_steps_s: dict[str, list[float]] = field(default_factory=dict)
    observed: dict[str, Any] = field(default_factory=dict)
    spread: dict[str, Any] | None = None  # steadiness.spread of step_times_s
    no_effect: dict[str, str] = field(default_factory=dict)  # switches that matched nothing
    lrs: list[float] | None = None  # the learning rate of every step, warm-up included
    # fp16-mixed: the optimizer steps the GradScaler skipped (inf/NaN gradients), warm-up and
    # timed steps together; None without a GradScaler
    skipped_steps: int | None = None
    scaler_skips: list[int] = field(default_factory=list)  # their steps, numbered as losses

    def to_row(self) -> dict[str, Any]:
        return asdict(self)

    def first_nonfinite(self) -> int | None:
        """The first step (1-based, warm-up included) whose loss is NaN or inf, else None."""
        return next((i + 1 for i, x in enumerate(self.losses) if not math.isfinite(x)), None)

    def failed_step(self) -> int | None:
        """The first non-finite loss the run did not recover from (1-based), else None: under
        fp16-mixed a step the GradScaler skipped is excused when the last loss is finite
        (:func:`fasttrain.measure.parity.unrecovered`)."""
        return unrecovered(self.losses, self.scaler_skips)


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise FasttrainError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FasttrainError("device cuda asked for, but CUDA is not available")
    return dev


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def _probe_step(state: TrainState, batch: Batch, count, count_flops: bool) -> float | None:
    flops = flop_counter() if count_flops else contextlib.nullcontext()
    try:
        with gqa_flop_formulas(), flops, probe_contexts(state):
            with state.step_context():
                loss = state.workload.loss(state.model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                what = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else \
                    type(loss).__name__
                raise FasttrainError(f"workload {state.workload.name!r}: its loss returned {what}; "
                                     "it must return a 0-dim tensor, the loss summed over the "
                                     "batch's items (e.g. .sum())")
            (loss / count).backward()
    finally:
        for p in state.model.parameters():
            p.grad = None
    return float(flops.get_total_flops()) if count_flops else None


def _probe(state: TrainState, batch: Batch, count) -> float | None:
    """One eager forward+backward: model FLOPs, and what the techniques' probe hooks record
    (the attention kernels that ran)."""
    try:
        return _probe_step(state, batch, count, count_flops=True)
    except (AssertionError, NotImplementedError) as err:  # a FLOP formula this torch lacks
        state.warn("flops", f"FLOP counting failed ({str(err)[:80]}); TFLOP/s from the ladder's "
                   "baseline where there is one")
        return _probe_step(state, batch, count, count_flops=False)


class ItemCounter:
    """The global item count of a step (the loss divisor) as a 0-dim fp32 device tensor.

    A workload counts each micro-batch (``Workload.count``): a Python int (rows of a batch) is
    made a device tensor once per value and reused, a tensor (tokens that are not ignored) stays
    on the device, so counting never waits for the GPU. Under several processes the count is
    summed over the ranks every step (an all-reduce of one number, no host sync)."""

    def __init__(self, workload: Workload, device: torch.device):
        self.wl, self.dev = workload, device
        self._ints: dict[int, torch.Tensor] = {}

    def __call__(self, micro: list[Batch]) -> torch.Tensor:
        parts = [self.wl.count(mb) for mb in micro]
        rows = all(not isinstance(c, torch.Tensor) for c in parts)  # counted on the host
        if rows:
            n = int(sum(parts))
            total = self._ints.get(n)
            if total is None:
                total = self._ints[n] = torch.tensor(float(n), device=self.dev)
        else:
            total = sum(torch.as_tensor(c, device=self.dev).float() for c in parts)
        if dist_env.current().world > 1:
            total = dist_env.sum_tensor(total.clone())
        elif rows:
            return total  # a batch's rows, cached: never 0
        # a step whose labels are all ignored has nothing to average: its summed loss (0) is
        # divided by 1, not by 0
        return total.clamp_min(1.0)


class _Stepper:
    """One optimizer step over k micro-batches, with phase marks."""

    def __init__(self, state: TrainState, timer: PhaseTimer):
        self.s, self.timer = state, timer
        self.count: torch.Tensor | None = None  # this step's global item count (ItemCounter)
        # fp16-mixed: one 0-dim device flag a step, 1.0 where the GradScaler skipped it; read
        # once after the run (no host sync inside the loop)
        self.skips: list[torch.Tensor] | None = []
        self.params = [p for p in state.trainable.parameters() if p.requires_grad]
        # an optimizer that clips inside its step (optimizer_impl=triton) takes it from here
        self.clip = bool(state.recipe.grad_clip) and not getattr(state.optimizer,
                                                                  "clips_gradients", False)
        self.graphed = GraphedStep(
            self._core, state.optimizer,
            memset_kernels=state.recipe.graph_memset_kernels,
            report=self._report) if state.recipe.cuda_graphs else None

    def _report(self, note: str) -> None:
        """What the capture's memset rewrite did, after the technique's line."""
        line = self.s.applied.get("graph_memset_kernels", "")
        self.s.applied["graph_memset_kernels"] = f"{line}: {note}" if line else note

    def _core(self, batch: Batch, count: torch.Tensor) -> torch.Tensor:
        """Graph body: the whole step on one micro-batch (no host syncs)."""
        s = self.s
        with s.step_context():
            loss = s.workload.loss(s.model, batch) / count
        (loss * s.world if s.world > 1 else loss).backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, s.recipe.grad_clip)
        s.optimizer.step()
        return loss.detach()

    def __call__(self, micro: list[Batch]) -> torch.Tensor:
        s, t = self.s, self.timer
        if self.graphed is not None:
            if s.ema is not None:
                s.ema.before_optimizer()
            t.mark("graph")
            loss = self.graphed(micro[0], self.count)
            if s.scheduler is not None:  # the rate on the device, written for the next replay
                s.scheduler.step()
        else:
            loss = self._eager(micro)
        if s.ema is not None:
            t.mark("ema")
            s.ema.update()
        return loss

    def _eager(self, micro: list[Batch]) -> torch.Tensor:
        s, t = self.s, self.timer
        total = None
        for i, mb in enumerate(micro):
            # Gradients are reduced across ranks once per step, on the last micro-batch.
            quiet = s.no_sync is not None and i < len(micro) - 1
            with s.no_sync() if quiet else contextlib.nullcontext():
                t.mark("forward")
                with s.step_context():
                    loss = s.workload.loss(s.model, mb) / self.count
                t.mark("backward")
                # DDP and FSDP average gradients over ranks; each rank's loss is its share of the
                # global sum / global count, so scaling by the world size restores the gradient.
                scaled = loss * s.world if s.world > 1 else loss
                (s.scaler.scale(scaled) if s.scaler else scaled).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.clip:
            t.mark("clip")
            if s.scaler:
                s.scaler.unscale_(s.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, s.recipe.grad_clip)
        t.mark("optimizer")
        if s.ema is not None:
            s.ema.before_optimizer()
        if s.scaler:
            s.scaler.step(s.optimizer)
            self._note_skip()
            s.scaler.update()
        else:
            s.optimizer.step()
        if s.scheduler is not None:
            s.scheduler.step()
        s.optimizer.zero_grad(set_to_none=True)
        return total

    def _note_skip(self) -> None:
        """Between ``scaler.step`` and ``scaler.update``: whether this step was skipped."""
        flag = scaler_skips.step_flag(self.s.scaler, self.s.optimizer, self.s.device)
        if flag is None or self.skips is None:
            self.skips = None  # this torch's GradScaler keeps no flags: the count is unknown
        else:
            self.skips.append(flag)


def prepare(workload: Workload, recipe: Recipe, device: torch.device, total_steps: int = 0):
    """Build the model and apply every technique; returns (state, dataset, probe line, flops)."""
    unmet = unmet_requirements(recipe, device.type)
    if unmet:
        raise FasttrainError("; ".join(unmet))
    late = prepare_process(recipe)
    _seed(recipe.seed)
    model = build_model(workload, recipe, device)
    model.train()
    # Before any collective (DDP's constructor syncs shapes): a rank that never got here is
    # named, instead of a generic collective timeout.
    dist_env.barrier("model built", recipe.dist_timeout)
    batch = workload.batch_of(recipe.batch)
    world = dist_env.current().world
    if batch % (recipe.accumulation * world):
        raise FasttrainError(f"batch {batch} is not divisible by accumulation "
                             f"{recipe.accumulation} x {world} processes")
    state = TrainState(recipe=recipe, workload=workload, device=device, model=model,
                       trainable=workload.trainable(model),
                       micro_batch=batch // (recipe.accumulation * world), total_steps=total_steps)
    if late:
        state.warn("allocator", late)
    apply_before_probe(state)  # layout, precision, stream, attention backend
    dataset = load_dataset(workload)
    probe_batch = to_device(workload.collate(first_items(workload, dataset, state.micro_batch)),
                            device, False)
    flops = _probe(state, probe_batch, workload.count(probe_batch))
    del probe_batch
    if device.type == "cuda":  # the probe ran before checkpointing and compile: hand its
        torch.cuda.empty_cache()  # cached blocks back, or they stay in the run's reserved peak
    apply_after_probe(state)  # fused paths, compile, sharding, optimizer, EMA, loader, graphs
    return state, dataset, (flops * recipe.accumulation * world if flops else None)


def load_dataset(workload: Workload):
    """The workload's data set; a missing or empty data path is the user's mistake, named on one
    line."""
    try:
        dataset = workload.dataset()
    except (OSError, ValueError) as err:
        raise FasttrainError(f"workload {workload.name!r}: {err}") from None
    if len(dataset) < 1:
        raise FasttrainError(f"workload {workload.name!r}: its data set is empty")
    return dataset


def first_items(workload: Workload, dataset, count: int) -> list:
    """The data set's first ``count`` items (wrapping around), checked against the contract:
    dicts of tensors."""
    items = [dataset[i % len(dataset)] for i in range(count)]
    if not isinstance(items[0], Mapping):
        raise FasttrainError(f"workload {workload.name!r}: data set items must be dicts of "
                             f"tensors (e.g. {{'x': x, 'y': y}}), got {type(items[0]).__name__}")
    return items


class Observer:
    """Watches a run (the profiler's hooks): attached after the techniques, called around every
    step (warm-up included, ``step`` counts from 0), reported into ``RunResult.observed``."""

    name = "observer"
    labels = False  # ask the phase timer for record_function labels

    def attach(self, state: TrainState) -> None: ...

    def begin(self, step: int) -> None: ...

    def end(self, step: int) -> None: ...

    def report(self) -> dict[str, Any]:
        return {}


def train(workload: Workload, recipe: Recipe, steps: int = 20, warmup: int = 5,
          device: str | torch.device | None = None,
          observers: tuple[Observer, ...] = (), save_to: str | None = None,
          resume_from: str | None = None, save_every: int = 0, keep: int = 2) -> RunResult:
    """Run ``warmup`` + ``steps`` optimizer steps of ``workload`` under ``recipe``; measure.

    Under torchrun every rank calls this with the same recipe; ``batch`` is the global batch.
    ``resume_from`` continues a DCP checkpoint (any world size; a ``save_to`` folder continues
    its newest complete save); ``save_to`` writes one after, and every ``save_every`` steps,
    keeping the newest ``keep``; SIGINT/SIGTERM then save after the step under way and raise
    :class:`~fasttrain.run.saving.Stopped`.
    """
    if steps < 1 or warmup < 0:
        raise FasttrainError(f"steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    if save_every < 0 or keep < 1 or (save_every and not save_to):
        raise FasttrainError("save_every needs save_to and must be >= 0, keep must be >= 1; got "
                             f"save_every={save_every}, keep={keep}")
    dev = resolve_device(device)
    if save_to:
        checkpoint.check_folder(save_to)  # before the run, not after it
    d = dist_env.init(dev.type, recipe.dist_timeout)
    if d.active and dev.type == "cuda":
        dev = torch.device("cuda", d.local_rank)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(dev)  # events, streams and graphs follow the current device
    dist_env.agree("recipe", recipe.to_dict())
    if recipe.cuda_graphs:
        warmup = max(warmup, 4)  # 3 eager steps, then capture + first replay
    state, dataset, flops = prepare(workload, recipe, dev, total_steps=warmup + steps)
    try:
        if save_to or resume_from:
            checkpoint.check(state)  # before the run, not after it
        start = checkpoint.load(state, resume_from) if resume_from else 0
        for obs in observers:
            obs.attach(state)
        dist_env.barrier("start of training", recipe.dist_timeout)
        saver = Saver(save_to, save_every, keep) if save_to else None
        with saver.signals() if saver else contextlib.nullcontext():
            res = _measure(state, dataset, flops, steps, warmup, observers, start, saver)
            res.observed = {obs.name: obs.report() for obs in observers}
            if saver:
                saver.finish(state, start + warmup + steps)
        dist_env.barrier("end of training", recipe.dist_timeout)
        return res
    finally:
        state.restore.close()


def _measure(state: TrainState, dataset, flops, steps: int, warmup: int,
             observers: tuple[Observer, ...] = (), start_step: int = 0,
             saver: Saver | None = None) -> RunResult:
    dev, wl, r = state.device, state.workload, state.recipe
    d = dist_env.current()
    loader = make_loader(wl, state.micro_batch, r.seed, dataset=dataset, rank=d.rank,
                         world=d.world, global_batch=state.micro_batch * r.accumulation * d.world,
                         start_step=start_step, collate=state.collate, **state.loader_kwargs)
    if state.device_prefetch:  # slots under CUDA graphs, whose step copies its inputs at once
        it = (SlotPrefetcher if r.cuda_graphs else DevicePrefetcher)(iter(loader), dev,
                                                                   r.accumulation)
    else:
        it = HostBatches(iter(loader), dev, r.accumulation, state.non_blocking)
    timer = PhaseTimer(dev, labels=any(o.labels for o in observers))
    stepper, counter, losses, counts = _Stepper(state, timer), ItemCounter(wl, dev), [], []
    host_wait = 0.0
    t0 = time.perf_counter()
    # A captured graph keeps its activations in a private pool that counts as free between
    # replays, so with CUDA graphs the peak is taken over warm-up and capture too.
    reset_at = 0 if r.cuda_graphs else warmup
    # a rank whose host is blocked inside a step behind a collective another rank never
    # joined (fp16's overflow read) is named by a thread, before NCCL's timeout
    dog = StepWatchdog(r.dist_timeout) if d.active else None
    with dog or contextlib.nullcontext():
        for i in range(warmup + steps):
            step = start_step + i + 1
            with dist_env.watched(f"step {step}", r.dist_timeout) if d.active else \
                    contextlib.nullcontext():
                # first, before anything that waits for the GPU (a synchronize, a pageable copy),
                # which a collective of a hung rank would block: the ranks meet, or are named
                dist_env.step_barrier(step, r.dist_timeout, dev.type)
                if dog is not None:
                    dog.at_step(step)
                if i == reset_at and dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(dev)
                if i == warmup:
                    warmup_s, host_wait = time.perf_counter() - t0, 0.0
                timer.step()
                for obs in observers:
                    obs.begin(i)
                timer.mark("data")
                h0 = time.perf_counter()
                micro = next(it)
                host_wait += time.perf_counter() - h0
                stepper.count = counter(micro)  # items in the global batch
                counts.append(stepper.count)
                losses.append(stepper(micro))
                for obs in observers:
                    obs.end(i)
                if saver is not None:  # a step boundary: the data position is step
                    saver.after_step(state, step, timer.pause)
    timer.finish()
    if warmup == 0:
        warmup_s = 0.0
    if state.ema is not None:
        state.ema.synchronize()
    finish_all(state)  # the techniques' finish hooks (compile's counters and cache)
    totals, phases = timer.results(skip=warmup)
    # Items per second: the mean items of a timed step over the median step time, the same
    # statistic as ms/step (with constant counts exactly items per step / ms per step).
    rate = float(torch.stack(counts[warmup:]).mean()) / statistics.median(totals)
    res = _summarise(state, totals, phases, losses, flops, warmup_s, host_wait / steps, rate)
    if state.scaler is not None:
        res.skipped_steps, res.scaler_skips, note = scaler_skips.read(stepper.skips,
                                                                      len(losses))
        res.warnings += [note] if note else []
    return res


def _summarise(state, totals, phases, losses, flops, warmup_s, host_wait, rate) -> RunResult:
    dev, wl = state.device, state.workload
    med = statistics.median(totals)
    peak = device_peak(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
    tflops = flops / med / 1e12 if flops else None
    cuda = dev.type == "cuda"
    return RunResult(
        batch=state.micro_batch * state.recipe.accumulation * dist_env.current().world,
        steps=len(totals),
        step_time_s=med, step_time_min_s=min(totals), step_time_max_s=max(totals),
        throughput=rate, throughput_unit=f"{UNITS.get(wl.unit, wl.unit)}/s",
        peak_allocated_gib=dist_env.max_float(
            torch.cuda.max_memory_allocated(dev) / GIB if cuda else None),
        peak_reserved_gib=dist_env.max_float(
            torch.cuda.max_memory_reserved(dev) / GIB if cuda else None),
        model_flops=flops, tflops=tflops,
        mfu=(tflops * 1e12 / peak) if (tflops and peak) else None,
        warmup_s=warmup_s,
        losses=[float(x) for x in dist_env.sum_tensor(torch.stack(losses).float()).cpu()],
        phases_s={k: statistics.median(v) for k, v in phases.items()},
        data_wait_host_s=host_wait, applied=dict(state.applied), warnings=list(state.warnings),
        no_effect=dict(state.no_effect),
        compile=state.compile_stats,
        step_times_s=list(totals), phase_steps_s=phases, spread=spread(totals),
        lrs=_lrs(state, len(losses)))


def _lrs(state, steps: int) -> list[float] | None:
    """The learning rate each of the last ``steps`` steps used, from the schedule's closed
    form (read once, after the run: no synchronisation inside the loop)."""
    opt, sched = state.optimizer, state.scheduler
    if opt is None or not getattr(opt, "param_groups", None):
        return None
    if sched is None:
        return [float(opt.param_groups[0]["lr"])] * steps
    base, lam, end = sched.base_lrs[0], sched.lr_lambdas[0], sched.last_epoch
    return [float(base * lam(p)) for p in range(end - steps, end)]
