"""A rank whose host is blocked inside a step, behind a collective that another rank never
joined: the rank that never joined is named before NCCL's own timeout ends the job unnamed.

On CUDA the host issues a step's collectives and runs ahead; :func:`env.step_barrier` meets
the ranks at the next step boundary and names the one that does not come. But some steps block
the host inside the step on a value the GPU computes after the collective: fp16's GradScaler
reads its overflow flag (``.item()``), a loss printed every step does too. Behind a collective
that a hung rank never joined, that read never returns, no step boundary is reached, and NCCL's
watchdog kills the process at ``dist_timeout`` + 33 s without naming anyone.

:class:`StepWatchdog` is a thread on each rank. Once its rank has been inside one step for
:data:`STALLED_AFTER_S` past ``dist_timeout`` (after :func:`env.watched`, which names hung
ranks on the CPU, has had its turn), it posts in the job's store, every :data:`POLL_S`, how many
collectives its rank has launched in that step's key (the process group's sequence number,
counted on the host when a collective is launched). A rank names the ranks below it only where
all of this holds:
- its own count has not moved for ``dist_timeout``: it has waited as long as a collective may;
- it is the lowest-numbered rank at the highest count: one line, not one a rank;
- the counts below it did not move over :data:`env.GRACE_S`: those ranks are not merely late
  in launching (NCCL's hosts run apart by a few collectives at any moment);
- the step has not ended meanwhile.
Then it writes the line and ends the process (its main thread is blocked and cannot raise). A
rank that never posts (its interpreter stopped) is not named; NCCL's timeout remains for it.
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
_PROGRESS = "fasttrain/progress/"  # store key prefix: step/rank → collectives launched
EXIT_HUNG = 1  # the run failed, not the command (as RunFailed)


def issued() -> int:
    """Collectives this rank has launched on the default process group (0 where not known)."""
    try:
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - a backend without a sequence number: nothing to compare
        return 0


def verdict(me: int, first: dict[int, int], then: dict[int, int]) -> list[int]:
    """The ranks ``me`` should name, from two reads of the posted counts ``GRACE_S`` apart:
    those below the highest count in both reads with the same count, where ``me`` is the
    lowest-numbered rank at the highest count; else none."""
    if me not in then:
        return []
    top = max(then.values())
    if then[me] != top or min(r for r, n in then.items() if n == top) != me:
        return []
    return sorted(r for r, n in then.items() if n < top and first.get(r) == n)


class StepWatchdog:
    """``with StepWatchdog(timeout_s) as dog:`` around the loop, ``dog.at_step(step)`` at each
    step boundary. ``exit`` ends the process once the line is written (``os._exit``: the main
    thread is blocked); tests pass their own."""

    def __init__(self, timeout_s: float, exit=os._exit) -> None:
        self.timeout_s, self._exit = timeout_s, exit
        self._at = (0, time.monotonic())  # (step, when it began): one value, read at once
        self._count, self._count_since = issued(), time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fasttrain-step-watchdog",
                                        daemon=True)

    def __enter__(self) -> "StepWatchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=GRACE_S + 2 * POLL_S)

    def at_step(self, step: int) -> None:
        self._at = (step, time.monotonic())

    def _still(self) -> float:
        """Seconds this rank's count of launched collectives has not moved."""
        n = issued()
        if n != self._count:
            self._count, self._count_since = n, time.monotonic()
        return time.monotonic() - self._count_since

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            still = self._still()
            step, began = self._at
            if time.monotonic() - began < self.timeout_s + STALLED_AFTER_S:
                continue
            line = self.look(step, still)
            if line and not self._stop.is_set() and self._at[0] == step and \
                    self._still() >= still:  # the step goes on, nothing launched meanwhile
                sys.stderr.write(f"fasttrain: error: {line}\n")
                sys.stderr.flush()
                self._exit(EXIT_HUNG)

    def look(self, step: int, still: float) -> str | None:
        """Post this rank's count for ``step``; read everyone's twice, ``GRACE_S`` apart; the
        line naming the ranks behind (see :func:`verdict`), or None."""
        rank, world = dist.get_rank(), dist.get_world_size()
        key = f"{_PROGRESS}{step}/"
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{key}{rank}", str(self._count))
            first = _read(store, key, world)
            time.sleep(GRACE_S)
            store.set(f"{key}{rank}", str(self._count))
            then = _read(store, key, world)
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
            return None
        if still < self.timeout_s:  # this rank has not waited as long as a collective may
            return None
        late = verdict(rank, first, then)
        if not late:
            return None
        top = max(then.values())
        return _hung_line(late, sorted(r for r, n in then.items() if n == top),
                          f"step {step}", self.timeout_s, "ranks", "the collectives of ")


def _read(store, key: str, world: int) -> dict[int, int]:
    """The counts posted under ``key`` (ranks that posted nothing are left out)."""
    return {r: int(store.get(f"{key}{r}")) for r in range(world) if store.check([f"{key}{r}"])}
