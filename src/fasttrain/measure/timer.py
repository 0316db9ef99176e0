"""Phase timing without per-op synchronisation.

On CUDA each phase boundary records an event on the current stream; nothing waits until the
timed window ends, then every interval is read at once. On CPU the work is synchronous and the
host clock is exact.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch


def timestamp(cuda: bool):
    """A CUDA event recorded on the current stream (read later, no sync), or the host clock."""
    if cuda:
        evt = torch.cuda.Event(enable_timing=True)
        evt.record()
        return evt
    return time.perf_counter()


def elapsed(a, b, cuda: bool) -> float:
    """Seconds between two ``timestamp``s (CUDA events must be complete)."""
    return a.elapsed_time(b) / 1e3 if cuda else b - a


class PhaseTimer:
    """``mark(phase)`` closes the running phase and opens ``phase``; ``step()`` starts a step."""

    def __init__(self, device: torch.device, labels: bool = False):
        self.cuda = device.type == "cuda"
        self.labels = labels  # record_function("phase:…") ranges for profiler traces
        self.steps: list[list[tuple[str, object, object]]] = []
        self._open: tuple[str, object] | None = None
        self._label = None

    def _now(self):
        return timestamp(self.cuda)

    def step(self) -> None:
        """Start a new step (closes the last phase of the previous one at this point)."""
        now = self._now()
        self._close(now)
        self.steps.append([])
        self._open = ("other", now)
        self._relabel("other")

    def mark(self, phase: str) -> None:
        now = self._now()
        self._close(now)
        self._open = (phase, now)
        self._relabel(phase)

    def pause(self) -> None:
        """Close the running phase and open none until the next ``step()``: what runs between
        (a checkpoint save) is no part of any step's time."""
        self._close(self._now())

    def _relabel(self, phase: str) -> None:
        if not self.labels:
            return
        if self._label is not None:
            self._label.__exit__(None, None, None)
        self._label = torch.profiler.record_function(f"phase:{phase}")
        self._label.__enter__()

    def _close(self, now) -> None:
        if self._open is not None and self.steps:
            name, start = self._open
            self.steps[-1].append((name, start, now))
        self._open = None

    def finish(self) -> None:
        self._close(self._now())
        if self._label is not None:
            self._label.__exit__(None, None, None)
            self._label = None

    def _elapsed(self, a, b) -> float:
        return elapsed(a, b, self.cuda)

    def results(self, skip: int) -> tuple[list[float], dict[str, list[float]]]:
        """Per-step seconds and per-phase seconds per step, for steps after ``skip``."""
        if self.cuda:
            torch.cuda.synchronize()
        totals: list[float] = []
        phases: dict[str, list[float]] = defaultdict(list)
        for spans in self.steps[skip:]:
            if not spans:
                continue
            per: dict[str, float] = defaultdict(float)
            for name, a, b in spans:
                per[name] += self._elapsed(a, b)
            totals.append(self._elapsed(spans[0][1], spans[-1][2]))
            for name, value in per.items():
                phases[name].append(value)
        return totals, dict(phases)
