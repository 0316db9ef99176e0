"""Phase timing without per-op synchronisation.

On CUDA each phase boundary records an event on the current stream; nothing waits until the
timed window ends, then every interval is read at once. On CPU the work is synchronous and the
host clock is exact.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch


class PhaseTimer:
    """``mark(phase)`` closes the running phase and opens ``phase``; ``step()`` starts a step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.steps: list[list[tuple[str, object, object]]] = []
        self._open: tuple[str, object] | None = None

    def _now(self):
        if self.cuda:
            evt = torch.cuda.Event(enable_timing=True)
            evt.record()
            return evt
        return time.perf_counter()

    def step(self) -> None:
        """Start a new step (closes the last phase of the previous one at this point)."""
        now = self._now()
        self._close(now)
        self.steps.append([])
        self._open = ("other", now)

    def mark(self, phase: str) -> None:
        now = self._now()
        self._close(now)
        self._open = (phase, now)

    def _close(self, now) -> None:
        if self._open is not None and self.steps:
            name, start = self._open
            self.steps[-1].append((name, start, now))
        self._open = None

    def finish(self) -> None:
        self._close(self._now())

    def _elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

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
