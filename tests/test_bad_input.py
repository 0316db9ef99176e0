"""A user's mistakes end in one line on stderr and exit status 2, never a traceback; a run whose
loss goes non-finite ends in one line and exit status 1. The CLI runs in-process (``main``)."""
from __future__ import annotations

import errno
import json
import os
import re
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


class _Uneven(Dataset):
    """Sequences of 5 to 7 values, their sums the targets."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        x = torch.arange(5 + i % 3, dtype=torch.float32) / 10
        return {"x": x, "y": x.sum().reshape(1)}


def _padded_sum(model, batch):
    return ((model(batch["x"].sum(-1, keepdim=True)) - batch["y"]) ** 2).sum()


def uneven_items(size="tiny", seed=0, data=None, pad: bool = False):
    return SimpleWorkload(build=lambda: nn.Linear(1, 1), data=_Uneven(), loss_fn=_padded_sum,
                          default_batch=4, pad_fields={"x": 0} if pad else {})


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
    ("uneven_items", "field 'x' holds items of shapes (5,) and (6,): batches stack items of "
                     "one shape; give items of one shape, or pad_fields={'x': PAD}"),
])
def test_workload_contract(capsys, factory, needle):
    _one_line(capsys, ["train", f"tests.test_bad_input:{factory}", *FAST], 2, needle)
    with pytest.raises(FasttrainError, match=re.escape(needle)):
        train(globals()[factory](), Recipe(), steps=1, warmup=0, device="cpu")


def test_uneven_items_are_named_past_a_field_that_is_not_a_tensor():
    from fasttrain.workloads.base import uneven

    items = [{"path": "a.jpg", "ids": torch.zeros(3)}, {"path": "b.jpg", "ids": torch.zeros(4)}]
    assert uneven(items).startswith("the data set's field 'ids' holds items of shapes (3,) and "
                                    "(4,)")


def test_pad_fields_pad_a_users_uneven_items():
    res = train(uneven_items(pad=True), Recipe(), steps=2, warmup=0, device="cpu")
    assert len(res.losses) == 2 and all(loss == loss for loss in res.losses)  # not NaN


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


# --- every subcommand and option; refused before anything runs unless said otherwise ---

def not_a_workload(size="tiny", seed=0, data=None):
    return 42


def crashing_loss(size="tiny", seed=0, data=None):
    def boom(model, batch):
        raise RuntimeError("my loss broke")

    return _workload(boom)


@pytest.fixture
def bad(files):
    """Files that are wrong in every way a user's file can be."""
    (files / "syntax.toml").write_text("precision = [\n")
    (files / "unknown.toml").write_text("warp_drive = true\n")
    (files / "type.toml").write_text("precision = 3\n")
    (files / "lr.toml").write_text("lr = 1.0\n")
    (files / "empty.jsonl").write_text("\n")
    (files / "text.jsonl").write_text("rows, not JSON\n")
    (files / "list.jsonl").write_text("[1, 2]\n")
    (files / "ckpt-bad").mkdir()
    (files / "ckpt-bad" / "fasttrain.json").write_text("{ damaged")
    return files


