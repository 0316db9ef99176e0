"""Faults under torchrun on 2 GPUs (marker ``gpu``; skipped with fewer than 2): a rank hung
inside a training step is named before NCCL's own timeout: by the per-step monitored barrier,
and, where fp16's overflow read blocks the other rank's host inside the step, by the step
watchdog."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_rank_hung_inside_a_step_on_cuda_is_named_before_nccls_timeout(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "fasttrain", "train",
                           "tests.helpers:hang_in_step3_on_rank1", "--device", "cuda", "--nproc",
                           "2", "--steps", "6", "--warmup", "0", "--set", "dist_timeout=10",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    took = time.time() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "fasttrain: error: rank 1 hung: never reached step" in proc.stderr, proc.stderr[-3000:]
    assert "Watchdog caught collective operation timeout" not in proc.stderr
    assert took < 10 + 33, took  # before NCCL's timeout (dist_timeout + 33 s) would fire


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_rank_hung_under_fp16_is_named_by_the_watchdog_before_nccls_timeout(tmp_path):
    """fp16-mixed: GradScaler reads its overflow flag inside the step, so rank 0's host blocks
    behind the all-reduce rank 1 never joined and no step boundary comes; the watchdog names
    rank 1 after dist_timeout + STALLED_AFTER_S and its reads."""
    from fasttrain.distributed.env import GRACE_S
    from fasttrain.distributed.watchdog import STALLED_AFTER_S

    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "fasttrain", "train",
                           "tests.helpers:hang_in_step3_on_rank1", "--device", "cuda", "--nproc",
                           "2", "--steps", "6", "--warmup", "0", "--set", "dist_timeout=10",
                           "--set", "precision=fp16-mixed", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    took = time.time() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "fasttrain: error: rank 1 hung: never reached the collectives of step " in \
        proc.stderr, proc.stderr[-3000:]  # the watchdog's line, not the step barrier's
    assert "Watchdog caught collective operation timeout" not in proc.stderr
    assert took < 60 + 10 + STALLED_AFTER_S + 4 * GRACE_S, took
