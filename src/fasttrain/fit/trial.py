"""One fit trial, run in a fresh process by ``run.child`` (job ``fasttrain.fit.trial:trial_job``).

A trial is everything a real job does at this batch: training steps (forward, backward,
optimizer with its state allocated, EMA), one eval forward, and one checkpoint save — so an
answer that passes here does not run out of memory later at the eval or the save. On CUDA the
memory budget is enforced (``set_per_process_memory_fraction``); on CPU the peak resident set of
the process is measured against it.
"""
from __future__ import annotations

import resource
import statistics
import traceback

from ..measure.files import torch_save
from ..run.child import ChildSpec
from ..run.loop import Observer
from ..run.scratch import scratch

GIB = 1024 ** 3


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux: KiB


def _eval_and_save(state, batch) -> None:
    import torch

    wl, model = state.workload, state.model
    model.eval()
    with torch.no_grad(), state.step_context():
        wl.loss(model, batch)
    model.train()
    with scratch("trial") as tmp:
        torch_save({"model": model.state_dict(),
                    "optimizer": state.optimizer.state_dict() if hasattr(
                        state.optimizer, "state_dict") else {}}, tmp / "ckpt.pt")


class _EvalSave(Observer):
    """After the last training step, one eval forward and one checkpoint save."""

    name = "eval_save"

    def __init__(self, last: int):
        self.last, self.state, self.done = last, None, False

    def attach(self, state) -> None:
        self.state = state

    def end(self, step: int) -> None:
        if step == self.last:
            from ..run.data import to_device

            ds = self.state.workload.dataset()
            n = self.state.micro_batch
            batch = to_device(self.state.workload.collate([ds[i % len(ds)] for i in range(n)]),
                              self.state.device, False)
            _eval_and_save(self.state, batch)
            self.done = True

    def report(self) -> dict:
        return {"eval_and_save": self.done}


def trial_job(spec: ChildSpec) -> dict:
    import torch

    from ..errors import FasttrainError, describe_error
    from ..recipe import Recipe
    from ..run.loop import train
    from ..workloads import load_workload

    device = spec.device
    budget = spec.budget_gib
    if device.startswith("cuda") and budget:
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    row = {"batch": spec.recipe["batch"], "error": None}
    try:
        wl = load_workload(spec.workload, spec.size, data=spec.data, **spec.options)
        recipe = Recipe().replace(**spec.recipe)
        # One extra step carries the eval and the save; the step time is the median of the
        # others, so the throughput a trial reports is the training step's alone.
        obs = _EvalSave(last=spec.warmup + spec.steps)
        res = train(wl, recipe, steps=spec.steps + 1, warmup=spec.warmup, device=device,
                    observers=(obs,))
        step = statistics.median(res.step_times_s[:-1])
        row.update(step_time_s=step, throughput=res.throughput * res.step_time_s / step,
                   throughput_unit=res.throughput_unit, losses=res.losses,
                   eval_and_save=obs.done, eval_and_save_step_s=res.step_times_s[-1])
        if device.startswith("cuda"):
            row.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                       peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    except FasttrainError as err:
        row["error"] = str(err)
    except Exception as err:  # any failure is the trial's answer, not a crash of the search
        traceback.print_exc()
        row["error"] = describe_error(err, 200)
    row["peak_rss_gib"] = _peak_rss_gib()
    return row
