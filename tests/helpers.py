"""Workloads for tests that must misbehave, and checks that the CPU and GPU tests share."""
import torch

from fasttrain import SimpleWorkload


def broken_workload(size="tiny", seed=0, data=None):
    def boom(model, batch):
        raise RuntimeError("boom")

    return SimpleWorkload(name="broken", build=lambda: torch.nn.Linear(2, 2),
                          data=lambda: [{"x": torch.zeros(2)} for _ in range(8)],
                          loss_fn=boom, default_batch=2)


class _SlowData(torch.utils.data.Dataset):
    """Items that take 15 ms each to load: a data-bound workload."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        import time

        time.sleep(0.015)
        return {"x": torch.full((16,), float(i % 7)), "y": torch.tensor(i % 3)}


def slow_data_workload(size="tiny", seed=0, data=None):
    import torch.nn.functional as F

    return SimpleWorkload(name="slow-data", build=lambda: torch.nn.Linear(16, 3), data=_SlowData,
                          loss_fn=lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="sum"),
                          default_batch=4)


_KEPT: list = []


def leaky_workload(size="tiny", seed=0, data=None):
    """Keeps every step's activations alive (a classic leak: storing the loss with its graph)."""
    import torch.nn.functional as F

    def loss(m, b):
        out = F.cross_entropy(m(b["x"]), b["y"], reduction="sum")
        _KEPT.append(torch.empty(4 * 1024 * 1024, device=b["x"].device))  # 16 MiB a step
        return out

    return SimpleWorkload(name="leaky", build=lambda: torch.nn.Linear(16, 3), data=_SlowData,
                          loss_fn=loss, default_batch=4)


def hang_on_rank1(size="tiny", seed=0, data=None):
    """Rank 1 never finishes building its model: a hung rank."""
    import os
    import time

    def build():
        if os.environ.get("RANK") == "1":
            time.sleep(3600)
        return torch.nn.Linear(16, 3)

    import torch.nn.functional as F
    return SimpleWorkload(name="hang", build=build, data=_SlowData,
                          loss_fn=lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="sum"),
                          default_batch=4)


def hang_in_step3_on_rank1(size="tiny", seed=0, data=None):
    """Rank 1 stops inside the third step's forward (the others wait in its gradient
    all-reduce): a rank hung in the middle of training."""
    import os
    import time

    import torch.nn.functional as F
    calls = [0]

    def loss(m, b):
        calls[0] += 1
        if calls[0] >= 3 and os.environ.get("RANK") == "1":
            time.sleep(3600)
        return F.cross_entropy(m(b["x"]), b["y"], reduction="sum")

    return SimpleWorkload(name="hang-step", build=lambda: torch.nn.Linear(16, 3), data=_SlowData,
                          loss_fn=loss, default_batch=4)


def hang_with_the_host_blocked_on_rank0(size="tiny", seed=0, data=None):
    """Rank 1 stops inside the third step's forward. Rank 0 launches a collective there that
    rank 1 never joins, then blocks its host outside any collective, as fp16's overflow read
    blocks behind an NCCL all-reduce on a GPU: no collective of rank 0's times out on the host,
    and no step boundary comes."""
    import os
    import time

    import torch.distributed as dist
    import torch.nn.functional as F
    calls = [0]

    def loss(m, b):
        calls[0] += 1
        if calls[0] >= 3:
            if os.environ.get("RANK") == "0":
                dist.all_reduce(torch.zeros(1), async_op=True)
            time.sleep(3600)
        return F.cross_entropy(m(b["x"]), b["y"], reduction="sum")

    return SimpleWorkload(name="hang-host", build=lambda: torch.nn.Linear(16, 3), data=_SlowData,
                          loss_fn=loss, default_batch=4)


def check_exact_gelu(bias_gelu, device: str, points: int) -> None:
    """``bias_gelu``'s exact GELU and its gradient against PyTorch's in float64, fp32 inputs on
    ``points`` points of z in [-9, 9]: within 2e-6 and 5e-7 (a few ulp of erf)."""
    z = torch.linspace(-9.0, 9.0, points, device=device).reshape(1, -1).requires_grad_()
    y = bias_gelu(z, None, "none")
    y.backward(torch.ones_like(y))
    z2 = z.detach().double().requires_grad_()
    ref = torch.nn.functional.gelu(z2)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(y.double(), ref.detach(), rtol=0, atol=2e-6)
    torch.testing.assert_close(z.grad.double(), z2.grad, rtol=0, atol=5e-7)


def child_job_row(spec):
    """A ``run.child`` job: its row echoes what the spec carried."""
    return {"workload": spec.workload, "steps": spec.steps, "recipe": spec.recipe}


def child_job_raises(spec):
    """A ``run.child`` job that crashes."""
    raise RuntimeError("boom in the child")


def child_job_user_error(spec):
    """A ``run.child`` job that fails with a user's error."""
    from fasttrain.errors import FasttrainError

    raise FasttrainError("batch 3 is not divisible by 2 processes")


def child_job_hangs(spec):
    """A ``run.child`` job that never returns."""
    import time

    time.sleep(600)


def tiny_cnn_workload(size="tiny", seed=0, data=None):
    """A user's small CNN (no attention, no repeated blocks, a 4-class head): what most of
    fasttrain's switches find nothing to act on in."""
    import torch.nn.functional as F
    from torch import nn

    def build():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def items():
        g = torch.Generator().manual_seed(0)
        return [{"x": torch.randn(3, 8, 8, generator=g), "y": torch.tensor(i % 4)}
                for i in range(32)]

    return SimpleWorkload(name="tiny-cnn", build=build, data=items, unit="img",
                          loss_fn=lambda m, b: F.cross_entropy(m(b["x"]), b["y"],
                                                               reduction="sum"),
                          default_batch=8)


def _overflowing(stays: bool, at: int = 3):
    """A small classifier whose loss overflows fp16 at optimizer step ``at`` (1-based, warm-up
    included; and at every step after it with ``stays``). Under fp16-mixed that step's loss and
    gradients are NaN, so the GradScaler skips it; in fp32 the extra term is exactly 0 and its
    gradient too, so the fp32 losses are those of the plain classifier."""
    import torch.nn.functional as F

    calls = [0]

    def loss(m, b):
        calls[0] += 1  # call 1 is the loop's probe step: optimizer step n is call n + 1
        logits = m(b["x"])
        out = F.cross_entropy(logits, b["y"], reduction="sum")
        step = calls[0] - 1
        if step == at or (stays and step > at):
            # 0 x a loss on logits scaled past fp16's 65504: NaN in fp16, exactly 0 in fp32
            out = out + 0.0 * F.cross_entropy((logits.abs() + 1) * 1e5, b["y"], reduction="sum")
        return out

    def items():
        g = torch.Generator().manual_seed(0)
        return [{"x": torch.randn(16, generator=g), "y": torch.tensor(i % 3)} for i in range(64)]

    return SimpleWorkload(name="fp16-overflow", build=lambda: torch.nn.Linear(16, 3), data=items,
                          loss_fn=loss, default_batch=8)


def fp16_overflow_once(size="tiny", seed=0, data=None):
    """:func:`_overflowing` at step 3 only: the run recovers."""
    return _overflowing(stays=False)


def fp16_overflow_stays(size="tiny", seed=0, data=None):
    """:func:`_overflowing` from step 3 to the end: the run never recovers."""
    return _overflowing(stays=True)
