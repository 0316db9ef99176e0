"""Your loop, fasttrain's step: ``fasttrain.Step`` keeps the training loop you wrote and makes
its step fast.

    step = fasttrain.Step(model, optimizer, loss_fn, example_batch)   # your optimizer, kept
    step = fasttrain.Step(model, {"lr": 3e-4}, loss_fn, example_batch)  # fasttrain's optimizer
    for batch in loader:
        loss = step(batch)  # forward, backward, gradient clipping, optimizer step

``loss_fn(model, batch)`` returns the loss you would call ``backward()`` on (a 0-dim tensor);
``batch`` is whatever your loader yields (a tensor, a tuple, a dict, nested: a pytree of
tensors). The step applies a recipe's techniques to your model in the order a fasttrain run
does (``techniques/__init__.py``): the converters, bf16 autocast, the fused layer paths,
torch.compile, fasttrain's one-launch AdamW with the clipping folded in, and, on a GPU, the
whole step (forward, backward, clip, optimizer) captured as one CUDA graph after three eager
steps. Each batch is copied into the graph's static inputs; a batch of another shape, dtype or
structure makes the step fall back to eager steps from then on and say why (``report()``), so
a ragged last batch costs speed, never correctness.

The model is changed in place (its classes, its weights' storage under bf16 master weights);
its parameters stay the same objects, so an optimizer you built before still holds them and
``model.state_dict()`` loads into the unconverted model. Use ``step.model`` (compiled) or your
own ``model`` for evaluation, ``step.optimizer`` for the optimizer's state and learning rate.

An optimizer you pass is used as it is, made capturable under CUDA graphs (its learning rate a
device tensor, which PyTorch's schedulers update in place: a scheduler you step keeps working).
Passing a recipe instead (a ``Recipe``, a preset name or a dict of switches over the default)
lets fasttrain build the optimizer: ``optimizer_impl=triton`` (one launch a step, the gradient
clipping inside) and ``master_weights`` need that. One process; accumulation is your loop's.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..errors import FasttrainError
from ..layers.conv import conv_network
from ..recipe import PYTORCH_ADAMW, Recipe, load_toml
from ..techniques import probe_contexts, registry, unmet_requirements
from ..techniques.base import TrainState
from ..workloads.base import Batch, Workload
from .loop import ItemCounter, _Stepper

DEFAULT = Recipe(precision="bf16-mixed", attention="auto", optimizer_impl="triton",
                 master_weights=True, gemm_pad=64, compile="model", cuda_graphs=True,
                 graph_memset_kernels=True, convert=True,
                 kernels="gelu,attention,patch,layernorm")
"""What a Step turns on unless told otherwise: the fast paths that need nothing of the model and
keep the loss (bf16 autocast with bf16 master weights, fused attention, the one-launch AdamW,
odd GEMM widths padded, the converters with their bias + GELU kernel, fasttrain's attention
kernel for the SDPA calls it wins on, the patch projection as one GEMM, the residual adds of
recognised pre-norm blocks inside their LayerNorms, torch.compile, the whole step as one CUDA
graph), plus channels-last for a convolution network. The bf16 residual stream moves the loss
within bf16's rounding and is left to the caller (``{"stream_dtype": "bf16"}``). A recipe you pass as a dict is applied over this one;
where fasttrain cannot build the optimizer (yours is kept) the AdamW switches do not apply."""

_SKIPPED = ("init", "dataloader", "padding", "accumulation")
"""Techniques a Step does not run: the model is yours (built), and so are the loader and the
accumulation."""


class _NoTimer:
    """The loop's phase marks, unused: your loop times itself."""

    def mark(self, name: str) -> None:
        pass


class _LoopWorkload(Workload):
    """The Workload contract over a user's ``loss_fn``: the batch travels as a dict of its
    tensor leaves (the graph's static inputs), rebuilt into the user's structure for the loss."""

    name, size, unit = "your step", "custom", "sample"

    def __init__(self, loss_fn: Callable, structure: pytree.TreeSpec, constants: dict[int, Any]):
        self.loss_fn, self.structure, self.constants = loss_fn, structure, constants

    def rebuild(self, flat: Batch) -> Any:
        leaves = [self.constants[i] if i in self.constants else flat[str(i)]
                  for i in range(self.structure.num_leaves)]
        return pytree.tree_unflatten(leaves, self.structure)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self.loss_fn(model, self.rebuild(batch))

    def count(self, batch: Batch) -> int:
        return 1  # loss_fn returns the loss to differentiate (a mean, usually): not divided


