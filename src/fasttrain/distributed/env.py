"""Who we are in a torchrun job, the process group, and collectives that cannot hang silently.

Every rank makes the same decisions: rank 0's recipe is broadcast and compared, never branched
on per rank. A control group on gloo runs monitored barriers, which name the ranks that did not
arrive within the timeout — a dead or hung rank fails the run in bounded time, by name.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import FasttrainError


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


def launched() -> bool:
    """Started by torchrun (or another launcher that sets WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


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
        timeout = datetime.timedelta(seconds=timeout_s)
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
