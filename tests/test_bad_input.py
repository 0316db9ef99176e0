"""A user's mistakes end in one line on stderr and exit status 2, never a traceback; a run whose
loss goes non-finite ends in one line and exit status 1. The CLI runs in-process (``main``)."""
from __future__ import annotations

import os
import stat

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from fasttrain import FasttrainError, Recipe, SimpleWorkload, train
from fasttrain.cli import main

FAST = ["--size", "tiny", "--steps", "1", "--warmup", "0", "--device", "cpu"]
ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0


# user workloads, reached as tests.test_bad_input:NAME
class _Items(Dataset):
    def __init__(self, tuples: bool = False):
        self.tuples = tuples

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, generator=g), torch.randn(1, generator=g)
        return (x, y) if self.tuples else {"x": x, "y": y}


def _summed(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def _workload(loss_fn=_summed, tuples: bool = False) -> SimpleWorkload:
    return SimpleWorkload(build=lambda: nn.Linear(4, 1), data=_Items(tuples), loss_fn=loss_fn)


def broken(size="tiny", seed=0, data=None):
    raise RuntimeError("my factory broke")


def nan_loss(size="tiny", seed=0, data=None):
    return _workload(lambda m, b: _summed(m, b) * float("nan"))


def per_item_loss(size="tiny", seed=0, data=None):
    return _workload(lambda m, b: (m(b["x"]) - b["y"]) ** 2)


def tuple_items(size="tiny", seed=0, data=None):
    return _workload(tuples=True)


def _one_line(capsys, argv, code, needle):
    rc = main(argv)
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert rc == code, cap.err
    assert "Traceback" not in cap.err + cap.out
    assert len(lines) == 1 and needle in lines[0], cap.err
    assert lines[0].startswith("fasttrain: error: ")


def _read_only(path):
    path.mkdir()
    path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return path


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("not a folder")
    return tmp_path


# 1: --data
@pytest.mark.parametrize("workload,data,needle", [
    ("vit", "missing", "image folder"),
    ("vit", "a-file", "is a file: give the folder of your images"),
    ("vit", "empty", "no images in"),
    ("swin", "missing", "does not exist"),
    ("llama", "missing.bin", "token file"),
])
def test_bad_data_path(capsys, files, workload, data, needle):
    _one_line(capsys, ["train", workload, *FAST, "--data", str(files / data)], 2, needle)


def test_bad_data_path_in_the_ladder_is_refused_once(capsys, files):
    _one_line(capsys, ["ladder", "vit", *FAST, "--rungs", "fp32", "--out", str(files / "o"),
                       "--data", str(files / "missing")], 2, "does not exist")


# 2: --out
def test_out_is_a_file(capsys, files):
    _one_line(capsys, ["ladder", "vit", *FAST, "--rungs", "fp32", "--out",
                       str(files / "a-file")], 2, "is a file, not a folder")


@pytest.mark.skipif(ROOT_USER, reason="root writes into read-only folders")
def test_out_is_read_only(capsys, tmp_path):
    _one_line(capsys, ["ladder", "vit", *FAST, "--rungs", "fp32", "--out",
                       str(_read_only(tmp_path / "ro") / "o")], 2, "give a folder you can write")


# 3: --save
def test_save_into_a_file(capsys, files):
    _one_line(capsys, ["train", "vit", *FAST, "--save", str(files / "a-file")], 2,
              "is a file: give a folder")


@pytest.mark.skipif(ROOT_USER, reason="root writes into read-only folders")
def test_save_into_a_read_only_folder(capsys, tmp_path):
    _one_line(capsys, ["train", "vit", *FAST, "--save",
                       str(_read_only(tmp_path / "ro") / "ckpt")], 2, "not writable")


# 4: --device
@pytest.mark.parametrize("command", [["train"], ["ladder", "--rungs", "fp32"]])
def test_unknown_device(capsys, tmp_path, command):
    argv = [command[0], "vit", *command[1:], "--size", "tiny", "--steps", "1", "--warmup", "0",
            "--device", "tpu", "--out" if command[0] == "ladder" else "--set",
            str(tmp_path / "o") if command[0] == "ladder" else "seed=0"]
    _one_line(capsys, argv, 2, "unknown device 'tpu'")


def test_unknown_device_in_the_python_api():
    with pytest.raises(FasttrainError, match="unknown device 'tpu'"):
        train(_workload(), Recipe(), steps=1, warmup=0, device="tpu")


# 5: resuming another workload's checkpoint
def test_resume_another_workloads_checkpoint(capsys, tmp_path):
    assert main(["train", "vit", *FAST, "--save", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    _one_line(capsys, ["train", "llama", *FAST, "--resume", str(tmp_path / "ckpt")], 2,
              "holds a vit tiny checkpoint, this run is llama tiny")


# 6: a module:factory that raises
def test_factory_that_raises(capsys):
    _one_line(capsys, ["train", "tests.test_bad_input:broken", *FAST], 2,
              "'tests.test_bad_input:broken': its factory raised RuntimeError: my factory broke")


# 7: the workload contract, in the CLI and the Python API
@pytest.mark.parametrize("factory,needle", [
    ("per_item_loss", "must return a 0-dim tensor"),
    ("tuple_items", "items must be dicts of tensors"),
])
def test_workload_contract(capsys, factory, needle):
    _one_line(capsys, ["train", f"tests.test_bad_input:{factory}", *FAST], 2, needle)
    with pytest.raises(FasttrainError, match=needle):
        train(globals()[factory](), Recipe(), steps=1, warmup=0, device="cpu")


# 8: values argparse accepts but no run can use
@pytest.mark.parametrize("extra,needle", [
    (["--nproc", "0"], "--nproc and --nnodes must be >= 1"),
    (["--nproc", "-1"], "--nproc and --nnodes must be >= 1"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--rungs", ""], "--rungs names no rung"),
    (["--rung-timeout", "-5"], "--rung-timeout must be > 0"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_wrong_values(capsys, tmp_path, extra, needle):
    argv = ["ladder", "vit", *FAST, "--out", str(tmp_path / "o"), *extra]
    if "--rungs" not in extra:
        argv += ["--rungs", "fp32"]
    _one_line(capsys, argv, 2, needle)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.mark.parametrize("extra", [["--nproc", "0"], ["--batch", "0"], ["--steps", "0"]])
def test_wrong_values_in_train(capsys, extra):
    _one_line(capsys, ["train", "vit", *FAST, *extra], 2, "must be >= 1")


# 9: a loss that goes non-finite
def test_non_finite_loss_fails_the_run(capsys):
    _one_line(capsys, ["train", "tests.test_bad_input:nan_loss", *FAST], 1,
              "the loss became nan at step 1 of 1")


def test_first_non_finite_step_in_the_python_api():
    res = train(nan_loss(), Recipe(), steps=2, warmup=1, device="cpu")
    assert res.first_nonfinite() == 1
    assert train(_workload(), Recipe(), steps=1, warmup=0, device="cpu").first_nonfinite() is None
