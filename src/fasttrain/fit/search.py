"""``fasttrain fit``: the largest batch that really fits — estimated, searched, re-verified.

1. Estimate: weights, gradients and optimizer state by dtype (from the recipe, counted on the
   meta device), activations per sample from one small measured trial.
2. Search: grow (doubling from the estimate's neighbourhood), then bisect; every trial is the
   full job at that batch in a fresh process (fit.trial: steps, eval, checkpoint save) under the
   memory budget minus a headroom margin.
3. The answer is run once more in a fresh process before it is returned.
``objective="throughput"`` repeats the search for each activation-checkpointing mode and returns
the batch and mode with the most samples/s within the budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import FasttrainError
from ..recipe import Recipe
from ..techniques import allocator
from ..workloads import load_workload
from ..measure.rows import make_row
from ..run.child import ChildSpec, run_in_child
from ..run.scratch import scratch

GIB = 1024 ** 3


@dataclass
class FitSpec:
    workload: str = "vit"
    size: str = "tiny"
    recipe: Recipe = field(default_factory=Recipe)
    device: str = "cpu"
    budget_gib: float | None = None  # None: the device's memory (CUDA) / required on CPU
    max_batch: int = 4096
    headroom: float = 0.05
    objective: str = "fit"  # fit | throughput
    multiple_of: int = 1  # searched batches are multiples of this (and of the accumulation)
    steps: int = 2
    warmup: int = 1
    data: str | None = None
    options: dict = field(default_factory=dict)


def persistent_estimate(spec: FitSpec) -> dict[str, float]:
    """Bytes on the device that do not depend on the batch, from the recipe and meta weights."""
    wl = load_workload(spec.workload, spec.size, data=spec.data, **spec.options)
    with torch.device("meta"):
        model = wl.build_model()
    r = spec.recipe
    # bf16-true, or bf16-mixed with master weights (its linear/conv weights: most of a model)
    wbytes = 2 if r.precision == "bf16-true" or r.master_weights else 4
    params = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for p in wl.trainable(model).parameters() if p.requires_grad)
    # bytes of one AdamW moment: 2 in bf16, where the one-launch AdamW keeps them (one
    # process or DDP, not bf16-true's bf16 weights); PyTorch's AdamW, standing in elsewhere, 4
    bf16_moments = (r.optimizer_state == "bf16" and r.sharding in ("auto", "none", "ddp")
                    and r.precision != "bf16-true")
    moment = 2 if bf16_moments else 4
    state = {"adamw": 2 * moment, "sgd": 4}[r.optimizer] * train
    if r.master_weights:
        state += 4 * train
    if r.offload == "optimizer":
        state = 0
    ema = 4 * train if (r.ema != "none" and (r.ema != "auto" or wl.has_ema)) else 0  # fp32
    return {"parameters": params * wbytes / GIB, "gradients": train * wbytes / GIB,
            "optimizer_state": state / GIB, "ema": ema / GIB}


def _peak(row: dict, device: str) -> float | None:
    return row.get("peak_reserved_gib") if device.startswith("cuda") else row.get("peak_rss_gib")


class Search:
    """Trials in fresh processes, logged; ``passes(b)`` is the only question it asks."""

    def __init__(self, spec: FitSpec, recipe: Recipe, on_trial: Callable[[dict], None] | None):
        self.spec, self.recipe, self.on_trial = spec, recipe, on_trial
        self.trials: list[dict] = []
        self.limit = spec.budget_gib * (1 - spec.headroom) if spec.budget_gib else None

    def trial(self, batch: int) -> dict:
        s, rec = self.spec, self.recipe.replace(batch=batch)
        child = ChildSpec(job="fasttrain.fit.trial:trial_job", workload=s.workload, size=s.size,
                          device=s.device, recipe=rec.to_dict(), steps=s.steps, warmup=s.warmup,
                          data=s.data, options=s.options, budget_gib=s.budget_gib)
        with scratch("fit") as tmp:
            row = {"batch": batch, **run_in_child(child, tmp, "trial",
                                                  extra_env=allocator.child_env(rec))}
        row["error"] = row.get("error")
        peak = _peak(row, s.device)
        if not row["error"] and self.limit is not None and peak is not None and peak > self.limit:
            row["error"] = f"peak {peak:.2f} GiB over the budget's {self.limit:.2f} GiB"
        row = make_row("fit", s.workload, s.size, None, **{**row, "recipe": rec.to_dict(),
                                                           "passed": row["error"] is None,
                                                           "peak_gib": peak})
        self.trials.append(row)
        if self.on_trial:
            self.on_trial(row)
        return row

    def largest(self, start: int) -> dict | None:
        """Grow from ``start`` by doubling until a trial fails, then bisect; the passing row."""
        k = math.lcm(self.recipe.accumulation, self.spec.multiple_of)
        step = lambda b: max(k, (b // k) * k)  # noqa: E731 — batches stay multiples of k
        cap = step(self.spec.max_batch)  # the largest batch allowed that is a multiple of k
        lo, hi, b = None, None, step(min(start, cap))
        while True:  # grow (or shrink) until the first pass/fail boundary is bracketed
            row = self.trial(b)
            if row["passed"]:
                lo = row
                if hi is not None or b >= cap:
                    break
                b = step(min(b * 2, cap))
            else:
                hi = b
                if lo is not None or b == k:
                    break
                b = step(b // 2)
        while lo is not None and hi is not None and hi - lo["batch"] > k:
            mid = step((lo["batch"] + hi) // 2)
            row = self.trial(mid)
            lo, hi = (row, hi) if row["passed"] else (lo, mid)
        return lo


def _start(spec: FitSpec, search: Search) -> int:
    """First guess: the peak at the two smallest batches gives the fixed part (weights,
    gradients, optimizer state — or on CPU the whole process) and activations per sample."""
    k = max(spec.recipe.accumulation, 1)
    one = search.trial(k)
    if not one["passed"]:
        est = persistent_estimate(spec)
        raise FasttrainError(
            f"fit: even batch {k} does not fit ({one['error']}); weights, gradients and "
            f"optimizer state alone are {sum(est.values()):.2f} GiB")
    two = search.trial(2 * k)
    if not two["passed"] or not one.get("peak_gib") or not two.get("peak_gib"):
        return k
    per_sample = max(two["peak_gib"] - one["peak_gib"], 1e-6) / k
    fixed = one["peak_gib"] - per_sample * k
    return max(2 * k, int((search.limit - fixed) / per_sample))


def fit(spec: FitSpec, on_trial: Callable[[dict], None] | None = None) -> dict:
    """Largest batch (objective fit) or fastest batch + checkpointing mode within the budget."""
    if spec.device == "cpu" and not spec.budget_gib:
        raise FasttrainError("fit: on CPU give --memory-budget GiB (there is no device limit)")
    if spec.device.startswith("cuda") and not spec.budget_gib:
        spec.budget_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    modes = [spec.recipe.checkpointing] if spec.objective == "fit" else ["none", "selective", "full"]
    best, trials, failures = None, [], []
    for mode in modes:
        search = Search(spec, spec.recipe.replace(checkpointing=mode), on_trial)
        try:
            found = search.largest(_start(spec, search))
        except FasttrainError as err:  # this mode cannot fit; another may
            failures.append(str(err))
            found = None
        trials += search.trials
        if found and (best is None or _better(found, best, spec.objective)):
            best = found
    if best is None:
        raise FasttrainError(failures[0] if failures else "fit: no batch fits")
    final = Search(spec, Recipe().replace(**best["recipe"]), on_trial).trial(best["batch"])
    if not final["passed"]:
        raise FasttrainError(f"fit: batch {best['batch']} passed the search but failed the "
                             f"re-verification ({final['error']}); lower --headroom risk")
    final["kind"], final["verified"], final["trials"] = "fit", True, len(trials) + 1
    return final


def _better(a: dict, b: dict, objective: str) -> bool:
    if objective == "throughput":
        return (a.get("throughput") or 0) > (b.get("throughput") or 0)
    return a["batch"] > b["batch"]
