"""The README's commands run as written: each `fasttrain …` line of its bash blocks parses, names
a workload, preset and files that exist; the CPU-safe ones run here; CI runs its test command."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fasttrain.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PLACEHOLDERS = ("my-model/", "my-images/", "ckpt/", "out/")  # a user's own files, named as examples


def commands() -> list[str]:
    """Every `fasttrain …` command in the README's bash blocks, comments and `&&` chains cut."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        lines = block.replace("\\\n", " ").splitlines()
        for line in lines:
            for part in line.split("#")[0].split("&&"):
                part = part.strip()
                if part.startswith("fasttrain "):
                    out.append(part)
                elif part == "fasttrain":
                    out.append(part)
    return out


def test_the_readme_has_its_commands():
    cmds = commands()
    assert "fasttrain ladder" in cmds and "fasttrain infer" in cmds and len(cmds) >= 15


@pytest.mark.parametrize("cmd", commands())
def test_each_command_parses_and_names_what_exists(cmd):
    argv = shlex.split(cmd)[1:]
    if not argv:  # the bare command prints its usage
        return
    args = build_parser().parse_args(argv)
    for opt in ("recipe", "data", "checkpoint"):
        value = getattr(args, opt, None)
        if value and not value.startswith(PLACEHOLDERS):
            assert (ROOT / value).exists(), f"{cmd}: {value} does not exist"
    preset = getattr(args, "preset", None)
    if preset and preset != "fast":
        from fasttrain.presets import presets

        assert preset in presets(), f"{cmd}: no shipped preset {preset}"
    workload = getattr(args, "workload", None)
    if workload:
        from fasttrain.workloads import PUBLIC, REGISTRY

        prefix = workload.partition(":")[0]
        assert workload in REGISTRY or prefix in PUBLIC or \
            (ROOT / (prefix.replace(".", "/") + ".py")).is_file(), f"{cmd}: unknown {workload}"


def test_the_cpu_safe_commands_run_as_written(capsys):
    assert "fasttrain presets" in commands()
    assert main(["presets"]) == 0
    assert "timm-vit-base" in capsys.readouterr().out


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    pytest_line = next(line for line in ci.splitlines() if "-m pytest" in line)
    readme_cmd = next(c for c in re.findall(r"```bash\n(.*?)```", README, flags=re.S)
                      if "pytest" in c).strip()
    assert pytest_line.strip().split("pytest", 1)[1] == readme_cmd.split("pytest", 1)[1]
