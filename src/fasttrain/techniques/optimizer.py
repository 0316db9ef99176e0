"""Optimizer: AdamW (for-loop, foreach or fused) or lean SGD, a schedule, fp32 master weights
for bf16-true and bf16-mixed, and CPU offload of the optimizer state.

When it helps: a fused AdamW on GPUs with many parameter tensors — the source measured Adam at
125.6 ms in 6,860 elementwise kernels, and 25.0 ms in 47 multi-tensor kernels once fused. SGD with
momentum keeps one state tensor instead of AdamW's two (the source's lean recipe, with a cosine
schedule). Master weights keep bf16-true training from losing small updates to bf16 rounding.
Offload moves optimizer state and master weights to pinned CPU memory and runs the update there.
``triton`` (fasttrain.optim.adamw) goes further for AdamW: gradient clipping, the update and
the EMA in one launch over every tensor, 40 bytes of memory traffic per weight instead of 52.
With bf16-mixed, ``master_weights`` stores the weights that autocast would cast to bf16 on every
step (those of linear and convolution layers) in bf16, and the one-launch AdamW keeps their fp32
masters: the forward's casts of the weights and the backward's casts of their gradients to fp32
(two passes over every such weight, hundreds of small kernels a step) disappear; the matmuls see
the same bf16 weights, the optimizer the same gradient values.
``optimizer_state=bf16`` keeps the one-launch AdamW's two moments in bf16, rounded
stochastically: 8 of the 28 bytes of traffic a weight in the step (Llama-1B's step on an H100
step lost 3.4 ms, the 8/28 of its ~12 ms of optimizer), 4 bytes less memory.
Numerics: fused/foreach/for-loop/triton differ only in rounding order; SGD and schedules change
the training (they are recipe choices, not speed-ups); bf16 moments add unbiased rounding noise
to the moments, ~4% (std) on the second one, ~2% on the update (the parity gate checks the
loss).
"""
from __future__ import annotations

import math
import os

import torch

from ..errors import FasttrainError
from ..layers.fused import StreamCarrier
from ..recipe import PYTORCH_ADAMW, Recipe
from .base import Phase, Technique, TrainState


def build(params, recipe, lr: float, capturable: bool = False) -> torch.optim.Optimizer:
    """PyTorch's optimizer for the recipe. Capturable AdamW under a schedule gets its learning
    rate as a device tensor, which the scheduler writes in place between graph replays."""
    impl = recipe.optimizer_impl
    kw = {"foreach": impl == "foreach", "fused": (impl == "fused") or None}
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=recipe.weight_decay, **kw)
    if capturable and recipe.scheduled:
        lr = torch.tensor(float(lr), dtype=torch.float32, device=params[0].device)
    return torch.optim.AdamW(params, lr=lr, weight_decay=recipe.weight_decay,
                             capturable=capturable, **kw)


