"""One inference rung, run in a fresh process (``run.child``): build, prepare, measure, row.

The order matters: accuracy first (every held-out image through the prepared forward, at the
throughput batch, so the compiled graph that is timed is the one that is checked), then
throughput at the batch, then batch-1 latency (a second compiled graph; its compile is outside
every timed window). The fp32 reference rung also writes the logits and the model's FLOPs that
the other rungs compare against.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..measure.rows import blank_row
from ..run.child import ChildSpec
from ..workloads import load_workload
from . import bench
from .model import check_device, load_classifier, prepare
from .spec import REFERENCE, InferSpec, nothing_added


def infer_job(child: ChildSpec) -> dict:
    """The row of the rung ``child.job_args`` describes (an :class:`InferSpec`)."""
    spec = InferSpec(**child.job_args)
    rung = spec.rung_config()
    device = torch.device(spec.device)
    row = blank_row("inference", spec.workload, spec.size, rung.name, peer=rung.peer,
                    batch=spec.batch, throughput_unit="img/s", latency_ms=None, accuracy=None,
                    summary=rung.summary)
    why = check_device(rung, device)
    if why is not None:
        return {**row, "skipped": why}
    workdir = Path(spec.workdir)
    wl = load_workload(spec.workload, spec.size, seed=0, data=spec.data, **spec.options)
    images, labels = bench.eval_images(wl, spec.images, workdir)
    model = load_classifier(wl, spec.checkpoint)
    reference = None if rung.name == REFERENCE else bench.load_reference(workdir)

    t0 = time.perf_counter()
    with torch.inference_mode():
        fwd, applied = prepare(model, rung, device)
        if why := nothing_added(rung, applied):  # the rung would measure the one before again
            return {**row, "applied": applied, "skipped": why}
        x = images[:spec.batch].to(device)
        if len(x) < spec.batch:  # fewer held-out images than the batch: repeat them
            x = x.repeat((spec.batch + len(x) - 1) // len(x), *[1] * (x.dim() - 1))[:spec.batch]
        logits = bench.all_logits(fwd, images, spec.batch, device)  # checks the output first
        flops = bench.count_flops(fwd, x) if rung.name == REFERENCE else reference["flops"]
        warmup_s = time.perf_counter() - t0
        speed = bench.throughput(fwd, x, spec.iters, spec.warmup, device)
        # single calls are cheap and their tail is what p90 is about: at least 100 on a GPU
        calls = max(spec.iters, 100) if device.type == "cuda" else spec.iters
        latency = bench.latency_ms(fwd, x[:1], calls, spec.warmup, device)
    # synthetic images carry random labels, and a flat folder without labels.json labels
    # every image 0: top-1 means something only for the user's labelled classes
    real_labels = spec.data is not None and len(set(labels.tolist())) > 1
    if rung.name == REFERENCE:
        top1 = (logits.argmax(-1) == labels).float().mean().item() if real_labels else None
        bench.save_reference(workdir, logits, flops, top1)
        reference = {"logits": logits, "top1": top1}
    acc = bench.accuracy(logits, reference["logits"], labels if real_labels else None,
                         reference["top1"])
    step = speed["step_time_s"]
    return {**row, **speed, "latency_ms": latency, "accuracy": acc, "applied": applied,
            "model_flops": flops, "tflops": flops / step / 1e12 if flops and step else None,
            "warmup_s": warmup_s, "parity": {"passed": acc["passed"],
                                            "max_rel_dev": None, "agreement": acc["agreement"]}}
