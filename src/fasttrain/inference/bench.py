"""Measuring a forward pass: batch-1 latency, throughput at a batch, and accuracy.

- **Latency** is what one request waits: the device is idle before the call, the host clock runs
  from the call to the moment its output is ready (``synchronize``), launch overhead included.
  p50 and p90 of ``iters`` calls.
- **Throughput** is what a server sustains: ``iters`` back-to-back calls timed as a whole, so
  the host runs ahead of the device as it would under load; images / second. The median time
  of one call (CUDA events around each) is kept beside it as ms/batch.
- **Accuracy** compares the logits of every held-out image with the fp32 model's: top-1
  agreement, max and mean absolute logit deviation; and, where the images carry real labels,
  top-1 accuracy and its change against fp32.

The evaluation images are decoded once (by the reference rung) and shared with the other rungs
through a file in the run's folder, as are the reference logits and the model's FLOPs.
"""
from __future__ import annotations

import io
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import FasttrainError, first_line
from ..measure.files import write_atomic
from ..workloads.base import Workload
from .spec import GATE

EVAL_FILE, REFERENCE_FILE = "eval-images.pt", "reference.pt"

Forward = Callable[[torch.Tensor], torch.Tensor]


def _save(path: Path, obj) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    write_atomic(path, buf.getvalue())


def eval_images(wl: Workload, count: int, workdir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` images of the workload's data set (spread evenly over it) and their labels:
    uint8 (N, H, W, 3) from fasttrain's and timm's image workloads, floating point from a model
    of your own; decoded once and kept in ``workdir`` for the other rungs."""
    path = workdir / EVAL_FILE
    if path.exists():
        saved = torch.load(path, weights_only=True)
        return saved["images"], saved["labels"]
    data = wl.dataset()
    if len(data) == 0:
        raise FasttrainError(f"{wl.name}: its data set has no images to evaluate on")
    # evenly spread over the set: a class-sorted folder gives every class its share
    picks = np.unique(np.linspace(0, len(data) - 1, min(count, len(data))).round().astype(int))
    items = [data[int(i)] for i in picks]
    images = torch.stack([it["images"] for it in items])
    labels = torch.stack([it["labels"] for it in items])
    if not (images.is_floating_point() or images.dtype == torch.uint8):
        raise FasttrainError(f"{wl.name}: its images are {tuple(images.shape)} "
                             f"{images.dtype}, neither uint8 nor floating point")
    _save(path, {"images": images, "labels": labels})
    return images, labels


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_logits(fwd: Forward, images: torch.Tensor, batch: int,
               device: torch.device) -> torch.Tensor:
    """fp32 logits of every image, ``batch`` at a time; the last chunk is padded to ``batch``
    (one shape, so a compiled or captured forward is not rebuilt) and cropped."""
    out = []
    for i in range(0, len(images), batch):
        chunk = images[i:i + batch]
        n = len(chunk)
        if n < batch:
            chunk = torch.cat([chunk, chunk[:1].expand(batch - n, *chunk.shape[1:])])
        try:
            logits = fwd(chunk.to(device, non_blocking=True))
        except TypeError as err:  # a forward that takes other arguments than one batch
            raise FasttrainError(f"the model's forward does not take one batch of images "
                                 f"({first_line(err)}): fasttrain infer serves models whose forward maps "
                                 "a batch of images to logits") from None
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or len(logits) != batch:
            got = (tuple(logits.shape) if isinstance(logits, torch.Tensor)
                   else type(logits).__name__)
            raise FasttrainError(f"the model's forward gave {got} for {batch} images, not "
                                 "logits (batch, classes): fasttrain infer serves models whose "
                                 "forward maps a batch of images to logits")
        out.append(logits[:n].float().cpu())
    return torch.cat(out)


def latency_ms(fwd: Forward, x: torch.Tensor, iters: int, warmup: int,
               device: torch.device) -> dict:
    """p50/p90 of single calls from an idle device, host clock, in ms."""
    for _ in range(warmup):
        fwd(x)
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fwd(x)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
    return {"p50": statistics.median(times), "p90": q[8], "batch": int(x.shape[0])}


def throughput(fwd: Forward, x: torch.Tensor, iters: int, warmup: int,
               device: torch.device) -> dict:
    """Back-to-back calls: images/s over the whole, the median call (ms) and the peak memory
    of the timed window (GiB, CUDA)."""
    for _ in range(warmup):
        fwd(x)
    _sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    calls = []
    t0 = time.perf_counter()
    for i in range(iters):
        if cuda:
            ev[i][0].record()
            fwd(x)
            ev[i][1].record()
        else:
            c0 = time.perf_counter()
            fwd(x)
            calls.append(time.perf_counter() - c0)
    _sync(device)
    total = time.perf_counter() - t0
    if cuda:
        calls = [a.elapsed_time(b) / 1e3 for a, b in ev]
    out = {"throughput": x.shape[0] * iters / total, "step_time_s": statistics.median(calls),
           "step_time_min_s": min(calls), "step_time_max_s": max(calls)}
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out


def accuracy(logits: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor | None,
             top1_ref: float | None) -> dict:
    """Agreement with the fp32 logits, the logit deviation, top-1 where labels mean something;
    ``passed``: agreement ≥ the gate and nothing non-finite."""
    if logits.shape != reference.shape:
        raise FasttrainError(f"logits {tuple(logits.shape)} do not match the fp32 reference's "
                             f"{tuple(reference.shape)}")
    finite = bool(torch.isfinite(logits).all())
    dev = (logits - reference).abs()
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    top1 = None if labels is None else (logits.argmax(-1) == labels).float().mean().item()
    return {"agreement": agree, "max_logit_dev": dev.max().item(),
            "mean_logit_dev": dev.mean().item(), "top1": top1, "top1_ref": top1_ref,
            "images": int(len(logits)), "gate": GATE, "passed": finite and agree >= GATE,
            **({} if finite else {"reason": "non-finite logits"})}


def count_flops(fwd: Forward, x: torch.Tensor) -> int:
    """FLOPs of one forward at ``x``'s batch (FlopCounterMode over the eager model)."""
    from ..measure.flops import flop_counter

    counter = flop_counter()
    with counter:
        fwd(x)
    return int(counter.get_total_flops())


def save_reference(workdir: Path, logits: torch.Tensor, flops: int | None,
                   top1: float | None) -> None:
    _save(workdir / REFERENCE_FILE, {"logits": logits, "flops": flops, "top1": top1})


def load_reference(workdir: Path) -> dict:
    path = workdir / REFERENCE_FILE
    if not path.exists():
        raise FasttrainError("no fp32 reference logits: the eager-fp32 rung did not finish")
    return torch.load(path, weights_only=True)
