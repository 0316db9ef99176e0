"""Who we are in a torchrun job, the process group, and collectives that cannot hang silently.

Every rank makes the same decisions: rank 0's recipe is broadcast and compared, never branched
on per rank. A control group on gloo runs monitored barriers, which name the ranks that did not
arrive within the timeout — a dead or hung rank fails the run in bounded time, by name.

Inside the training loop a hung rank is named two ways. On the CPU (gloo) every collective
blocks the host, so the ranks that waited see a timeout error: :func:`watched` has each of them
post that in the job's store, and the ranks that posted nothing within :data:`GRACE_S` are the
ones that never arrived. On CUDA the host runs ahead of NCCL's collectives and blocks nowhere,
so :func:`step_barrier` meets the ranks at every step boundary on the control group (host only,
no GPU sync), whose monitored barrier names the missing rank; NCCL's own timeout is set
:data:`GRACE_S` + 30 s later, so this one line comes first. Where the host blocks inside a step
behind the hung collective, no step boundary comes: ``watchdog.StepWatchdog`` names the rank.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import FasttrainError, RunFailed
from .launch import launched  # noqa: F401 - the library asks env


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


_CONTROL = None  # gloo group for monitored barriers (NCCL has none)
GRACE_S = 3.0
"""Seconds a rank that timed out in a collective waits for the others to say so too."""
_STALLED = "fasttrain/stalled/"  # store key prefix: the ranks that timed out waiting


def current() -> Dist:
    if dist.is_available() and dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    return Dist()


def init(device_type: str, timeout_s: float) -> Dist:
    """Join the job's process group (NCCL on CUDA, gloo on CPU) with a bounded timeout."""
    global _CONTROL
    if not launched():
        return Dist()
    if not dist.is_initialized():
        # NCCL's watchdog kills the process without naming anyone: give step_barrier the lead
        extra = GRACE_S + 30.0 if device_type == "cuda" else 0.0
        timeout = datetime.timedelta(seconds=timeout_s + extra)
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend, timeout=timeout)
    if _CONTROL is None:  # also when the caller initialised the process group itself
        _CONTROL = dist.new_group(backend="gloo",
                                  timeout=datetime.timedelta(seconds=timeout_s))
    return current()


def barrier(where: str, timeout_s: float) -> None:
    """All ranks meet here, or a one-line error names the ranks that did not."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.monitored_barrier(group=_CONTROL, timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    except RuntimeError as err:
        msg = str(err).splitlines()[0]
        raise FasttrainError(f"rank {dist.get_rank()}: {where}: {msg[:300]}") from None


def step_barrier(step: int, timeout_s: float, device_type: str) -> None:
    """CUDA only: all ranks reach step ``step``'s boundary, or the monitored barrier names the
    ranks that did not (on the CPU, :func:`watched` names them)."""
    if not (device_type == "cuda" and current().active):
        return
    try:
        barrier(f"step {step}", timeout_s)
    except FasttrainError as err:  # the run failed, not the command: exit 1, the ranks named
        late = re.search(r"Ranks? ([\d, ]+) failed to pass", str(err))
        if not late:
            raise RunFailed(str(err)) from None
        hung = [int(r) for r in late.group(1).replace(",", " ").split()]
        raise RunFailed(_hung_line(hung, [dist.get_rank()], f"step {step}", timeout_s,
                                   "rank", "")) from None


def _timed_out(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


@contextlib.contextmanager
def watched(where: str, timeout_s: float):
    """Collectives inside (a training step's): a collective that times out becomes one line
    naming the ranks that never arrived (those that did not time out waiting too)."""
    try:
        yield
    except RuntimeError as err:
        if not (current().active and _timed_out(err)):
            raise
        raise RunFailed(_stalled(where, timeout_s, err)) from None


def _stalled(where: str, timeout_s: float, err: BaseException) -> str:
    """Post that this rank timed out waiting; gather who else did within GRACE_S; the line."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_STALLED}{rank}", where)
        waited: set[int] = set()
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and len(waited) < world:
            waited = {r for r in range(world) if store.check([f"{_STALLED}{r}"])}
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store is gone too: say what this rank saw
        return f"rank {rank}: {where}: {first}"
    hung = sorted(set(range(world)) - waited)
    if not hung:
        return f"rank {rank}: {where}: {first}"
    return _hung_line(hung, sorted(waited), where, timeout_s, "ranks", "the collectives of ")


def _hung_line(hung: list[int], waited: list[int], where: str, timeout_s: float,
               waited_word: str, what: str) -> str:
    """The one line of a hung rank: who, where, who waited, and the way out."""
    names = ("rank " if len(hung) == 1 else "ranks ") + ", ".join(map(str, hung))
    return (f"{names} hung: never reached {what}{where} within dist_timeout={timeout_s:g} s "
            f"({waited_word} {', '.join(map(str, waited))} waited); look at what rank "
            f"{hung[0]} was doing, or raise --set dist_timeout if it is only slow")


def agree(name: str, value) -> None:
    """Rank 0's value is the decision; any rank holding another fails by name."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=_CONTROL)
    if box[0] != value:
        raise FasttrainError(f"rank {dist.get_rank()}: {name} differs from rank 0's")


def sum_tensor(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def max_float(x: float | None) -> float | None:
    if x is None or not (dist.is_available() and dist.is_initialized()):
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_CONTROL)
    return float(t.item())


def shutdown() -> None:
    global _CONTROL
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL = None