class ShadowOptimizer:
    """The optimizer steps fp32 copies of the weights (on the GPU for master weights, in pinned
    CPU memory for offload); gradients go in, updated weights come back out."""

    def __init__(self, params: list[torch.Tensor], recipe, lr: float, where: torch.device):
        self.params = params
        pin = where.type == "cpu" and params[0].is_cuda
        self.shadow = [p.detach().to(where, torch.float32, copy=True) for p in params]
        if pin:
            self.shadow = [s.pin_memory() for s in self.shadow]
        for s in self.shadow:
            s.requires_grad_(True)
            s.grad = torch.zeros_like(s, pin_memory=pin) if pin else torch.zeros_like(s)
        self.inner = build(self.shadow, recipe, lr)
        self.param_groups, self.state, self.defaults = (self.inner.param_groups, self.inner.state,
                                                        self.inner.defaults)

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        torch._foreach_copy_([s.grad for s in self.shadow], grads, non_blocking=True)
        if self.shadow[0].device.type == "cpu" and self.params[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # gradients landed in host memory
        self.inner.step()
        torch._foreach_copy_(self.params, self.shadow, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _flat_unfit(state: TrainState, params: list[torch.Tensor]) -> str | None:
    """Why fasttrain's one-launch AdamW cannot step these weights, or None."""
    try:
        from ..optim.adamw import runs_on
    except ImportError:
        return "triton is not installed"
    odd = [type(p).__name__ for p in params if type(p) not in (torch.nn.Parameter, torch.Tensor)]
    if odd:
        return f"the weights are {odd[0]}s (sharded), not plain tensors"
    if not runs_on(params[0]):
        return "its Triton kernel runs on CUDA (or on the CPU under TRITON_INTERPRET=1)"
    dtypes = {p.dtype for p in params}
    if dtypes != {torch.float32}:  # (bf16-mixed's master weights become bf16 after this check)
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        return f"it steps fp32 weights, these are {names} (precision={state.recipe.precision})"
    if len({p.device for p in params}) > 1:
        return "the weights are on more than one device"
    from ..optim.adamw import dense

    if not all(dense(p) for p in params):
        return "a weight is a strided view (not dense)"
    return None


MATMUL_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _casts_like_autocast(m: torch.nn.Module) -> bool:
    """A linear or convolution layer whose forward hands its weights to autocast's matmul or
    convolution. Not fp8's Float8Linear: it quantizes the fp32 weight itself and returns an fp32
    weight gradient."""
    from ..layers.linear import Float8Linear

    return isinstance(m, MATMUL_LAYERS) and not isinstance(m, Float8Linear)


def stream_embeddings(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The embeddings in ``module`` whose output its model casts straight into a 16-bit
    residual stream (``stream_embeddings()`` of a model carrying one in bf16): rows read from
    a bf16 copy of their weight are the rows the cast would give."""
    return [e for m in module.modules()
            if isinstance(m, StreamCarrier) and m.stream_dtype == torch.bfloat16
            and callable(getattr(m, "stream_embeddings", None)) for e in m.stream_embeddings()]


def matmul_weights(module: torch.nn.Module,
                   embeddings: list[torch.nn.Module] | None = None) -> list[torch.nn.Parameter]:
    """The trainable weights and biases that autocast casts to 16 bits on every forward: those
    of linear and convolution layers, and an embedding's (tied to the output layer, say) where
    its rows go straight into a bf16 residual stream (``stream_embeddings``). Left out: a
    parameter that another kind of module also uses (an embedding tied to the output layer
    whose rows stay fp32), and those a module lists in its ``fp32_params()``: the ones its
    fused path reads itself, outside autocast (fc1's bias in the bias + GELU kernel).
    ``embeddings``: ``stream_embeddings(module)``, where the caller has them already."""
    to_stream = {id(e) for e in (stream_embeddings(module) if embeddings is None
                                 else embeddings)}
    owners: dict[int, list[torch.nn.Module]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    kept: set[int] = set()
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
            params[id(p)] = p
        if callable(getattr(m, "fp32_params", None)):
            kept.update(id(p) for p in m.fp32_params())
    return [p for i, p in params.items() if p.requires_grad and p.dtype == torch.float32
            and i not in kept
            and all(_casts_like_autocast(m) or id(m) in to_stream for m in owners[i])]


def _store_in_bf16(weights: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each weight becomes bf16 in place (the same Parameter, so modules, hooks and compile
    see it); returns the fp32 originals, the optimizer's masters (the old storage itself: the
    bf16 data is new, so nothing is copied twice)."""
    originals = []
    with torch.no_grad():
        for p in weights:
            originals.append(p.data)
            p.data = p.data.to(torch.bfloat16)
    return originals


def _mixed_masters(state: TrainState, params: list[torch.Tensor], lr: float, what: str) -> str:
    """bf16-mixed with master_weights: the matmul weights in bf16, fp32 masters in FlatAdamW."""
    if state.world > 1:
        raise FasttrainError("recipe: master_weights with bf16-mixed runs on one process (DDP "
                             "would all-reduce bf16 gradients); turn it off for "
                             f"{state.world} ranks")
    why = _flat_unfit(state, params)
    if why is not None:
        raise FasttrainError(f"recipe: master_weights with bf16-mixed keeps its fp32 masters "
                             f"in the one-launch AdamW (optimizer_impl=triton), which cannot "
                             f"run here: {why}")
    feeds_stream = stream_embeddings(state.trainable)
    weights = matmul_weights(state.trainable, feeds_stream)
    if not weights:
        state.warn("optimizer", "master_weights: no trainable linear or convolution weights "
                   "to store in bf16")
        state.no_effect["master_weights"] = "no trainable linear or convolution weights"
    embedded = {id(p) for e in feeds_stream for p in e.parameters(recurse=False)}
    originals = {id(p): fp32 for p, fp32 in zip(weights, _store_in_bf16(weights))}
    n16 = sum(p.numel() for p in weights)
    n_emb = sum(id(p) in embedded for p in weights)
    rows = (f", {n_emb} of them embedding weights whose rows go straight into the bf16 stream"
            if n_emb else "")
    return _flat_adamw(state, params, lr, what, [originals.get(id(p)) for p in params]) + (
        f"; {len(weights)} linear/conv weights ({n16 / 1e6:.1f} M{rows}) stored in bf16 with "
        "fp32 masters in the optimizer")


def _flat_adamw(state: TrainState, params: list[torch.Tensor], lr: float, what: str,
                masters: list[torch.Tensor | None] | None = None) -> str:
    """fasttrain's one-launch AdamW over ``params`` (bf16 ones with their fp32 ``masters``)."""
    from ..optim.adamw import FlatAdamW

    r = state.recipe
    bf16_state = r.optimizer_state == "bf16"
    state.optimizer = FlatAdamW(params, lr=lr, weight_decay=r.weight_decay,
                                max_grad_norm=r.grad_clip, masters=masters,
                                state_dtype=torch.bfloat16 if bf16_state else torch.float32)
    _schedule(state)
    clip = ", gradient clipping inside" if r.grad_clip else ""
    moments = "; both moments in bf16, rounded stochastically" if bf16_state else ""
    n = sum(p.numel() for p in params)
    return (f"{what} over {len(params)} tensors ({n / 1e6:.1f} M params): one Triton launch a "
            f"step{clip}{moments}")


def _zero1(params, recipe, lr: float):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    impl = recipe.optimizer_impl
    kw = {"foreach": impl == "foreach", "fused": (impl == "fused") or None}
    if recipe.optimizer == "sgd":
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=lr,
                                       momentum=0.9, weight_decay=recipe.weight_decay, **kw)
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr,
                                   weight_decay=recipe.weight_decay, **kw)


class LrFactor:
    """The learning rate's factor at optimizer step ``step`` of a run of ``total`` steps: with
    ``warmup`` steps, a linear ramp first ((k + 1) / warmup at step k, so the first step already
    moves), then 1 → 0 along half a cosine over the steps left (``decay=False``: 1 from then
    on), 0 past the end. Closed form (not CosineAnnealingLR's recursive update, which stays at 0
    once it gets there), so a resumed run can continue the curve, or stretch it, from any
    position."""

    def __init__(self, total: int, warmup: int = 0, decay: bool = True, offset: int = 0):
        self.total, self.warmup, self.decay = max(int(total), 1), max(int(warmup), 0), decay
        self.offset = int(offset)  # the step the schedule starts at (a resume that starts one)

    def __call__(self, step: int) -> float:
        step -= self.offset
        if step < self.warmup:
            return (step + 1) / self.warmup
        if not self.decay:
            return 1.0
        span = max(self.total - self.warmup, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - self.warmup, span) / span))


