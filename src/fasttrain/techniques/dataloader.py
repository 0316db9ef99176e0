"""Data loading: worker processes, pinned host memory, asynchronous copies, prefetch.

When it helps: whenever decoding and augmenting a batch on one CPU core takes longer than a GPU
step (the source: 1.41× cumulative on SD). Numerics: none — batches are identical whatever the
worker count, because augmentation randomness is keyed on (seed, epoch, index).
"""
from __future__ import annotations

import os

from .base import Phase, Technique, TrainState


def _cpus() -> int:
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count()) or 2


def default_workers() -> int:
    """Enough loader processes to feed a GPU without starving the training process."""
    return max(1, min(12, _cpus() - 2))



def apply(state: TrainState) -> str:
    r = state.recipe
    workers, cpus = r.workers, _cpus()
    if workers > cpus:  # more loader processes than CPUs only fight the training process
        workers = cpus
        state.warn("dataloader", f"workers={r.workers} on a machine of {workers} CPUs; using "
                   f"{workers}")
    kw = {"num_workers": workers, "pin_memory": r.pin_memory and state.cuda}
    if workers > 0:
        kw.update(prefetch_factor=r.prefetch_factor, persistent_workers=True)
    if r.pin_memory and not state.cuda:
        state.warn("dataloader", "pin_memory needs CUDA; ignored")
    state.non_blocking = r.non_blocking and state.cuda
    if r.non_blocking and not kw["pin_memory"] and state.cuda:
        state.warn("dataloader", "non_blocking without pin_memory copies synchronously")
    state.loader_kwargs = kw
    # Under CUDA graphs the prefetch copies into two preallocated slots (run/data.py's
    # SlotPrefetcher): fresh batches whose blocks carry record_stream uses make the allocator
    # query events during capture, which invalidates it (seen on the H200: "operation failed
    # due to a previous error during capture").
    state.device_prefetch = r.device_prefetch and state.cuda
    if r.device_prefetch and not state.cuda:
        state.warn("dataloader", "device_prefetch needs CUDA; ignored")
    if not workers and not state.cuda and (r.pin_memory or r.non_blocking or r.device_prefetch):
        state.idle("dataloader", "no workers; pin_memory, non_blocking and device_prefetch act "
                   "on CUDA copies only: nothing changed")
    parts = [f"{workers} workers" if workers else "loading in the main process"]
    if kw["pin_memory"]:
        parts.append("pinned memory")
    if state.non_blocking:
        parts.append("non_blocking copies")
    if workers:
        parts.append(f"prefetch {r.prefetch_factor}")
    if state.device_prefetch:
        parts.append("next batch copied on a side stream" + (
            " into two device buffers used in turn" if r.cuda_graphs else ""))
    return ", ".join(parts)


TECHNIQUE = Technique(
    name="dataloader", phase=Phase.DATALOADER, summary="DataLoader workers, pin_memory, non_blocking",
    changes_numerics=False, apply=apply,
    example={"workers": 1})
