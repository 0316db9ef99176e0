"""torch.compile must see each Triton kernel write only its outputs (tests/kernel_writes.py).

An input that Inductor's analysis marks as written is copied before every launch that still
needs it: the bias + GELU backward's saved activation was, costing a Swin-B step 0.9 ms
(profile-swin-base-20261121-233750) while every numerical test passed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def launches() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent / "src"), env.get("PYTHONPATH", "")])
    # as a module from the repository root: run as a script, tests/ would come first on the
    # path and tests/profile/ would shadow the standard library's profile module
    done = subprocess.run([sys.executable, "-m", "tests.kernel_writes"], env=env, cwd=TESTS.parent,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_is_analysed(launches):
    missing = [r["kernel"] for r in launches if r["writes"] is None]
    assert not missing, f"kernels the script never launched: {missing}"
    assert len({r["kernel"] for r in launches}) >= 10


def test_no_kernel_writes_its_inputs(launches):
    wrong = [(r["kernel"], r["inputs_written"]) for r in launches if r["inputs_written"]]
    assert not wrong, f"inputs Inductor would copy before each launch: {wrong}"


def test_every_kernel_writes_something(launches):
    assert all(r["writes"] for r in launches)