def _flatten(batch: Any, device: torch.device) -> tuple[Batch, pytree.TreeSpec, dict[int, Any]]:
    """The batch's tensor leaves on ``device`` by position, its structure, its other leaves."""
    leaves, structure = pytree.tree_flatten(batch)
    flat, constants = {}, {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            flat[str(i)] = leaf.to(device, non_blocking=True)
        else:
            constants[i] = leaf
    if not flat:
        raise FasttrainError("Step: the batch holds no tensor; pass what your loader yields "
                             "(a tensor, a tuple or a dict of tensors)")
    return flat, structure, constants


def _recipe(choice: Any, device: torch.device, model: nn.Module,
            own_optimizer: bool) -> tuple[Recipe, list[str]]:
    """The recipe a Step runs, with the switches this device or optimizer cannot run turned off
    (and why)."""
    if isinstance(choice, Recipe):
        recipe = choice
    elif isinstance(choice, str):
        from ..presets import presets

        known = presets()
        if choice not in known:
            raise FasttrainError(f"Step: no preset {choice!r}: use one of {', '.join(known)}, a "
                                 "Recipe or a dict of switches")
        recipe = load_toml(known[choice].path)
    elif isinstance(choice, dict) or choice is None:
        if int((choice or {}).get("accumulation", 1)) != 1:
            raise FasttrainError("Step: accumulation is your loop's (call the step per "
                                 "optimizer step); set accumulation=1")
        switches = dict(choice or {})
        if "channels_last" not in switches and conv_network(model):
            switches["channels_last"] = True
        recipe = DEFAULT.replace(**switches)
    else:
        raise FasttrainError(f"Step: the second argument is a torch.optim.Optimizer, a Recipe, a "
                             f"preset name or a dict of recipe switches, not "
                             f"{type(choice).__name__}")
    if recipe.accumulation != 1:
        raise FasttrainError("Step: accumulation is your loop's (call the step per optimizer "
                             "step); set accumulation=1")
    dropped = []
    if own_optimizer and (recipe.optimizer_impl == "triton" or recipe.master_weights):
        recipe = dataclasses.replace(recipe, **PYTORCH_ADAMW)
        dropped.append("your optimizer is kept: optimizer_impl=triton, master_weights and "
                       "optimizer_state (which need fasttrain's AdamW) off")
    if own_optimizer and recipe.scheduled:
        recipe = dataclasses.replace(recipe, schedule="constant", lr_warmup=0)
        dropped.append("your optimizer is kept: the recipe's schedule and lr_warmup off (step "
                       "a scheduler of your own on it)")
    if device.type != "cuda":
        cuda_only = {t.name for t in registry() if "cuda" in t.requires and t.active(recipe)}
        off = {"cuda_graphs": False, "graph_memset_kernels": False, "fp8": "none",
               "ema": "auto", "pdl": False}
        changes = {k: v for k, v in off.items() if k in cuda_only}
        if recipe.optimizer_impl == "triton":
            changes.update(PYTORCH_ADAMW)
        if recipe.precision in ("bf16-mixed", "fp16-mixed"):
            changes.update(precision="fp32", master_weights=False)
            if recipe.stream_dtype != "auto":
                changes["stream_dtype"] = "auto"
            if recipe.fp8 != "none":  # float8 matmuls need a 16-bit precision
                changes["fp8"] = "none"
        if changes:
            recipe = dataclasses.replace(recipe, **changes)
            dropped.append(f"on {device.type}: {', '.join(sorted(changes))} off (GPU switches)")
    unmet = unmet_requirements(recipe, device.type)
    if unmet:
        raise FasttrainError(f"Step: {'; '.join(unmet)}")
    return recipe, dropped


def _capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """A user's optimizer made safe to capture: ``capturable`` on, the learning rate a device
    tensor (a captured float would freeze it). Returns why it cannot be captured, or None."""
    groups = optimizer.param_groups
    if not all("capturable" in g for g in groups):
        return f"{type(optimizer).__name__} has no capturable mode"
    if any(g.get("differentiable") for g in groups):
        return "a differentiable optimizer cannot be captured"
    for g in groups:
        g["capturable"] = True
        if not isinstance(g["lr"], torch.Tensor):
            g["lr"] = torch.tensor(float(g["lr"]), device=device)
    for st in optimizer.state.values():  # a restored optimizer: its step counts on the device
        if isinstance(st.get("step"), torch.Tensor):
            st["step"] = st["step"].to(device)
    return None


class Step:
    """One training step of your loop, made fast; ``step(batch)`` returns the loss (a device
    tensor, not synchronised)."""

    def __init__(self, model: nn.Module, optimizer_or_recipe: Any = None,
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                 example_batch: Any = None, *, recipe: Recipe | dict | str | None = None,
                 total_steps: int = 0):
        if not isinstance(model, nn.Module):
            raise FasttrainError(f"Step: model must be a torch.nn.Module, not "
                                 f"{type(model).__name__}")
        if not callable(loss_fn):
            raise FasttrainError("Step: pass loss_fn(model, batch) returning the loss to "
                                 "differentiate")
        if example_batch is None:
            raise FasttrainError("Step: pass an example batch (one your loader yields): the "
                                 "step is prepared and checked on it")
        param = next(model.parameters(), None)
        if param is None:
            raise FasttrainError("Step: the model has no parameters to train")
        self.device = param.device
        user_opt = optimizer_or_recipe if isinstance(optimizer_or_recipe,
                                                     torch.optim.Optimizer) else None
        self.recipe, self._notes = _recipe(
            recipe if user_opt is not None else optimizer_or_recipe, self.device, model,
            own_optimizer=user_opt is not None)
        if self.recipe.schedule != "constant" and not total_steps:
            raise FasttrainError(f"Step: schedule={self.recipe.schedule} needs the run's length; "
                                 "pass total_steps=N (or schedule your own optimizer)")
        flat, structure, constants = _flatten(example_batch, self.device)
        self.workload = _LoopWorkload(loss_fn, structure, constants)
        self.state = TrainState(recipe=self.recipe, workload=self.workload, device=self.device,
                                model=model, trainable=model, micro_batch=_rows(flat),
                                total_steps=total_steps)
        self._apply(user_opt, flat)
        self.fallback: str | None = None
        self._signature = _signature(flat, constants)
        self._counter = ItemCounter(self.workload, self.device)
        self._stepper = _Stepper(self.state, _NoTimer())
        self.steps = 0

    def _apply(self, user_opt: torch.optim.Optimizer | None, flat: Batch) -> None:
        """The recipe's techniques in phase order, the probe step between the two halves."""
        from ..techniques import PROBE_AFTER

        s = self.state
        if user_opt is not None and s.recipe.cuda_graphs:
            why = _capturable(user_opt, self.device)
            if why:
                s.recipe = self.recipe = dataclasses.replace(s.recipe, cuda_graphs=False)
                self._notes.append(f"cuda_graphs off: {why}")
        probed = False
        for tech in registry():
            if tech.phase > PROBE_AFTER and not probed:
                self._probe(flat)
                probed = True
            if tech.name in _SKIPPED or not tech.active(s.recipe):
                continue
            if tech.name == "optimizer" and user_opt is not None:
                s.optimizer = user_opt
                s.applied["optimizer"] = f"yours: {type(user_opt).__name__}" + (
                    " (capturable, lr a device tensor)" if s.recipe.cuda_graphs else "")
                continue
            did = tech.apply(s)
            if did:
                s.applied[tech.name] = did

    def _probe(self, flat: Batch) -> None:
        """One eager forward + backward on the example batch: checks the loss and lets the
        techniques' probes see the model (which attention kernel ran); gradients are dropped."""
        s = self.state
        try:
            with probe_contexts(s):
                with s.step_context():
                    loss = self.workload.loss(s.model, flat)
                _check_loss(loss)
                loss.backward()
        finally:
            for p in s.model.parameters():
                p.grad = None

    def __call__(self, batch: Any) -> torch.Tensor:
        flat, _, constants = _flatten(batch, self.device)
        stepper = self._stepper
        if stepper.graphed is not None and _signature(flat, constants) != self._signature:
            self._fall_back(flat, constants)
        if stepper.graphed is None:
            self.workload.constants = constants
        stepper.count = self._counter([flat])
        self.steps += 1
        return stepper([flat])

    def _fall_back(self, flat: Batch, constants: dict[int, Any]) -> None:
        """A batch the captured graph cannot take: eager steps from now on, said once."""
        first = _difference(self._signature, _signature(flat, constants))
        self.fallback = (f"step {self.steps + 1}: {first}; the CUDA graph replays one batch "
                         "shape, so every step from here runs eagerly (keep the batches one "
                         "shape, e.g. drop_last=True, to keep the graph)")
        warnings.warn(f"fasttrain.Step: {self.fallback}", stacklevel=3)
        self._stepper.graphed = None  # its memory pool goes with it
        self.state.optimizer.zero_grad(set_to_none=True)  # the graph's static gradients

    @property
    def model(self) -> nn.Module:
        """The model the step trains (compiled when the recipe compiles)."""
        return self.state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    def report(self) -> dict[str, Any]:
        """What each switch did (``applied``), what it matched nothing in (``no_effect``),
        warnings, the device's dropped switches and a CUDA graph fallback."""
        return {"recipe": self.recipe.to_dict(), "applied": dict(self.state.applied),
                "no_effect": dict(self.state.no_effect), "warnings": list(self.state.warnings),
                "notes": list(self._notes), "fallback": self.fallback,
                "graphed": self._stepper.graphed is not None and self.fallback is None}

    def __repr__(self) -> str:
        lines = [f"fasttrain.Step on {self.device} ({self.steps} steps)"]
        lines += [f"  {k}: {v}" for k, v in self.state.applied.items()]
        lines += [f"  no effect: {k}: {v}" for k, v in self.state.no_effect.items()]
        idle = {f"{k}: {v}" for k, v in self.state.no_effect.items()}
        lines += [f"  warning: {w}" for w in self.state.warnings if w not in idle]
        lines += [f"  note: {n}" for n in self._notes + ([self.fallback] if self.fallback else [])]
        return "\n".join(lines)

    def close(self) -> None:
        """Restore the global flags the recipe set (TF32, backend switches)."""
        self.state.restore.close()

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise FasttrainError(f"Step: loss_fn returned {type(loss).__name__}, not a tensor; "
                             "return the loss tensor itself (not loss.item())")
    if loss.numel() != 1:
        raise FasttrainError(f"Step: loss_fn returned a tensor of shape {tuple(loss.shape)}, "
                             "not a scalar; reduce it (e.g. .mean()) before returning")
    if not loss.requires_grad:
        raise FasttrainError("Step: loss_fn's loss does not require grad (computed under "
                             "no_grad, or detached); return the loss of the model's forward")


def _rows(flat: Batch) -> int:
    first = next(iter(flat.values()))
    return int(first.shape[0]) if first.dim() else 1


def _signature(flat: Batch, constants: dict[int, Any]) -> tuple:
    return (tuple((k, tuple(v.shape), v.dtype) for k, v in flat.items()),
            tuple(sorted((i, repr(c)) for i, c in constants.items())))


def _difference(captured: tuple, now: tuple) -> str:
    """The first way this batch differs from the captured one, in words."""
    old, new = dict((k, (s, d)) for k, s, d in captured[0]), dict(
        (k, (s, d)) for k, s, d in now[0])
    if old.keys() != new.keys():
        return f"the batch has {len(new)} tensors, the captured one {len(old)}"
    for k in old:
        if old[k] != new[k]:
            return (f"batch tensor {k} is {tuple(new[k][0])} {new[k][1]}, the captured one "
                    f"{tuple(old[k][0])} {old[k][1]}")
    return "the batch's non-tensor values differ from the captured ones"


__all__ = ["DEFAULT", "Step"]
