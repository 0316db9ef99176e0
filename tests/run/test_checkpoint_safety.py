"""Resuming is safe and keeps the schedule: nothing in a checkpoint folder is unpickled with code
execution, and a cosine schedule continues over the whole run instead of staying at 0."""
import pathlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fasttrain.run.loop as loop
from fasttrain.errors import FasttrainError
from fasttrain.recipe import Recipe
from fasttrain.run.checkpoint import export
from fasttrain.run.loop import Observer, train
from fasttrain.workloads import load_workload


class _Touch:
    """Unpickled without restriction, this creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


class _LRs(Observer):
    """The learning rate each step runs with."""

    def attach(self, state):
        self.opt, self.lrs = state.optimizer, []

    def begin(self, step):
        self.lrs.append(float(self.opt.param_groups[0]["lr"]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real 2-step vit tiny checkpoint (cosine schedule), written once for this module: its
    step folder, one save's files."""
    folder = tmp_path_factory.mktemp("ckpt") / "c"
    train(load_workload("vit", "tiny"), Recipe(schedule="cosine"), steps=2, warmup=0,
          device="cpu", save_to=str(folder))
    return folder / "step-000002"


def _copy(saved, tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    for f in saved.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def _resume(folder, steps=1):
    return train(load_workload("vit", "tiny"), Recipe(schedule="cosine"), steps=steps,
                 warmup=0, device="cpu", resume_from=str(folder))


def test_a_crafted_metadata_file_is_refused_and_never_run(saved, tmp_path):
    folder, marker = _copy(saved, tmp_path), tmp_path / "MARKER"
    (folder / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    pickle.loads((folder / ".metadata").read_bytes())  # what DCP's reader would do: it runs
    assert marker.exists()
    marker.unlink()
    with pytest.raises(FasttrainError, match=r"\.metadata is not .*will not be loaded") as err:
        _resume(folder)
    assert "\n" not in str(err.value) and not marker.exists()
    with pytest.raises(FasttrainError, match="will not be loaded"):
        export(folder, tmp_path / "m.pt")
    assert not marker.exists()


def test_a_crafted_learning_rate_entry_is_refused_and_never_run(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    marker = tmp_path / "MARKER"
    dcp_to_torch_save(str(saved), str(tmp_path / "full.pt"))  # our own file: safe to read
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    full["optim"]["param_groups"][0]["lr"] = _Touch(marker)
    folder = tmp_path / "c"
    dcp.save(full, checkpoint_id=str(folder))
    (folder / "fasttrain.json").write_bytes((saved / "fasttrain.json").read_bytes())
    # the crafted entry does run under DCP's default load: the test checks a real threat
    dcp_to_torch_save(str(folder), str(tmp_path / "unsafe.pt"))
    assert marker.exists()
    marker.unlink()
    with pytest.raises(FasttrainError, match=r"param_groups.*lr.*will not be loaded") as err:
        _resume(folder)
    assert "\n" not in str(err.value) and not marker.exists()
    with pytest.raises(FasttrainError, match="will not be loaded"):
        export(folder, tmp_path / "m.pt")
    assert not marker.exists()


def test_an_untouched_checkpoint_still_resumes_and_exports(saved, tmp_path):
    res = _resume(saved, steps=2)
    assert len(res.losses) == 2 and all(torch.isfinite(torch.tensor(res.losses)))
    full = torch.load(export(saved, tmp_path / "m.pt"), weights_only=True)
    assert "lr" in full["optim"]["param_groups"][0] and "head.weight" in full["model"]


def _straight_and_resumed(tmp_path, monkeypatch, n, k, declared):
    """Losses and learning rates of a straight n-step run, and of a run saved after k steps
    (its schedule spanning ``declared`` steps) then resumed for n - k steps."""
    wl, recipe = load_workload("vit", "tiny"), Recipe(schedule="cosine")
    straight = _LRs()
    losses = train(wl, recipe, steps=n, warmup=0, device="cpu", observers=(straight,)).losses
    real = loop.prepare
    with monkeypatch.context() as m:  # a run of `declared` steps, saved at step k
        m.setattr(loop, "prepare", lambda *a, total_steps=0: real(*a, total_steps=declared))
        train(wl, recipe, steps=k, warmup=0, device="cpu", save_to=str(tmp_path / "c"))
    resumed = _LRs()
    res = train(wl, recipe, steps=n - k, warmup=0, device="cpu", observers=(resumed,),
                resume_from=str(tmp_path / "c"))
    return losses, straight.lrs, res, resumed.lrs


def test_a_resumed_cosine_run_continues_the_straight_runs_schedule(tmp_path, monkeypatch):
    n, k = 6, 3
    losses, lrs, res, resumed_lrs = _straight_and_resumed(tmp_path, monkeypatch, n, k, n)
    assert min(resumed_lrs) > 0
    torch.testing.assert_close(torch.tensor(resumed_lrs), torch.tensor(lrs[k:]), rtol=1e-12,
                               atol=0)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(losses[k:]), rtol=0,
                               atol=1e-6)
    assert "cosine schedule at step 3 of 6" in res.applied["optimizer"]
    assert not any("stretched" in w for w in res.warnings)


def test_a_resume_past_the_schedules_end_stretches_it_and_says_so(tmp_path, monkeypatch):
    # the case: a 2-step run (its cosine ends at 0) resumed for 3 more steps
    _, lrs, res, resumed_lrs = _straight_and_resumed(tmp_path, monkeypatch, 5, 2, 2)
    assert min(resumed_lrs) > 0  # the lr was 0 on every resumed step before
    torch.testing.assert_close(torch.tensor(resumed_lrs), torch.tensor(lrs[2:]), rtol=1e-12,
                               atol=0)  # steps 2..4 of a 5-step cosine
    assert any("stretched to 5 steps" in w for w in res.warnings)
