"""No process outlives the command that started it, and no scratch folder outlives a ladder:
SIGKILL of a ``--nproc`` run ends torchrun and its ranks; SIGTERM of a ladder ends its rung's
process, removes its scratch folder and exits 143; a ladder killed outright leaves a folder
that the next one removes."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fasttrain.run.scratch import scratch, sweep

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _start(args: list[str], tmp: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp)}
    return subprocess.Popen([sys.executable, "-m", "fasttrain", *args, "--device", "cpu"],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def _wait_for(proc: subprocess.Popen, marker: str, count: int, limit: float = 300):
    """The descendants of ``proc`` once ``count`` of them run a command line with ``marker``."""
    deadline = time.time() + limit
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        kids = psutil.Process(proc.pid).children(recursive=True)
        if sum(marker in " ".join(k.cmdline()) for k in kids if _running(k)) >= count:
            time.sleep(1.0)  # past the children's start-up (their signal requests are in)
            return psutil.Process(proc.pid).children(recursive=True)
        time.sleep(0.2)
    raise AssertionError(f"no {count} × {marker!r} within {limit} s")


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _all_gone(procs, limit: float = 45) -> list:
    deadline = time.time() + limit
    while time.time() < deadline:
        left = [p for p in procs if _running(p)]
        if not left:
            return []
        time.sleep(0.2)
    for p in left:
        p.kill()
    return left


def test_sigkill_of_an_nproc_run_leaves_no_process(tmp_path):
    proc = _start(["train", "tests.helpers:slow_data_workload", "--nproc", "2",
                   "--steps", "100000"], tmp_path)
    kids = _wait_for(proc, "fasttrain", 3)  # the two ranks and torchrun (-m torch.distributed.run)
    proc.kill()
    proc.wait()
    assert not _all_gone(kids), "left running after SIGKILL of the command"


def test_sigterm_of_a_ladder_ends_its_rung_and_removes_its_scratch(tmp_path):
    proc = _start(["ladder", "tests.helpers:slow_data_workload", "--steps", "100000",
                   "--out", str(tmp_path / "out")], tmp_path)
    kids = _wait_for(proc, "fasttrain.run.child", 1)
    assert list(tmp_path.glob(f"fasttrain-ladder-{proc.pid}-*"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 143
    assert "terminated" in proc.stderr.read()
    assert not _all_gone(kids)
    assert not list(tmp_path.glob("fasttrain-ladder-*"))


def test_a_killed_ladder_ends_its_rung_and_the_next_one_removes_the_scratch(tmp_path):
    proc = _start(["ladder", "tests.helpers:slow_data_workload", "--steps", "100000",
                   "--out", str(tmp_path / "out")], tmp_path)
    kids = _wait_for(proc, "fasttrain.run.child", 1)
    proc.kill()
    proc.wait()
    assert not _all_gone(kids)  # the rung got SIGTERM when its parent died
    left = list(tmp_path.glob(f"fasttrain-ladder-{proc.pid}-*"))
    assert left  # nothing could remove it ...
    with scratch("ladder", tmp_path) as mine:  # ... until the next command starts
        assert mine.exists() and not any(p.exists() for p in left)


def test_sweep_keeps_the_folders_of_running_commands(tmp_path):
    live = tmp_path / f"fasttrain-ladder-{os.getpid()}-abc"
    live.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"fasttrain-infer-{dead.pid}-xyz"
    gone.mkdir()
    other = tmp_path / "fasttrain-cache"
    other.mkdir()
    assert sweep(tmp_path) == [gone]
    assert live.exists() and other.exists() and not gone.exists()
