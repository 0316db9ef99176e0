"""Saves during a run: every N steps, and on SIGTERM/SIGINT after the step under way.

A save is collective (every rank writes its shards), so every rank must decide to save at the
same step boundary. The periodic schedule is the same on every rank; a signal may reach the
ranks at different moments, so under several processes the ranks agree on it at each step
boundary (one gloo all-reduce of one number on the host: no GPU sync). A second signal of the
same kind acts as it would without fasttrain (SIGINT raises KeyboardInterrupt, SIGTERM kills):
a save is never half-published, so stopping hard is safe too. Under torchrun (``--nproc``) the
launcher forwards SIGTERM/SIGINT to torchrun, which passes them to every rank.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..distributed import env as dist_env
from ..techniques.base import TrainState
from . import checkpoint

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """The run stopped on a signal after saving; the CLI exits with ``exit_code`` (128 + the
    signal: 130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, step: int, folder: Path):
        self.signum, self.step, self.folder = signum, step, folder
        super().__init__(f"fasttrain: {signal.Signals(signum).name}: stopped after step {step}, "
                         f"saved {folder} (continue with --resume {folder.parent})")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@dataclass
class Saver:
    """Where and how often a run saves (``train(save_to=…, save_every=…, keep=…)``)."""

    folder: str
    every: int = 0
    """Save every ``every`` steps (counted from the run's first step, resumed ones included);
    0: only at the end."""
    keep: int = 2
    """Complete step folders kept; older ones are removed after each new one is published."""
    last: int | None = None  # the step of the last save
    _signal: int = 0
    _previous: dict = field(default_factory=dict)

    @contextlib.contextmanager
    def signals(self):
        """SIGINT/SIGTERM set a flag that the next step boundary acts on (main thread only:
        Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, handler in self._previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum
        # a second one acts at once; not under torchrun, where a Ctrl-C comes twice (the
        # terminal's copy and torchrun's): there torchrun kills the ranks after its timeout
        if not dist_env.launched():
            signal.signal(signum, self._previous[signum])

    def after_step(self, state: TrainState, step: int, pause: Callable[[], None]) -> None:
        """At the boundary after global step ``step``: save when due or asked to; raise
        :class:`Stopped` after a save a signal asked for. ``pause``: stop the step clock (the
        save is not part of any step's time)."""
        signum = self._signal
        if dist_env.current().world > 1:  # one decision for every rank
            signum = int(dist_env.max_float(float(signum)))
        if not signum and not (self.every and step % self.every == 0):
            return
        pause()
        folder = self.save(state, step)
        if signum:
            raise Stopped(signum, step, folder)

    def save(self, state: TrainState, step: int) -> Path:
        folder = checkpoint.save(state, self.folder, step, self.keep)
        self.last = step
        return folder

    def finish(self, state: TrainState, step: int) -> None:
        """The end-of-run save, unless the last periodic one was at this step."""
        if self.last != step:
            self.save(state, step)