def _schedule(state: TrainState) -> None:
    """The schedule (cosine and/or a warm-up) as a LambdaLR. Its base rates are kept as
    numbers: where the group's "lr" is a device tensor (under CUDA graphs), the scheduler
    writes that tensor in place and must not scale a base that is the same tensor."""
    r = state.recipe
    if r.scheduled:
        inner = getattr(state.optimizer, "inner", state.optimizer)
        for group in inner.param_groups:
            group["initial_lr"] = float(group["lr"])
        factor = LrFactor(state.total_steps, r.lr_warmup, decay=r.schedule == "cosine")
        if state.total_steps and r.lr_warmup >= state.total_steps:
            state.warn("optimizer", f"lr_warmup={r.lr_warmup} is as long as the run "
                       f"({state.total_steps} steps): the rate never reaches lr"
                       + (" and the cosine never starts" if factor.decay else ""))
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(inner, factor)  # bases: initial_lr


def schedule_record(scheduler) -> dict | None:
    """What a checkpoint keeps of the schedule: its length, warm-up, decay and first step, and
    the next step's position."""
    if scheduler is None:
        return None
    f = scheduler.lr_lambdas[0]
    return {"total": f.total, "position": scheduler.last_epoch, "warmup": f.warmup,
            "decay": f.decay, "offset": f.offset}


def continue_schedule(state: TrainState, saved: dict | None, start: int) -> None:
    """A resumed run continues the checkpoint's schedule at ``start``: the saved run's length,
    warm-up and decay (a different warm-up or decay asked of this run is warned about and not
    used), the length stretched to ``start`` + this run's steps when this run goes past its end
    (warned). A checkpoint without a schedule (a constant rate) starts this run's schedule,
    warm-up first, at ``start``. The optimizer's learning rates are set from the schedule, not
    taken from the checkpoint."""
    sched = state.scheduler
    if sched is None:
        if saved:  # this run asks for a constant rate, without a warm-up
            state.warn("optimizer", "resume: the checkpoint's schedule is not continued: this "
                       "run has a constant rate (set schedule and lr_warmup as saved to continue "
                       "it)")
        return
    if saved and "T_max" in saved:  # an older checkpoint: CosineAnnealingLR's state dict
        saved = {"total": saved["T_max"], "position": saved["last_epoch"]}
    factor = sched.lr_lambdas[0]
    if saved:
        was = (int(saved.get("warmup", 0)), bool(saved.get("decay", True)))
        if was != (factor.warmup, factor.decay):
            state.warn("optimizer", f"resume: the checkpoint's schedule has lr_warmup={was[0]} "
                       f"and {'cosine' if was[1] else 'constant'} decay; it continues as saved, "
                       "not as this run's recipe asks")
        factor.warmup, factor.decay = was
        factor.offset = int(saved.get("offset", 0))
        total, position = int(saved["total"]), int(saved["position"])
    else:  # a constant rate before: this run's schedule starts here
        factor.offset, total, position = start, state.total_steps, start
    end = position + state.total_steps
    factor.total = total
    if end > factor.offset + total and factor.decay:
        state.warn("optimizer", f"resume: the checkpoint's cosine schedule spans {total} steps "
                   f"and is at step {position}; this run's {state.total_steps} steps go past "
                   f"its end, so it is stretched to {end} steps from here on")
        factor.total = end - factor.offset
    kind = "cosine schedule" if factor.decay else "warm-up schedule"
    state.note("optimizer", f"resume: {kind} at step {position} of "
               f"{factor.offset + factor.total}")
    sched.last_epoch = position
    sched._last_lr = [base * factor(position) for base in sched.base_lrs]
    for group, lr in zip(sched.optimizer.param_groups, sched._last_lr):
        if isinstance(group["lr"], torch.Tensor):  # a device rate (CUDA graphs): in place
            group["lr"].fill_(float(lr))
        else:
            group["lr"] = lr