# 10: command lines argparse refuses: one line naming the command, not the usage block
@pytest.mark.parametrize("argv,needle", [
    ([], "the following arguments are required: command"),
    (["nosuchcmd"], "invalid choice: 'nosuchcmd'"),
    (["train", "vit", "--batch", "abc"], "train: argument --batch: invalid int value: 'abc'"),
    (["train", "vit", "--batch", "1.5"], "argument --batch: invalid int value: '1.5'"),
    (["train", "vit", "--steps", "x"], "argument --steps: invalid int value"),
    (["ladder", "vit", "--warmup", "2.5"], "ladder: argument --warmup: invalid int value"),
    (["ladder", "vit", "--rung-timeout", "soon"], "argument --rung-timeout: invalid float"),
    (["fit", "vit", "--objective", "speed"], "fit: argument --objective: invalid choice"),
    (["profile", "vit", "--active", "x"], "profile: argument --active: invalid int value"),
    (["scaling", "vit", "--per-gpu-batch", "x"], "scaling: argument --per-gpu-batch"),
    (["train", "vit", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["report"], "report: the following arguments are required: rows"),
    (["workloads", "extra"], "unrecognized arguments: extra"),
    (["presets", "extra"], "unrecognized arguments: extra"),
])
def test_command_lines_argparse_refuses(capsys, argv, needle):
    _one_line(capsys, argv, 2, needle)


# 11: an unknown workload, in every subcommand that takes one
@pytest.mark.parametrize("command", ["ladder", "train", "profile", "fit", "scaling"])
def test_unknown_workload_in_every_subcommand(capsys, tmp_path, command):
    argv = [command, "nosuch", "--size", "tiny", "--device", "cpu"]
    if command != "train":
        argv += ["--out", str(tmp_path / "o")]
    if command == "fit":
        argv += ["--memory-budget", "1"]
    _one_line(capsys, argv, 2, "unknown workload 'nosuch'")


# 12: --set, --opt and recipe files
@pytest.mark.parametrize("extra,needle", [
    (["--set", "warp_drive=1"], "recipe: unknown switch 'warp_drive'"),
    (["--set", "precision=fp7"], "precision='fp7' is not one of"),
    (["--set", "lr=fast"], "recipe: lr expects float, got 'fast'"),
    (["--set", "batch=two"], "recipe: batch expects int, got 'two'"),
    (["--set", "cuda_graphs=maybe"], "cuda_graphs expects bool"),
    (["--set", "lr=-1"], "recipe: lr must be >= 0 (0: the workload's own), not -1.0"),
    (["--set", "ema_decay=1"], "recipe: ema_decay must be in [0, 1), not 1.0"),
    (["--set", "precison=bf16-mixed"], "unknown switch 'precison': did you mean 'precision'?"),
    (["--set", "precision"], "--set expects key=value"),
    (["--set", "batch=3", "--set", "accumulation=2"], "not divisible by accumulation=2"),
    (["--set", "cuda_graphs=true"], "cuda_graphs needs CUDA"),
    (["--opt", "depth=3"], "workload 'vit' has no option 'depth'"),
    (["--opt", "depth"], "--opt expects key=value"),
    (["--recipe", "missing.toml"], "does not exist"),
    (["--recipe", "syntax.toml"], "syntax.toml: "),
    (["--recipe", "unknown.toml"], "unknown switch 'warp_drive'"),
    (["--recipe", "type.toml"], "precision expects str, got 3"),
    (["--recipe", "empty"], "does not exist"),
    (["--preset", "nosuch"], "no preset 'nosuch'"),
    (["--preset", "vit-base", "--recipe", "lr.toml"], "give --preset or --recipe, not both"),
    (["--preset", "fast"], "not on a CPU"),
])
def test_bad_recipes_and_options(capsys, bad, extra, needle):
    extra = [str(bad / x) if x.endswith((".toml", "empty")) else x for x in extra]
    _one_line(capsys, ["train", "vit", *FAST, *extra], 2, needle)


@pytest.mark.parametrize("extra,needle", [
    (["--opt", "vocab=many"], "workload 'llama': option 'vocab' takes an integer or None, got 'many'"),
    (["--opt", "varlen=maybe"], "option 'varlen' is a switch, got 'maybe': give true or false"),
    (["--opt", "seq_len=1.5"], "option 'seq_len' takes an integer or None, got 1.5"),
    (["--opt", "vocab=-5"], "vocab must be at least 2"),
])
def test_bad_workload_option_values(capsys, extra, needle):
    _one_line(capsys, ["train", "llama", *FAST, *extra], 2, needle)


# 13: ladder options
@pytest.mark.parametrize("extra,needle", [
    (["--rungs", "warp"], "unknown rung 'warp'"),
    (["--rungs", "fp32,,warp"], "unknown rung 'warp'"),
    (["--rungs", "none"], "--rungs none runs only the peer: add --peer"),
    (["--rungs", "fp32", "--from", "nope"], "--from 'nope' is not a rung"),
    (["--rungs", "fp32", "--batch", "-3"], "--batch must be >= 1"),
    (["--rungs", "fp32", "--warmup", "-1"], "--warmup >= 0"),
    (["--rungs", "fp32", "--nnodes", "2"], "ladder runs on one node"),
    (["--rungs", "fp32", "--set", "warp_drive=1"], "unknown switch 'warp_drive'"),
    (["--rungs", "fp32", "--device", "cuda:x"], "unknown device 'cuda:x'"),
    (["--long", "10"], "--long takes at least 40 steps"),
    (["--long", "100", "--peer"], "--long takes at least 40 steps (2,000 make the point), on one"),
    (["--long", "100", "--rungs", "fp9"], "--long: unknown variant 'fp9': use fp8, bf16-stream"),
])
def test_bad_ladder_options(capsys, tmp_path, extra, needle):
    _one_line(capsys, ["ladder", "vit", *FAST, "--out", str(tmp_path / "o"), *extra], 2, needle)


# 14: --device
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_machine_without_it(capsys, device):
    _one_line(capsys, ["train", "vit", "--size", "tiny", "--steps", "1", "--device", device], 2,
              "CUDA is not available")


@pytest.mark.parametrize("device", ["", "gpu0", "cuda:x"])
def test_nonsense_device(capsys, device):
    _one_line(capsys, ["train", "vit", "--size", "tiny", "--device", device], 2,
              "unknown device")


# 15: --data of the other workloads
@pytest.mark.parametrize("workload,data,needle", [
    ("sd", "missing", "does not exist"),
    ("sd", "a-file", "is a file"),
    ("llama", "empty", "token file"),
])
def test_bad_data_of_other_workloads(capsys, files, workload, data, needle):
    _one_line(capsys, ["train", workload, *FAST, "--data", str(files / data)], 2, needle)


# 16: --resume, --save, --export
@pytest.mark.parametrize("resume,needle", [
    ("missing", "the folder does not exist"),
    ("empty", "no fasttrain checkpoint in"),
    ("a-file", "no fasttrain checkpoint in"),
    ("ckpt-bad", "fasttrain.json is damaged"),
])
def test_resume_from_what_is_not_a_checkpoint(capsys, bad, resume, needle):
    _one_line(capsys, ["train", "vit", *FAST, "--resume", str(bad / resume)], 2, needle)


@pytest.mark.parametrize("extra,needle", [
    (["--export", "model.pt"], "--export consolidates the checkpoint of --save; give both"),
    (["--save", "ckpt", "--export", "missing/model.pt"], "does not exist"),
    (["--save", "ckpt", "--export", "empty"], "is a folder: give a file name"),
])
def test_bad_export(capsys, files, extra, needle):
    extra = [x if x.startswith("--") else str(files / x) for x in extra]
    _one_line(capsys, ["train", "vit", *FAST, *extra], 2, needle)
    assert not (files / "ckpt").exists()  # refused before the run


def test_resume_auto_without_save(capsys):
    _one_line(capsys, ["train", "vit", *FAST, "--resume", "auto"], 2,
              "--resume auto continues the newest save of --save DIR; give --save")


# 17: module:factory
@pytest.mark.parametrize("spec,needle", [
    ("nosuch_module_xyz:make", "cannot import 'nosuch_module_xyz'"),
    ("tests.test_bad_input:nosuch", "has no callable 'nosuch'"),
    ("tests.test_bad_input:not_a_workload", "factory returned int, not a Workload"),
    ("tests.test_bad_input:", "give package.module:factory (both parts)"),
    (":make", "give package.module:factory (both parts)"),
])
def test_bad_module_factory(capsys, spec, needle):
    _one_line(capsys, ["train", spec, *FAST], 2, needle)


@pytest.mark.parametrize("source,spec,needle", [
    ("def make(:\n", "usermod_syntax:make", "raised SyntaxError: invalid syntax ("),
    ("raise RuntimeError('no GPU here')\n", "usermod_raises:make",
     "importing 'usermod_raises' raised RuntimeError: no GPU here; fix the module"),
    ("", "usermod_path.py:make", "is a file path: give a module path, e.g. usermod_path:make"),
    ("", "pkg/usermod_path:make", "give a module path, e.g. pkg.usermod_path:make"),
    ("", "nosuchpkg_xyz.mod:make", "run from the folder that holds it"),
])
def test_a_user_module_that_cannot_load_is_a_mistake(capsys, tmp_path, monkeypatch, source, spec,
                                                     needle):
    """A module with a syntax error, one that raises as it loads, a file path given for a
    module path and a package not found from here: exit 2, one line."""
    name = spec.split(":")[0].removesuffix(".py").split("/")[-1]
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    _one_line(capsys, ["train", spec, *FAST, "--out", str(tmp_path / "o")], 2, needle)
    assert not list((tmp_path / "o").glob("*")) if (tmp_path / "o").exists() else True


# 18: report
@pytest.mark.parametrize("name,needle", [
    ("missing.jsonl", "no such rows file"),
    ("empty.jsonl", "holds no rows"),
    ("text.jsonl", "line 1: not JSON"),
    ("list.jsonl", "line 1: not a row"),
    ("empty", "is a folder"),
])
def test_bad_rows_files(capsys, bad, name, needle):
    _one_line(capsys, ["report", str(bad / name)], 2, needle)
    _one_line(capsys, ["report", "--markdown", str(bad / name)], 2, needle)


# 19: --out of every command that writes rows
@pytest.mark.parametrize("command", [["train"], ["ladder", "--rungs", "fp32"], ["profile"],
                                     ["fit", "--memory-budget", "1"], ["scaling"]])
@pytest.mark.parametrize("out,needle", [("a-file", "is a file, not a folder"),
                                        ("a-file/sub", "cannot create the folder")])
def test_out_that_cannot_be_a_folder(capsys, files, command, out, needle):
    argv = [command[0], "vit", *command[1:], "--size", "tiny", "--steps", "2", "--warmup", "0",
            "--device", "cpu", "--out", str(files / out)]
    _one_line(capsys, argv, 2, needle)


# 20: profile, fit and scaling values
@pytest.mark.parametrize("extra,needle", [
    (["profile", "--steps", "1"], "profile: --steps must be >= 2"),
    (["profile", "--active", "0"], "--active >= 1"),
    (["profile", "--suggest-recipe", "empty"], "--suggest-recipe"),
    (["profile", "--suggest-recipe", "missing/r.toml"], "does not exist"),
    (["fit"], "on CPU give --memory-budget"),
    (["fit", "--memory-budget", "-1"], "--memory-budget must be > 0"),
    (["fit", "--memory-budget", "1", "--headroom", "2"], "--headroom must be in [0, 0.9)"),
    (["fit", "--memory-budget", "1", "--max-batch", "0"], "--max-batch and"),
    (["fit", "--memory-budget", "1", "--multiple-of", "0"], "--multiple-of >= 1"),
    (["scaling", "--worlds", "a,b"], "--worlds expects numbers"),
    (["scaling", "--worlds", "2,4"], "include 1"),
    (["scaling", "--worlds", "1,0"], "process counts >= 1"),
    (["scaling", "--per-gpu-batch", "0"], "--per-gpu-batch must be >= 1"),
    (["scaling", "--sharding", "bogus"], "sharding='bogus' is not one of"),
])
def test_bad_profile_fit_scaling_values(capsys, files, extra, needle):
    extra = [str(files / x) if x in ("empty", "missing/r.toml") else x for x in extra]
    argv = [extra[0], "vit", "--size", "tiny", "--steps", "2", "--warmup", "0", "--device",
            "cpu", "--out", str(files / "o"), *extra[1:]]
    _one_line(capsys, argv, 2, needle)


# --- runs that fail: one line, exit status 1 ---

def test_a_crash_in_the_run_is_one_line_and_exit_1(capsys, monkeypatch):
    monkeypatch.delenv("FASTTRAIN_TRACEBACK", raising=False)
    _one_line(capsys, ["train", "tests.test_bad_input:crashing_loss", *FAST], 1,
              "the run failed: RuntimeError: my loss broke")


def test_a_crash_shows_its_traceback_when_asked(capsys, monkeypatch):
    monkeypatch.setenv("FASTTRAIN_TRACEBACK", "1")
    assert main(["train", "tests.test_bad_input:crashing_loss", *FAST]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("fasttrain: error: ")


def test_a_ladder_whose_rungs_all_crash_exits_1(capsys, tmp_path):
    _one_line(capsys, ["ladder", "tests.helpers:broken_workload", *FAST, "--rungs", "fp32",
                       "--out", str(tmp_path)], 1, "the ladder failed: fp32 (error)")


def test_a_ladder_of_skipped_rungs_only_exits_1(capsys, tmp_path):
    _one_line(capsys, ["ladder", "vit", *FAST, "--rungs", "cuda-graphs", "--out", str(tmp_path)],
              1, "every rung was skipped (cuda_graphs needs CUDA)")


def _fake_ladder(monkeypatch, rows, interrupt=False):
    """run_ladder replaced by one that reports ``rows`` (and then is interrupted)."""
    from fasttrain.ladder import runner
    from fasttrain.measure.rows import append_row

    def run(spec, on_row=None, on_start=None):
        for i, row in enumerate(rows):
            append_row(spec.out, row)
            on_row(row, i, len(rows))
        if interrupt:
            raise KeyboardInterrupt
        return rows

    monkeypatch.setattr(runner, "run_ladder", run)


_OK = {"kind": "ladder", "rung": "fp32", "workload": "vit", "size": "tiny", "batch": 8,
       "step_time_s": 0.1, "throughput": 80.0, "throughput_unit": "img/s", "error": None,
       "parity": None, "device": "cpu"}


@pytest.mark.parametrize("rows,code,needle", [
    ([_OK, {**_OK, "rung": "bf16", "parity": {"passed": False, "max_rel_dev": 0.5}}], 1,
     "the ladder failed: bf16 (parity)"),
    ([_OK, {**_OK, "kind": "peer", "rung": "peer", "error": "ImportError: no timm"}], 1,
     "the ladder failed: peer (error)"),
    ([_OK, {**_OK, "rung": "bf16", "error": "OOM"}], 1, "the ladder failed: bf16 (error)"),
    ([{**_OK, "skipped": "needs CUDA"}, {**_OK, "rung": "bf16", "skipped": "needs CUDA"}], 1,
     "every rung was skipped (needs CUDA)"),
])
def test_ladder_exit_status(capsys, monkeypatch, tmp_path, rows, code, needle):
    _fake_ladder(monkeypatch, rows)
    _one_line(capsys, ["ladder", "vit", *FAST, "--rungs", "fp32", "--out", str(tmp_path)],
              code, needle)


def test_a_passing_ladder_exits_0(capsys, monkeypatch, tmp_path):
    _fake_ladder(monkeypatch, [_OK, {**_OK, "rung": "bf16", "parity": {"passed": True,
                                                                       "max_rel_dev": 1e-3}}])
    assert main(["ladder", "vit", *FAST, "--rungs", "fp32", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""


def test_ctrl_c_in_a_ladder_says_where_the_rows_are(capsys, monkeypatch, tmp_path):
    _fake_ladder(monkeypatch, [_OK], interrupt=True)
    assert main(["ladder", "vit", *FAST, "--rungs", "fp32", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    (rows,) = tmp_path.glob("ladder-*.jsonl")
    assert len(err) == 1 and "interrupted" in err[0] and str(rows) in err[0]


def test_ctrl_c_before_the_first_row_leaves_no_empty_rows_file(capsys, monkeypatch, tmp_path):
    _fake_ladder(monkeypatch, [], interrupt=True)
    assert main(["ladder", "vit", *FAST, "--rungs", "fp32", "--out", str(tmp_path)]) == 130
    assert "no row finished" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("code,needle", [
    (errno.ENOSPC, "the disk is full: cannot write "),
    (errno.EDQUOT, "the disk quota is exceeded: cannot write "),
])
def test_a_ladder_on_a_full_disk_is_one_line_and_prints_its_row(capsys, monkeypatch, tmp_path,
                                                                code, needle):
    _fake_ladder(monkeypatch, [_OK, {**_OK, "rung": "bf16"}])
    real, torn = os.write, []

    def write(fd, data):  # the second row finds the disk full after 10 of its bytes
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)) \
                or os.fstat(fd).st_size == 0:
            return real(fd, data)
        if not torn:
            torn.append(fd)
            return real(fd, bytes(data[:10]))
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "write", write)
    rc = main(["ladder", "vit", *FAST, "--rungs", "fp32", "--out", str(tmp_path)])
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    (rows,) = tmp_path.glob("ladder-*.jsonl")
    assert rc == 1 and len(err) == 1 and "Traceback" not in cap.err + cap.out, cap.err
    assert err[0].startswith(f"fasttrain: error: {needle}{rows} (")
    assert err[0].endswith("bytes needed): free space or pass --out elsewhere")
    assert [json.loads(x)["rung"] for x in rows.read_text().splitlines()] == ["fp32"]
    note, line = [x for x in cap.out.splitlines() if "not saved" in x or x.startswith("{")]
    assert "this row was not saved" in note and json.loads(line)["rung"] == "bf16"


# --- fasttrain infer: refused before any rung's process starts ---

INFER = ["infer", "vit", "--device", "cpu", "--images", "8", "--iters", "1", "--warmup", "0",
         "--batch", "4", "--rungs", "eager-fp16", "--no-peer"]
INFER_PATHS = {"missing", "empty", "ckpt-bad", "missing/model.pt2", "folder.pt2"}  # in bad/


@pytest.mark.parametrize("extra,needle", [
    (["--batch", "0"], "--batch must be a positive number, not 0"),
    (["--images", "0"], "--images must be a positive number, not 0"),
    (["--iters", "0"], "--iters must be a positive number, not 0"),
    (["--warmup", "-1"], "--warmup must be 0 or more, not -1"),
    (["--rungs", "nonsense"], "unknown inference rung 'nonsense'"),
    (["--rungs", "sdpa,,warp"], "unknown inference rung 'warp'"),
    (["--rungs", ","], "--rungs names no rung"),
    (["--rung-timeout", "0"], "--rung-timeout must be > 0"),
    (["--export", "model.pt"], "an AOTInductor package is a .pt2 file"),
    (["--export", "missing/model.pt2"], "no folder"),
    (["--export", "folder.pt2"], "is a folder: give a file name"),
    (["--checkpoint", "missing"], "no such folder"),
    (["--checkpoint", "empty"], "no fasttrain checkpoint in"),
    (["--checkpoint", "ckpt-bad"], "fasttrain.json is damaged"),
    (["--data", "missing"], "does not exist"),
    (["--data", "empty"], "no images in"),
    (["--opt", "depth=3"], "workload 'vit' has no option 'depth'"),
    (["--size", "huge"], "unknown size 'huge'"),
    (["--device", "tpu"], "unknown device 'tpu'"),
])
def test_bad_infer_options(capsys, bad, extra, needle):
    (bad / "folder.pt2").mkdir()
    extra = [str(bad / x) if x in INFER_PATHS else x for x in extra]
    _one_line(capsys, [*INFER, "--out", str(bad / "o"), *extra], 2, needle)
    assert not list(bad.glob("o/*.jsonl"))  # no rung ran


@pytest.mark.parametrize("workload,needle", [
    ("llama", "serves image classifiers; llama is not one (it counts tokens; use timm:…, vit, "
              "swin or a module:function workload of unit img)"),
    ("nosuch", "unknown workload 'nosuch'"),
])
def test_infer_of_what_is_not_an_image_classifier(capsys, tmp_path, workload, needle):
    argv = [*INFER, "--out", str(tmp_path / "o")]
    argv[1] = workload
    _one_line(capsys, argv, 2, needle)


def test_infer_a_checkpoint_of_another_workload(capsys, tmp_path):
    assert main(["train", "vit", *FAST, "--save", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    argv = [*INFER, "--out", str(tmp_path / "o"), "--checkpoint", str(tmp_path / "ckpt")]
    argv[1] = "swin"
    _one_line(capsys, argv, 2, "holds a vit tiny checkpoint, this run is swin tiny")
    argv[1:2] = ["vit", "--size", "base"]
    _one_line(capsys, argv, 2, "holds a vit tiny checkpoint, this run is vit base")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
def test_infer_on_cuda_on_a_machine_without_it(capsys, tmp_path):
    _one_line(capsys, [*INFER, "--out", str(tmp_path / "o"), "--device", "cuda"], 2,
              "CUDA is not available")


@pytest.mark.parametrize("text,value", [("false", False), ("False", False), ("0", False),
                                        ("no", False), ("true", True), ("1", True)])
def test_a_switch_option_given_as_text_is_that_truth_value(text, value):
    """``--opt varlen=false`` is False: a non-empty string handed on as is would be true."""
    from fasttrain.cli.common import _options
    from fasttrain.workloads import load_workload

    assert load_workload("llama", "tiny", **_options([f"varlen={text}"])).varlen is value


def test_options_of_a_factory_without_annotations_take_their_defaults_types():
    """``def make(..., flag=False)``: --opt flag=false is False; typing's Optional too."""
    import inspect
    from typing import Optional

    from fasttrain.workloads import _coerce

    def make(size="tiny", flag=False, rate=0.5, n: Optional[int] = 3, on: Optional[bool] = None,
             name="x"):
        ...

    ps = inspect.signature(make).parameters
    assert _coerce("w", "flag", ps["flag"], "false") is False
    assert _coerce("w", "rate", ps["rate"], 1) == 1.0
    assert _coerce("w", "n", ps["n"], None) is None and _coerce("w", "on", ps["on"], "yes") is True
    assert _coerce("w", "name", ps["name"], "false") == "false"  # a string stays one
    with pytest.raises(FasttrainError, match="option 'flag' is a switch, got 'maybe'"):
        _coerce("w", "flag", ps["flag"], "maybe")


def test_options_before_the_command_are_the_top_levels_mistake(capsys):
    _one_line(capsys, ["--steps=5", "train", "vit", *FAST], 2,
              "unrecognized arguments: --steps=5 (see fasttrain --help)")
