"""What an item is and how many a step has: the divisor of the summed loss and the numerator of
throughput (``Workload.count``, the loop's ``ItemCounter``), checked on the CPU against plain
PyTorch (``F.cross_entropy(..., ignore_index=-100)``) and against the run's own step times."""
from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from fasttrain import Recipe, SimpleWorkload, load_workload, train

VOCAB, SEQ = 16, 8


class _LM(nn.Module):
    """Token ids (B, T) → logits (B, T, V)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x):
        return self.head(self.emb(x))


class _Tokens(Dataset):
    """Item i ignores its first (3 i) mod 7 labels: batches hold different token counts."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randint(0, VOCAB, (SEQ,), generator=g)
        y = torch.randint(0, VOCAB, (SEQ,), generator=g)
        y[: (3 * i) % 7] = -100
        return {"x": x, "y": y}


class _Recorder:
    """A summed token loss that also records, per call (the probe, then one call per step on
    the CPU), the batch, its non-ignored token count and the plain-PyTorch mean loss."""

    def __init__(self, sleeps=()):
        self.calls: list[dict] = []
        self.sleeps = list(sleeps)

    def __call__(self, model, batch):
        i = len(self.calls)
        if i < len(self.sleeps):
            time.sleep(self.sleeps[i])
        logits = model(batch["x"]).flatten(0, 1)  # (B T, V)
        labels = batch["y"].flatten()
        self.calls.append({
            "batch": {k: v.clone() for k, v in batch.items()},
            "count": int((labels != -100).sum()),
            "mean": float(F.cross_entropy(logits.detach(), labels, ignore_index=-100)),
        })
        return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def _token_workload(loss_fn) -> SimpleWorkload:
    return SimpleWorkload(name="tokens", build=_LM, data=_Tokens, loss_fn=loss_fn, unit="token",
                          count_field="y", ignore_index=-100, default_batch=4)


# 1: a token workload reports tokens per second
def test_token_unit_reports_tokens_per_second():
    wl = load_workload("examples.gpt:make_workload")
    res = train(wl, Recipe(), steps=4, warmup=1, device="cpu")
    batch = wl.collate([wl.dataset()[i] for i in range(res.batch)])
    assert not (batch["y"] == -100).any()  # this data ignores no label: batch x seq tokens
    tokens = batch["y"].shape[0] * batch["y"].shape[1]
    assert res.throughput_unit == "tok/s"
    assert res.throughput == pytest.approx(tokens / res.step_time_s, rel=0.01)
    assert res.throughput > 10 * res.batch / res.step_time_s  # not sequences per second


# 2: the summed token loss over the non-ignored tokens
def test_token_loss_is_mean_over_non_ignored_tokens():
    rec = _Recorder()
    res = train(_token_workload(rec), Recipe(), steps=2, warmup=0, device="cpu")
    first = rec.calls[1]  # calls[0] is the probe step
    assert first["count"] < first["batch"]["y"].numel()  # some labels are ignored
    assert res.losses[0] == pytest.approx(first["mean"], rel=1e-5)
    # the same number from scratch: the model fasttrain builds (seeded, on the device) and
    # F.cross_entropy's own ignore_index mean on the first step's batch
    torch.manual_seed(Recipe().seed)
    with torch.device("cpu"):
        model = _LM()
    with torch.no_grad():
        ref = F.cross_entropy(model(first["batch"]["x"]).flatten(0, 1),
                              first["batch"]["y"].flatten(), ignore_index=-100)
    assert res.losses[0] == pytest.approx(float(ref), rel=1e-5)


def test_token_counts_that_vary_per_batch():
    rec = _Recorder()
    res = train(_token_workload(rec), Recipe(), steps=6, warmup=1, device="cpu")
    steps = rec.calls[1:]
    assert len(steps) == len(res.losses) == 7
    assert len({c["count"] for c in steps}) > 1  # the divisor changed between steps
    for loss, call in zip(res.losses, steps):
        assert loss == pytest.approx(call["mean"], rel=1e-5)
    timed = [c["count"] for c in steps[1:]]
    assert res.throughput == pytest.approx(statistics.mean(timed) / res.step_time_s, rel=1e-6)


def test_count_of_a_batch():
    x, y = torch.zeros(3, 5), torch.tensor([[1, -100, 2], [-100, -100, 0]])
    batch = {"x": x, "y": y}
    assert SimpleWorkload(unit="sample").count(batch) == 3  # rows of the first field
    assert SimpleWorkload(unit="img", count_field="y").count(batch) == 2
    assert SimpleWorkload(unit="token", count_field="y").count(batch) == 6  # every element
    n = SimpleWorkload(unit="token", count_field="y", ignore_index=-100).count(batch)
    assert isinstance(n, torch.Tensor) and n.dim() == 0 and int(n) == 3


# 3: throughput is the items of a step over the median step time (the ms/step statistic)
def _sleepy_samples(sleeps) -> SimpleWorkload:
    calls = []

    def loss(model, batch):
        if len(calls) < len(sleeps):
            time.sleep(sleeps[len(calls)])
        calls.append(1)
        return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")

    data = [{"x": torch.randn(4), "y": torch.tensor(i % 3)} for i in range(16)]
    return SimpleWorkload(build=lambda: nn.Linear(4, 3), data=data, loss_fn=loss, default_batch=4)


# calls: the probe, one warm-up step, then 5 timed steps of which two are slow
SLEEPS = [0.0, 0.0, 0.002, 0.08, 0.002, 0.002, 0.12]


def test_throughput_uses_the_median_step_time():
    res = train(_sleepy_samples(SLEEPS), Recipe(), steps=5, warmup=1, device="cpu")
    times = res.step_times_s
    # the steps really vary (a difference: a loaded machine's per-step overhead adds to both)
    assert statistics.mean(times) - statistics.median(times) > 0.02
    assert res.step_time_s == pytest.approx(statistics.median(times))
    assert res.throughput_unit == "sample/s"
    assert res.throughput * res.step_time_s == pytest.approx(res.batch, rel=1e-9)


def test_throughput_of_varying_token_counts_uses_the_median_step_time():
    rec = _Recorder(sleeps=SLEEPS)
    res = train(_token_workload(rec), Recipe(), steps=5, warmup=1, device="cpu")
    times = res.step_times_s
    assert statistics.mean(times) - statistics.median(times) > 0.02
    timed = [c["count"] for c in rec.calls[2:]]
    assert res.throughput_unit == "tok/s"
    assert res.throughput * res.step_time_s == pytest.approx(statistics.mean(timed), rel=1e-6)
