"""A rank whose host is blocked inside a step, behind a collective that another rank never
joined: the rank that never joined is named before NCCL's own timeout ends the job unnamed.

On CUDA the host issues a step's collectives and runs ahead; :func:`env.step_barrier` meets
the ranks at the next step boundary and names the one that does not come. But some steps block
the host inside the step on a value the GPU computes after the collective: fp16's GradScaler
reads its overflow flag (``.item()``), a loss printed every step does too. Behind a collective
that a hung rank never joined, that read never returns, no step boundary is reached, and NCCL's
watchdog kills the process at ``dist_timeout`` + 33 s without naming anyone.

:class:`StepWatchdog` is a thread on each rank. When its rank has been inside one step for
:data:`STALLED_AFTER_S` past ``dist_timeout`` (after :func:`env.watched`, which names hung
ranks on the CPU, has had its turn), it posts in the job's store where its rank is: the step,
and how many collectives the rank has issued (the process group's sequence number, counted on
the host when a collective is launched). The ranks that posted fewer are the ones that never
joined; a rank that has issued the most names them in one line and ends the process (its main
thread is blocked and cannot). A rank that is itself behind says nothing; where no rank is
behind (every rank inside a long step: a first compile), nobody does, and the run goes on.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch.distributed as dist

from .env import GRACE_S, _hung_line

STALLED_AFTER_S = 2 * GRACE_S + 1.0
"""Seconds past ``dist_timeout`` a step must last before the watchdog looks: past the window in
which :func:`env.watched` names hung ranks (a CPU collective's timeout, then ``GRACE_S``), and
well before NCCL's own timeout (``GRACE_S`` + 30 s past it)."""
POLL_S = 0.5
_PROGRESS = "fasttrain/progress/"  # store key prefix: where each rank is, posted when stalled
EXIT_HUNG = 1  # the run failed, not the command (as RunFailed)


def issued() -> int:
    """Collectives this rank has launched on the default process group (0 where not known)."""
    try:
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - a backend without a sequence number: nothing to compare
        return 0


class StepWatchdog:
    """``with StepWatchdog(timeout_s) as dog:`` around the loop, ``dog.at_step(step)`` at each
    step boundary. ``exit`` ends the process once the line is written (``os._exit``: the main
    thread is blocked); tests pass their own."""

    def __init__(self, timeout_s: float, exit=os._exit) -> None:
        self.timeout_s, self._exit = timeout_s, exit
        self.step, self.since, self._looked = 0, time.monotonic(), -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fasttrain-step-watchdog",
                                        daemon=True)

    def __enter__(self) -> "StepWatchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def at_step(self, step: int) -> None:
        self.step, self.since = step, time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            step = self.step
            if step == self._looked or time.monotonic() - self.since < (
                    self.timeout_s + STALLED_AFTER_S):
                continue
            self._looked = step  # one look a step: a long step where nobody is behind goes on
            line = self.behind(step)
            if line and not self._stop.is_set():
                sys.stderr.write(f"fasttrain: error: {line}\n")
                sys.stderr.flush()
                self._exit(EXIT_HUNG)

    def behind(self, step: int) -> str | None:
        """Post this rank's progress, read the others' for ``GRACE_S``; the line naming the
        ranks behind, where this rank is among the furthest, else None."""
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{_PROGRESS}{rank}", f"{step} {issued()} {time.time()}")
            seen: dict[int, tuple[int, int]] = {}
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and len(seen) < world:
                for r in set(range(world)) - set(seen):
                    if store.check([f"{_PROGRESS}{r}"]):
                        s, n, t = store.get(f"{_PROGRESS}{r}").decode().split()
                        if abs(time.time() - float(t)) < 2 * GRACE_S + POLL_S:  # not stale
                            seen[r] = (int(s), int(n))
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
            return None
        top = max(seen.values(), default=None)
        late = sorted(r for r, p in seen.items() if p < top) if top else []
        if not late or seen.get(rank) != top:
            return None
        return _hung_line(late, sorted(r for r, p in seen.items() if p == top),
                          f"step {step}", self.timeout_s, "ranks", "the collectives of ")
