"""fasttrain.Step on CUDA (marker ``gpu``): the whole step captured as one CUDA graph trains as
the eager step does, falls back with its reason on a batch of another shape, refuses a forward
that waits for the host in one line, and keeps a user's LR scheduler working; the loop's graphed
step follows item counts that vary (ignored labels)."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fasttrain
from fasttrain.errors import FasttrainError
from fasttrain.recipe import Recipe
from fasttrain.run.loop import train
from fasttrain.workloads.base import SimpleWorkload

EAGER = {"cuda_graphs": False, "graph_memset_kernels": False, "compile": "none"}
GRAPHED = {"cuda_graphs": True, "compile": "none"}


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10)).cuda()


def _batches(n=8, rows=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 32, generator=g).cuda(),
             torch.randint(0, 10, (rows,), generator=g).cuda()) for _ in range(n)]


def _loss(model, b):
    return F.cross_entropy(model(b[0]), b[1])


@pytest.mark.gpu
@pytest.mark.parametrize("own_optimizer", [False, True])
def test_graphed_step_trains_as_the_eager_step(own_optimizer):
    batches = _batches()
    losses = {}
    for name, switches in (("eager", EAGER), ("graphed", GRAPHED)):
        model = _model()
        if own_optimizer:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            step = fasttrain.Step(model, opt, _loss, batches[0], recipe=switches)
        else:
            step = fasttrain.Step(model, {"lr": 1e-2, **switches}, _loss, batches[0])
        losses[name] = torch.stack([step(b) for b in batches]).float().cpu()
        assert step.report()["graphed"] is (name == "graphed")
    torch.testing.assert_close(losses["graphed"], losses["eager"], rtol=2e-3, atol=0)


@pytest.mark.gpu
def test_a_batch_of_another_shape_falls_back_to_eager_and_says_why():
    batches = _batches(6)
    step = fasttrain.Step(_model(), {"lr": 1e-2, **GRAPHED}, _loss, batches[0])
    for b in batches[:5]:
        step(b)
    ragged = (batches[5][0][:7], batches[5][1][:7])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = step(ragged)
    assert torch.isfinite(loss)
    fallback = step.report()["fallback"]
    assert "batch tensor 0 is (7, 32)" in fallback and "drop_last" in fallback
    assert any("fasttrain.Step" in str(w.message) for w in seen)
    assert step.report()["graphed"] is False
    assert torch.isfinite(step(batches[0]))


@pytest.mark.gpu
def test_a_forward_that_waits_for_the_host_is_refused_in_one_line():
    def syncing_loss(model, b):
        out = model(b[0])
        if out.sum().item() > 1e9:  # a host sync: cannot be captured
            out = out * 0
        return F.cross_entropy(out, b[1])

    batches = _batches(6)
    step = fasttrain.Step(_model(), {"lr": 1e-2, **GRAPHED}, syncing_loss, batches[0])
    with pytest.raises(FasttrainError, match="could not be captured.*turn cuda_graphs off") as err:
        for b in batches:
            step(b)
    assert "\n" not in str(err.value)


@pytest.mark.gpu
def test_your_lr_scheduler_keeps_working_under_the_graph():
    batches = _batches(8)
    lrs = {}
    for name, switches in (("eager", EAGER), ("graphed", GRAPHED)):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        step = fasttrain.Step(model, opt, _loss, batches[0], recipe=switches)
        out = []
        for b in batches:
            out.append(step(b))
            sched.step()
        lrs[name] = (torch.stack(out).float().cpu(), float(opt.param_groups[0]["lr"]))
    torch.testing.assert_close(lrs["graphed"][0], lrs["eager"][0], rtol=2e-3, atol=0)
    assert lrs["graphed"][1] == pytest.approx(1e-2 / 16)


class _Tokens(torch.utils.data.Dataset):
    """Token sequences whose labels are partly ignored (-100), a different count per item."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randint(0, 50, (16,), generator=g)
        y = torch.randint(0, 50, (16,), generator=g)
        y[: i % 7] = -100
        return {"x": x, "y": y}


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(50, 32), nn.Linear(32, 50)

    def forward(self, x):
        return self.out(self.emb(x))


@pytest.mark.gpu
def test_the_graphed_loop_follows_varying_token_counts():
    wl = SimpleWorkload(name="tokens", build=_Tiny, data=_Tokens, unit="token", count_field="y",
                        ignore_index=-100, default_batch=4,
                        loss_fn=lambda m, b: F.cross_entropy(
                            m(b["x"]).flatten(0, 1), b["y"].flatten(), ignore_index=-100,
                            reduction="sum"))
    base = Recipe(precision="bf16-mixed", optimizer_impl="fused")
    eager = train(wl, base, steps=8, warmup=4, device="cuda")
    graphed = train(wl, base.replace(cuda_graphs=True), steps=8, warmup=4, device="cuda")
    torch.testing.assert_close(torch.tensor(graphed.losses), torch.tensor(eager.losses),
                               rtol=2e-3, atol=0)
    assert graphed.throughput_unit == "tok/s"