def apply(state: TrainState) -> str:
    r = state.recipe
    params = [p for p in state.trainable.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the trainable module has no parameters that require grad")
    lr = state.workload.lr_of(r.lr)
    n = sum(p.numel() for p in params)
    warm = f", {r.lr_warmup} warm-up steps" if r.lr_warmup else ""
    what = f"{r.optimizer} {r.optimizer_impl}, lr {lr:g} ({r.schedule}{warm})"
    if r.master_weights and r.mixed:
        return _mixed_masters(state, params, lr, what)
    if r.offload == "optimizer" or r.master_weights:
        where = torch.device("cpu") if r.offload == "optimizer" else state.device
        state.optimizer = ShadowOptimizer(params, r, lr, where)
        _schedule(state)
        if r.offload == "optimizer" and not state.cuda:
            state.warn("optimizer", "offload on a CPU run keeps everything in host memory anyway")
        kind = "state and fp32 weights offloaded to pinned CPU memory" if r.offload != "none" \
            else "fp32 master weights on the device"
        return f"{what} over {len(params)} tensors ({n / 1e6:.1f} M params); {kind}"
    if state.zero1:
        if r.optimizer_impl == "triton":
            state.warn("optimizer", "optimizer_impl=triton does not shard its state; zero1 "
                       "uses PyTorch's AdamW" + _fp32_moments(state))
        state.optimizer = _zero1(params, r, lr)
        _schedule(state)
        return f"{what}, state sharded over {state.world} ranks (ZeroRedundancyOptimizer)"
    # CUDA graph replay needs the step count on the device (capturable) so no host sync occurs.
    capturable = r.cuda_graphs and state.cuda
    if r.optimizer_impl == "triton":
        why = _flat_unfit(state, params)
        if why is None:
            return _flat_adamw(state, params, lr, what)
        state.warn("optimizer", f"optimizer_impl=triton: {why}; using PyTorch's fused AdamW"
                   + _fp32_moments(state))
        r = r.replace(**PYTORCH_ADAMW)  # (master_weights is off on this path already)
        what = f"{what} (fused: triton could not run)"
    state.optimizer = build(params, r, lr, capturable)
    _schedule(state)
    return (f"{what} over {len(params)} tensors ({n / 1e6:.1f} M params)"
            f"{', capturable' if capturable else ''}")


def _fp32_moments(state: TrainState) -> str:
    """Where PyTorch's AdamW stands in for the one-launch one: its moments are fp32, so a
    recipe's optimizer_state=bf16 does nothing (said, and recorded as no effect)."""
    if state.recipe.optimizer_state == "fp32":
        return ""
    state.no_effect["optimizer_state"] = "PyTorch's AdamW keeps fp32 moments"
    return " (with fp32 moments: optimizer_state=bf16 has no effect)"


def _unmet(recipe: Recipe, device_type: str) -> str | None:
    """The one-launch AdamW's kernel runs on CUDA, or on the CPU in Triton's interpreter."""
    if (recipe.optimizer_impl == "triton" and device_type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        return ("optimizer_impl=triton needs CUDA (its kernel runs on the CPU only in Triton's "
                "interpreter, TRITON_INTERPRET=1)")
    return None


TECHNIQUE = Technique(
    name="optimizer", phase=Phase.OPTIMIZER, summary="AdamW / SGD, fused, master weights, CPU offload",
    changes_numerics=False, apply=apply, unmet=_unmet,
    example={"optimizer_impl": "foreach"})
