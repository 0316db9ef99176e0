"""A user's own workload (``package.module:factory`` returning a ``SimpleWorkload``): the README's
command as written, and a mistake in the workload as one line, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fasttrain import FasttrainError, Recipe, SimpleWorkload, load_workload, train
from fasttrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--size", "tiny", "--steps", "1", "--warmup", "0", "--device", "cpu"]
SPEC = "examples.my_workload:make_workload"  # README: "examples/my_workload.py is a complete one"


def _has_convertible() -> bool:
    import fasttrain.converters

    return hasattr(fasttrain.converters, "convertible")


needs_convertible = pytest.mark.skipif(
    not _has_convertible(), reason="fasttrain.converters.convertible (used by ladder/traits.py "
    "to pick a user model's rungs) does not exist yet")


def _env_without_repo() -> dict:
    """The environment of a user's shell: the repository is not on PYTHONPATH."""
    env = dict(os.environ)
    paths = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p).resolve() != ROOT]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _cli(how: str) -> list[str]:
    if how == "script":  # the README writes `fasttrain ladder ...`
        script = Path(sys.executable).parent / "fasttrain"
        if not script.exists():
            pytest.skip("no fasttrain console script next to this Python")
        return [str(script)]
    return [sys.executable, "-m", "fasttrain"]


# 4: the README's command, from the repository root
@needs_convertible
@pytest.mark.parametrize("how", ["python -m", "script"])
def test_readme_ladder_command_runs_from_the_repository_root(tmp_path, how):
    out = tmp_path / "out"
    argv = [*_cli(how), "ladder", SPEC, "--rungs", "fp32", "--steps", "2", "--warmup", "0",
            "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, env=_env_without_repo(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    rows = [json.loads(line) for f in out.glob("*.jsonl") for line in f.read_text().splitlines()]
    fp32 = [r for r in rows if r.get("rung") == "fp32"]
    assert fp32 and fp32[0].get("error") is None, rows
    assert fp32[0]["throughput_unit"] == "sample/s"


def test_readme_ladder_command_from_another_folder_is_one_line(tmp_path):
    argv = [*_cli("python -m"), "ladder", SPEC, "--rungs", "fp32", "--steps", "2", "--warmup",
            "0", "--device", "cpu", "--out", str(tmp_path / "out")]
    proc = subprocess.run(argv, cwd=tmp_path, env=_env_without_repo(), capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(lines) == 1 and lines[0].startswith("fasttrain: error: "), proc.stderr
    assert "cannot import 'examples.my_workload'" in lines[0]


# 7: mistakes in a user's workload
FACTORIES = '''
import torch
import torch.nn.functional as F
from fasttrain import SimpleWorkload

DATA = [{"x": torch.randn(4), "y": torch.tensor(i % 3)} for i in range(8)]


def _loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")


def parsecs(size="tiny", seed=0, data=None):
    return SimpleWorkload(build=lambda: torch.nn.Linear(4, 3), data=DATA, loss_fn=_loss,
                          unit="parsecs")


def ignored_samples(size="tiny", seed=0, data=None):
    return SimpleWorkload(build=lambda: torch.nn.Linear(4, 3), data=DATA, loss_fn=_loss,
                          unit="sample", ignore_index=-100)


def missing_count_field(size="tiny", seed=0, data=None):
    return SimpleWorkload(build=lambda: torch.nn.Linear(4, 3), data=DATA, loss_fn=_loss,
                          count_field="labels", default_batch=4)
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """A user's module ``user_factories`` on sys.path; its name, for ``name:factory`` specs."""
    name = "user_factories_for_fasttrain_tests"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)


def _one_line(capsys, argv, needle):
    rc = main(argv)
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert rc == 2, cap.err
    assert "Traceback" not in cap.err + cap.out
    assert len(lines) == 1 and lines[0].startswith("fasttrain: error: "), cap.err
    assert needle in lines[0], cap.err


def test_unknown_unit_is_one_line_naming_unit(capsys, factories):
    with pytest.raises(FasttrainError, match="unit 'parsecs' is not one of") as err:
        load_workload(f"{factories}:parsecs")
    assert "\n" not in str(err.value)
    _one_line(capsys, ["train", f"{factories}:parsecs", *FAST], "unit 'parsecs'")


def test_ignore_index_needs_unit_token(capsys, factories):
    with pytest.raises(ValueError, match="ignore_index applies to token counts"):
        SimpleWorkload(unit="sample", ignore_index=-100)
    with pytest.raises(FasttrainError, match="ignore_index"):
        load_workload(f"{factories}:ignored_samples")
    SimpleWorkload(unit="tokens", ignore_index=-100)  # with tokens it is the point


def test_build_must_be_callable():
    with pytest.raises(ValueError, match="build must be a callable returning the model, not int"):
        SimpleWorkload(build=3)
    # the usual slip: the model instead of its builder (calling it would run forward())
    with pytest.raises(ValueError, match="build must be a callable returning the model, not Linear"):
        SimpleWorkload(build=torch.nn.Linear(4, 3))


def test_missing_count_field_is_named_at_the_first_step(capsys, factories):
    wl = load_workload(f"{factories}:missing_count_field")  # fields are known only from data
    with pytest.raises((FasttrainError, ValueError),
                       match="count_field 'labels' is not in the batch \\(fields: x, y\\)"):
        train(wl, Recipe(), steps=1, warmup=0, device="cpu")
    _one_line(capsys, ["train", f"{factories}:missing_count_field", *FAST],
              "count_field 'labels' is not in the batch")


@pytest.mark.parametrize("spelling, unit", [
    ("sample", "sample"), ("samples", "sample"), ("img", "img"), ("image", "img"),
    ("images", "img"), ("tok", "tok"), ("token", "tok"), ("tokens", "tok"),
])
def test_unit_spellings_normalise(spelling, unit):
    wl = SimpleWorkload(unit=spelling)
    assert wl.unit == unit and wl.describe()["unit"] == unit
